"""Model identity: a stable fingerprint of the weights KV was computed with.

Blocks on NVMe and in cluster tiers outlive the engine that wrote them, so
the model part of a block namespace must change whenever the weights do,
even behind the same name, alias or path. `model_fingerprint` derives it
from what is on disk, engine-independently (connectors pass what their
engine adds, e.g. vLLM's dtype and quantization method, as `extra`):

- the model config: the mapping the caller gives (the engine's effective
  config, overrides applied) or else the directory's `config.json`; keys
  that name a place or a tool version (`_name_or_path`,
  `transformers_version`) are left out at any depth;
- the revision and `extra`;
- every weight file under the directory (or the one file given, e.g. a
  GGUF): its relative name, size and mtime (ns), and a SHA-256 over cheap
  content: the whole file up to 16 MiB (safetensors index JSON, small
  shards), else its first, middle and last 64 KiB and, for safetensors, its
  whole JSON header (tensor names, dtypes, shapes, offsets);
- small files that change the computation: `config.json`, `params.json`
  and the quantization configs, hashed whole.

A model that is not a local path is looked up in the Hugging Face cache
(`local_files_only`, never the network); found, its snapshot directory is
fingerprinted like a local one. Otherwise the hub id, the config and the
revision identify it, which is logged at info: weights changed behind the
same hub id and revision (a branch such as "main") are then not detected
(pin a commit as the revision, or set an explicit model id).

A copied or touched weight file changes the fingerprint: that costs misses,
never foreign bytes. The same files give the same fingerprint in every
process (SHA-256 over canonical JSON; nothing depends on `hash()` or the
directory's own path). Runs once per engine start, in the caller's thread.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

log = logging.getLogger(__name__)

IDENTITY_VERSION = 1
SAMPLE_BYTES = 64 << 10  # each of the first, middle and last samples of a large weight file
WHOLE_FILE_BYTES = 16 << 20  # weight files up to this size are hashed whole
MAX_HEADER_BYTES = 100 << 20  # a larger safetensors header length is not trusted as one

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5", ".npz")
CONFIG_FILES = ("config.json", "params.json", "quantize_config.json", "quant_config.json",
                "hf_quant_config.json")
_VOLATILE_KEYS = frozenset({"_name_or_path", "transformers_version"})


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """`digest`: 32 hex digits (128 bits of SHA-256). `source`: what it was
    derived from: "files" (a local directory or file), "hub-cache" (a hub
    snapshot on disk) or "config" (hub id, config and revision only).
    `weight_files`: how many weight files entered it."""

    digest: str
    source: str
    weight_files: int


def canonical(value: Any) -> Any:
    """`value` as plain JSON data with a stable form: mapping keys as
    strings, sets sorted, objects through their `to_dict()` or their
    `str()` (with any memory address replaced by the type's name, so the
    form is the same in every process)."""
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items() if str(k) not in _VOLATILE_KEYS}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return canonical(to_dict())
    text = str(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _dumps(value: Any) -> bytes:
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":")).encode()


def _content_digest(path: Path, size: int) -> str:
    """SHA-256 of the cheap content of one weight file (see the module doc)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            h.update(f.read())
            return h.hexdigest()
        if path.suffix == ".safetensors":
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
            if 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                h.update(b"header:")
                h.update(f.read(n))
        for at in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _file_entry(path: Path, name: str) -> list:
    st = path.stat()  # follows symlinks (hub snapshots link into blobs/)
    return [name, st.st_size, st.st_mtime_ns, _content_digest(path, st.st_size)]


def _weight_files(root: Path) -> list[tuple[Path, str]]:
    """(path, name relative to root) of every weight file under `root`, in
    name order; dot-directories (.git, .cache) are skipped."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in filenames:
            if fn.endswith(WEIGHT_SUFFIXES) or fn.endswith(".index.json"):
                p = Path(dirpath) / fn
                out.append((p, p.relative_to(root).as_posix()))
    return sorted(out, key=lambda e: e[1])


def _hub_snapshot(model: str, revision: Optional[str]) -> Optional[Path]:
    """The local snapshot directory of hub model `model`, or None when it is
    not in the Hugging Face cache (or huggingface_hub is not installed).
    Never touches the network."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached, not a valid repo id, ...
        log.debug("model %r not found in the Hugging Face cache", model, exc_info=True)
        return None


def model_fingerprint(model: Union[str, os.PathLike], *, revision: Optional[str] = None,
                      config: Optional[Mapping[str, Any]] = None,
                      extra: Optional[Mapping[str, Any]] = None) -> ModelFingerprint:
    """The fingerprint of `model` (a local directory, a local weight file or
    a hub id) with the effective `config` mapping (default: the directory's
    config.json), `revision` and caller-specific `extra` data (any JSON-like
    values: dtype, quantization method, ...). See the module docstring."""
    path = Path(os.fspath(model)).expanduser()
    source = "files"
    if not path.exists():
        snap = _hub_snapshot(os.fspath(model), revision)
        if snap is not None and snap.is_dir():
            path, source = snap, "hub-cache"
    doc: dict[str, Any] = {"v": IDENTITY_VERSION, "revision": revision, "extra": extra or {}}
    entries: list = []
    if path.is_file():
        entries.append(_file_entry(path, ""))  # a single file: its name does not matter
        doc["weights"] = entries
    elif path.is_dir():
        entries = [_file_entry(p, name) for p, name in _weight_files(path)]
        doc["weights"] = entries
        doc["configs"] = {name: hashlib.sha256((path / name).read_bytes()).hexdigest()
                          for name in CONFIG_FILES if (path / name).is_file()}
        if config is None and (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
        if not entries:
            log.info("model %s: no weight files under %s; its identity is its config and revision only",
                     model, path)
    else:
        source = "config"
        doc["hub_id"] = os.fspath(model)
        log.info("model %r is neither a local path nor in the Hugging Face cache: its identity is its hub id, "
                 "config digest and revision %r only (other weights under the same id and revision are not "
                 "detected; pin a commit or name them with an explicit model id)", os.fspath(model), revision)
    doc["config"] = config or {}
    digest = hashlib.sha256(_dumps(doc)).hexdigest()[:32]
    return ModelFingerprint(digest=digest, source=source, weight_files=len(entries))
