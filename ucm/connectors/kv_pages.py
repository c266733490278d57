"""Where the pages of a paged KV tensor lie in memory, as byte chunks.

Pure Python (no torch): a layer tensor is described by its shape, element
strides, item size and storage offset. One dimension indexes pages (vLLM's
KV blocks); a page is the rest of the tensor at one index of that
dimension. Its bytes may be one contiguous run (vLLM's CPU backend,
[num_blocks, heads, page_tokens, 2 * head_size]) or several (FlashAttention's
(2, num_blocks, page_tokens, heads, head_size): K, then V, far apart). A
page's payload is its chunks in memory order, copied verbatim: K and V are
never re-interpreted.

`PageCopier` is what moves those pages between the layer tensors and a
cache's arena slots: `torch_pages.TorchPageCopier` (device tensors) and
`vllm.cpu_pages.NativePageCopier` (CPU tensors, native memcpys) implement it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from ucm.errors import ConfigError

SKIP = -1  # a page id in a block's page list that is not copied (the engine already holds that page)


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Page p of a layer is `chunks` read at `base + p * page_stride` bytes
    into the layer's storage; every chunk is contiguous."""

    base: int  # bytes from the start of the storage to page 0's first chunk origin
    page_stride: int  # bytes from page p to page p + 1
    num_pages: int
    chunks: tuple[tuple[int, int], ...]  # (offset from the page origin, length), in memory order

    @property
    def page_bytes(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def payload_offsets(self) -> tuple[int, ...]:
        """Where each chunk starts in the page's payload (chunks back to back)."""
        out, at = [], 0
        for _, n in self.chunks:
            out.append(at)
            at += n
        return tuple(out)

    def storage_extent(self) -> int:
        """Bytes of storage this layout reaches (for bounds checks)."""
        last = max(off + n for off, n in self.chunks)
        return self.base + (self.num_pages - 1) * self.page_stride + last


def find_page_dim(name: str, shape: Sequence[int], num_blocks: int,
                  strides_bytes: Optional[Sequence[int]] = None, block_stride: Optional[int] = None) -> int:
    """The dimension of `shape` that indexes the `num_blocks` KV blocks.
    When several have that size, `block_stride` (bytes from one block to the
    next, when the engine says so) picks the one with that stride; otherwise
    the case is ambiguous and refused."""
    dims = [d for d, n in enumerate(shape) if n == num_blocks]
    if len(dims) > 1 and block_stride is not None and strides_bytes is not None:
        dims = [d for d in dims if strides_bytes[d] == block_stride] or dims
    if len(dims) == 1:
        return dims[0]
    if not dims:
        raise ConfigError(
            f"KV tensor {name}: no dimension of shape {tuple(shape)} has the number of KV blocks "
            f"({num_blocks}); ucm copies whole pages and needs one (an attention kernel that splits a "
            f"page into smaller kernel blocks is not supported: set --block-size to the kernel's block size)")
    raise ConfigError(f"KV tensor {name}: dimensions {dims} of shape {tuple(shape)} all have the number of KV "
                      f"blocks ({num_blocks}); cannot tell which one indexes pages")


def page_layout(name: str, shape: Sequence[int], strides: Sequence[int], itemsize: int, storage_offset: int,
                page_dim: int) -> PageLayout:
    """The chunks of one page of a tensor (`strides` and `storage_offset` in
    elements, as torch reports them). The dimensions other than `page_dim`
    are taken in memory order (largest stride first); the innermost ones that
    are dense form a chunk, the outer ones enumerate chunks. Refuses layouts
    whose innermost dimension is not dense (a chunk would not be contiguous)
    and overlapping ones, naming the layer, shape and strides."""
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"KV tensor {name} (shape {shape}, strides {strides}, {itemsize}-byte items): {why}")

    if len(shape) != len(strides) or not 0 <= page_dim < len(shape):
        raise refuse(f"page dimension {page_dim} does not exist")
    if any(s < 0 for s in strides):
        raise refuse("negative strides are not supported")
    if strides[page_dim] == 0 and shape[page_dim] > 1:
        raise refuse("pages alias each other (page stride 0)")
    rest = [(strides[d], shape[d]) for d in range(len(shape)) if d != page_dim and shape[d] != 1]
    rest.sort(key=lambda sn: sn[0], reverse=True)  # memory order, outermost first
    if any(s == 0 for s, _ in rest):
        raise refuse("elements of a page alias each other (stride 0)")
    if rest and rest[-1][0] != 1:
        raise refuse(f"a page's innermost dimension has stride {rest[-1][0]}, not 1: its bytes are not contiguous")
    # Merge dense dimensions from the inside out into one chunk.
    run = 1  # elements in one chunk
    while rest and rest[-1][0] == run:
        run *= rest.pop()[1]
    offsets = [0]
    for s, n in reversed(rest):  # innermost outer dimension first
        offsets = [o + i * s for i in range(n) for o in offsets]
    offsets.sort()
    for a, b in zip(offsets, offsets[1:]):
        if b - a < run:
            raise refuse("chunks of a page overlap")
    return PageLayout(
        base=storage_offset * itemsize,
        page_stride=strides[page_dim] * itemsize,
        num_pages=shape[page_dim],
        chunks=tuple((o * itemsize, run * itemsize) for o in offsets),
    )


class PageCopier(Protocol):
    """Whole-page copies between an engine's layer tensors and arena slots.

    A block's payload in its slot is, for each layer in order, its pages in
    order, each page its chunks (`PageLayout.chunks`) back to back. May be
    called from several threads at once."""

    def copy(self, to_arena: bool, blocks: Sequence[tuple[int, Sequence[int]]], arena: Any,
             ready: Optional[Any] = None, threads: int = 1, layers: Optional[Sequence[int]] = None) -> None:
        """Copies `blocks` — (payload offset in `arena`, the block's page ids,
        SKIP for pages left alone) — out of (`to_arena`) or into the layer
        tensors, after `ready` (from `record_ready`) where the device orders
        work. `threads`: CPU threads a host copy may use. `layers`: only
        those layers (a streamed load copies each as it lands); None: all.
        Returns once the bytes are in place (the slot may be committed or
        released then)."""

    def record_ready(self) -> Optional[Any]:
        """A mark after the work queued so far on the engine's stream, for a
        later `copy` to wait on; None where copies need no ordering."""

    def close(self) -> None:
        """Lets go of every arena (call once no copy runs)."""
