"""Runs at the start of every Python process with tests/sglang_cpu on its
PYTHONPATH (the SGLang server and its scheduler subprocesses in the e2e
tests and `ucm bench sglang`): installs the import-only stand-ins and, once
SGLang's MHA host pool module is imported, the HiCache CPU shim. Test tree
only; nothing here is part of ucm."""
import importlib.abc
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stand_ins  # noqa: E402

stand_ins.install()

_TARGET = "sglang.srt.mem_cache.pool_host.mha"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Applies the shim right after SGLang's MHA host pool module loads."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            sys.modules[name] = module
            import hicache_cpu_shim

            hicache_cpu_shim.apply()
            sys.meta_path.remove(self) if self in sys.meta_path else None

        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
