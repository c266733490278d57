"""Import-only stand-ins for two modules SGLang 0.5.23 imports on CPU but
never calls there (test tree only; docs/connectors/sglang.md):

- `torchvision` (and any submodule): VLM configs and processors import it
  eagerly; the PyPI build cannot load beside CPU torch;
- `vllm._custom_ops` (with a bare `vllm` package): imported by the rotary
  embedding for unknown platforms; the generic platform runs forward_native.

A stand-in module answers every attribute with a placeholder that raises
when used, so a call that was thought never to happen fails loudly.
`install()` adds the finder once; real modules, when installed, win."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STANDS_IN_FOR = ("torchvision", "vllm")
# Of vllm only these: any other vllm module stays an ImportError (SGLang
# probes `vllm.logger` and others to learn whether vLLM is installed).
VLLM_MODULES = ("vllm", "vllm._custom_ops")


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Placeholder":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is an import-only stand-in (tests/sglang_cpu); it was called")

    def __mro_entries__(self, bases):
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in STANDS_IN_FOR:
            return None
        if name.startswith("vllm") and name not in VLLM_MODULES:
            return None
        for finder in sys.meta_path:  # a real installation wins
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                if finder.find_spec(name, path, target) is not None:
                    return None
            except (ImportError, ValueError):
                continue
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = types.ModuleType(spec.name) if spec.name == "vllm" else _StandInModule(spec.name)
        m.__path__ = []
        m.__ucm_stand_in__ = True
        return m

    def exec_module(self, module):
        return None


_FINDER = _Finder()


def install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)  # after the real finders
