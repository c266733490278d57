// Bulk memory copies for the data path.
#pragma once

#include <cstddef>

namespace ucm {

// Copies n bytes; large copies are split over up to `threads` threads.
void copy_bytes(void* dst, const void* src, std::size_t n, int threads);

// For every i, copies `length` bytes from src + src_offsets[i] to
// dst + dst_offsets[i] (callers check the bounds); the list is split over up
// to `threads` threads. Gathers pages into a block or scatters a block into
// pages with one call per layer instead of one per page. Spans of 256 KiB
// and more are written with streaming stores (fenced before returning).
void copy_spans(char* dst, const std::size_t* dst_offsets, const char* src, const std::size_t* src_offsets,
                std::size_t count, std::size_t length, int threads);

// Touches every page of [addr, addr+n) for writing so later copies do not
// take page faults (shared-memory arenas, region buffers).
void prefault(void* addr, std::size_t n);

}  // namespace ucm
