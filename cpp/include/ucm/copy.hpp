// Bulk memory copies for the data path.
#pragma once

#include <cstddef>

namespace ucm {

// Copies n bytes; large copies are split over up to `threads` threads.
void copy_bytes(void* dst, const void* src, std::size_t n, int threads);

// Touches every page of [addr, addr+n) for writing so later copies do not
// take page faults (shared-memory arenas, region buffers).
void prefault(void* addr, std::size_t n);

}  // namespace ucm
