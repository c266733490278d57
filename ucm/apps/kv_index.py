"""Which engine holds which prompt prefix, from the engines' own KV events:
what `ucm pd-proxy` picks engines by when it is given their event endpoints.

A vLLM engine started with `--kv-events-config` publishes on ZMQ
(`publisher: zmq`, a PUB socket at `endpoint`) batches of `BlockStored`,
`BlockRemoved` and `AllBlocksCleared` events: its GPU prefix cache's
blocks (medium `GPU`), and, through ucm's connector, the blocks ucm holds
for it (`CPU`, `DISK`, `EXTERNAL`; decision 17). A stored block carries its
tokens and the engine's hash of its parent, so `PrefixIndex` keys each
block by a chain of its own (ucm's block key chain, ucm/keys.py, from a
seed of the index's) and never needs the engine's hash function or seed:
a prompt's blocks are keyed the same way and matched block by block.

Blocks stored with extra keys (a LoRA, a cache salt, multimodal inputs)
are not indexed, nor blocks of a KV cache group other than the first: a
request that uses them matches nothing and is picked by load. A block
whose parent the index does not know (an event lost, an engine that was
running before the proxy) is skipped. The index is a routing hint: a
stale entry costs a recompute on the engine it sent the request to, never
a wrong byte (the engine's own cache and ucm check their keys).

`EventFeed` follows the endpoints, one SUB socket per engine, on one
thread. It connects to an endpoint the engine binds (vLLM binds ipc://
endpoints and wildcard tcp ones, `tcp://*:5557`: give the feed
`tcp://ENGINE_HOST:5557` or the same ipc:// path); with a `bind:` prefix
it binds the endpoint instead, for engines that connect to it (vLLM 0.32
connects to a tcp endpoint with a concrete host). vLLM's batches are msgpack (`[ts, events, dp_rank]`, each event a
map tagged by `type`), decoded here without vLLM's classes. A sequence
number that goes back (the engine restarted) clears that engine's entries.
"""
from __future__ import annotations

import hashlib
import logging
import struct
import threading
from typing import Any, Iterable, Optional, Sequence

from ucm.errors import ConfigError
from ucm.keys import KEY_BYTES, block_keys

log = logging.getLogger(__name__)

GPU = "GPU"
_ROOT = hashlib.blake2b(b"ucm-kv-index-root", digest_size=KEY_BYTES).digest()  # the seed of every chain


def prefix_keys(tokens: Sequence[int], block_size: int, parent: bytes = _ROOT) -> list[bytes]:
    """The index's keys of the full blocks of `tokens`, in order, chained
    from `parent` (the key of the block before them): ucm's own block key
    chain (ucm/keys.py) from a seed of the index's."""
    return block_keys(parent, tokens, block_size)


class _Engine:
    """One engine's blocks: the index's key per engine hash, and the media
    each key is held on."""

    __slots__ = ("block_size", "own", "media", "seq")

    def __init__(self) -> None:
        self.block_size: Optional[int] = None
        self.own: dict[Any, bytes] = {}  # the engine's block hash -> the index's key
        self.media: dict[bytes, set] = {}  # the index's key -> media holding it
        self.seq: Optional[int] = None

    def clear(self) -> None:
        self.own.clear()
        self.media.clear()


class PrefixIndex:
    """Per engine (by name), the prompt blocks it holds and where; see the
    module docstring. Thread-safe: `EventFeed` applies events from its
    thread while the proxy matches from its loop."""

    def __init__(self, engines: Iterable[str]) -> None:
        self._engines = {name: _Engine() for name in engines}
        self._lock = threading.Lock()
        self.counts = {"stored": 0, "removed": 0, "cleared": 0, "skipped": 0, "malformed": 0, "restarts": 0}

    def apply(self, engine: str, events: Iterable[Any], seq: Optional[int] = None) -> None:
        """Applies one batch's events (maps as vLLM's msgpack decodes) to
        `engine`'s entries; `seq` the batch's sequence number."""
        with self._lock:
            e = self._engines[engine]
            if seq is not None:
                if e.seq is not None and seq <= e.seq:
                    e.clear()
                    self.counts["restarts"] += 1
                e.seq = seq
            for ev in events:
                try:
                    self._apply_one(e, ev)
                except (KeyError, TypeError, ValueError, AttributeError):
                    self.counts["malformed"] += 1

    def _apply_one(self, e: _Engine, ev: Any) -> None:
        kind = ev.get("type") if isinstance(ev, dict) else None
        if kind == "BlockStored":
            medium = ev.get("medium") or GPU
            size = int(ev["block_size"])
            tokens, hashes = list(ev["token_ids"]), list(ev["block_hashes"])
            if (ev.get("group_idx") or 0) != 0 or ev.get("lora_name") or ev.get("lora_id") \
                    or any(ev.get("extra_keys") or ()) or len(tokens) != size * len(hashes) \
                    or (e.block_size is not None and size != e.block_size):
                self.counts["skipped"] += len(hashes)
                return
            parent_hash = ev.get("parent_block_hash")
            parent = _ROOT if parent_hash is None else e.own.get(_hashable(parent_hash))
            if parent is None:  # no place in the chain
                self.counts["skipped"] += len(hashes)
                return
            try:
                keys = prefix_keys(tokens, size, parent)
            except ValueError:  # token ids no block key takes: a malformed event, never a crash of the feed
                self.counts["skipped"] += len(hashes)
                return
            e.block_size = size
            for h, key in zip(hashes, keys):
                e.own[_hashable(h)] = key
                e.media.setdefault(key, set()).add(medium)
            self.counts["stored"] += len(keys)
        elif kind == "BlockRemoved":
            if (ev.get("group_idx") or 0) != 0:
                return
            medium = ev.get("medium") or GPU
            for h in ev["block_hashes"]:
                key = e.own.get(_hashable(h))
                held = e.media.get(key) if key is not None else None
                if held is None:
                    continue
                held.discard(medium)
                self.counts["removed"] += 1
                if not held:
                    del e.media[key]
                    del e.own[_hashable(h)]
        elif kind == "AllBlocksCleared":
            e.clear()
            self.counts["cleared"] += 1
        else:
            raise ValueError(f"not a KV event: {kind!r}")

    def block_size(self) -> Optional[int]:
        """The engines' block size, once an event told it."""
        with self._lock:
            return next((e.block_size for e in self._engines.values() if e.block_size), None)

    def match(self, tokens: Sequence[int]) -> dict[str, tuple[int, int]]:
        """Per engine: (prompt blocks it holds on GPU, prompt blocks it
        holds anywhere), each the length of the leading run held."""
        size = self.block_size()
        try:
            keys = prefix_keys(tokens, size) if size else []
        except ValueError:  # token ids no block key takes (negative, over 32 bits): nothing held
            keys = []
        out = {}
        with self._lock:
            for name, e in self._engines.items():
                gpu = held = 0
                for k in keys:
                    media = e.media.get(k)
                    if not media:
                        break
                    held += 1
                    if gpu == held - 1 and GPU in media:
                        gpu += 1
                out[name] = (gpu, held)
        return out

    def blocks(self, engine: str) -> int:
        with self._lock:
            return len(self._engines[engine].media)


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytearray, memoryview, list)) and not isinstance(h, bytes) else h


def endpoint(url: str, engine: str) -> tuple[bool, str]:
    """(bind, address) of an events endpoint as the feed takes it; a
    ConfigError naming `engine` when it is not one."""
    bind = url.startswith("bind:")
    address = url[len("bind:"):] if bind else url
    if not address.startswith(("tcp://", "ipc://", "inproc://")) or "*" in address:
        raise ConfigError(f"pd-proxy: an events endpoint is tcp://HOST:PORT, ipc://PATH or inproc://NAME, "
                          f"with bind: in front to bind it; got {url!r} for {engine}")
    return bind, address


class EventFeed:
    """Follows each engine's ZMQ event endpoint into `index`, on a thread
    of its own, until `close`."""

    def __init__(self, index: PrefixIndex, endpoints: dict[str, str], *, poll_ms: int = 100) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ConfigError(f"pd-proxy: KV events need pyzmq and msgpack (pip install 'ucm[pd]'): {exc}") from exc
        plan = {name: endpoint(url, name) for name, url in endpoints.items()}
        self.index, self.poll_ms = index, poll_ms
        self._msgpack, self._zmq = msgpack, zmq
        self._ctx = zmq.Context.instance()
        self._sockets = {}
        for name, (bind, address) in plan.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            try:
                sub.bind(address) if bind else sub.connect(address)
            except zmq.ZMQError as exc:
                for s in (*self._sockets, sub):
                    s.close(0)
                raise ConfigError(f"pd-proxy: the events endpoint {address!r} of {name} cannot be "
                                  f"{'bound' if bind else 'connected'}: {exc}") from exc
            self._sockets[sub] = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucm-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        for sub in self._sockets:
            poller.register(sub, self._zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(self.poll_ms):
                try:
                    parts = sub.recv_multipart(self._zmq.NOBLOCK)
                except self._zmq.ZMQError:
                    continue
                self._take(self._sockets[sub], parts)
        for sub in self._sockets:
            sub.close(0)

    def _take(self, engine: str, parts: list[bytes]) -> None:
        """One message: vLLM sends [topic, seq (8 bytes, big-endian), batch]."""
        try:
            seq = struct.unpack(">q", parts[-2])[0] if len(parts) >= 2 and len(parts[-2]) == 8 else None
            batch = self._msgpack.unpackb(parts[-1], raw=False, strict_map_key=False)
            events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) >= 2 else batch["events"]
        except Exception as exc:  # a message that is not a batch: counted, the feed goes on
            self.index.counts["malformed"] += 1
            log.debug("pd-proxy: an event message from %s that is not a KV event batch: %s", engine, exc)
            return
        self.index.apply(engine, events, seq)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
