#include "ucm/copy.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ucm {

namespace {
constexpr std::size_t kMinChunk = 8u << 20;  // below this a thread costs more than it gives

// Spans from this size on are written with streaming (non-temporal) stores.
// glibc's memcpy streams only past a threshold near the cache size, so a
// list of 0.7 MiB spans (SGLang's K and V of a page, vLLM's pages) went
// through the cache: each destination line read for ownership, then
// evicted, and a source on 4 KiB pages (torch's host pools) on top. On
// this repository's 2-core machine, 92 spans of 0.7 MiB from SGLang's host
// pool into the arena took 10.1 ms with memcpy, 4.0 ms streamed (a single
// 68 MB memcpy: 5.4 ms); into the pool 6.5 ms against 4.2 ms. Blocks the
// data path copies are not read back by the copying thread soon.
constexpr std::size_t kStreamMin = 256u << 10;

void copy_span(char* dst, const char* src, std::size_t n) {
#if defined(__SSE2__)
  if (n >= kStreamMin) {
    std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const std::size_t blocks = n / 64;
    for (std::size_t j = 0; j < blocks; ++j) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
      src += 64;
      dst += 64;
    }
    std::memcpy(dst, src, n - blocks * 64);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();  // streamed stores are visible to other threads and processes once this returns
#endif
}
}  // namespace

void copy_bytes(void* dst, const void* src, std::size_t n, int threads) {
  const std::size_t parts =
      std::max<std::size_t>(1, std::min<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), n / kMinChunk));
  if (parts == 1) {
    std::memcpy(dst, src, n);
    return;
  }
  const std::size_t step = (n / parts + 4095) & ~static_cast<std::size_t>(4095);
  std::vector<std::thread> pool;
  pool.reserve(parts - 1);
  for (std::size_t p = 1; p < parts; ++p) {
    const std::size_t off = p * step;
    if (off >= n) break;
    const std::size_t len = std::min(step, n - off);
    pool.emplace_back([=] {
      std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, len);
    });
  }
  std::memcpy(dst, src, std::min(step, n));
  for (auto& t : pool) t.join();
}

void copy_spans(char* dst, const std::size_t* dst_offsets, const char* src, const std::size_t* src_offsets,
                std::size_t count, std::size_t length, int threads) {
  const std::size_t total = count * length;
  const std::size_t parts = std::max<std::size_t>(
      1, std::min<std::size_t>({static_cast<std::size_t>(std::max(threads, 1)), total / kMinChunk, count}));
  auto run = [=](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) copy_span(dst + dst_offsets[i], src + src_offsets[i], length);
    stream_fence();
  };
  if (parts == 1) {
    run(0, count);
    return;
  }
  const std::size_t step = (count + parts - 1) / parts;
  std::vector<std::thread> pool;
  pool.reserve(parts - 1);
  for (std::size_t p = 1; p < parts && p * step < count; ++p) {
    pool.emplace_back(run, p * step, std::min(count, (p + 1) * step));
  }
  run(0, std::min(count, step));
  for (auto& t : pool) t.join();
}

void prefault(void* addr, std::size_t n) {
  const long page = sysconf(_SC_PAGESIZE);
  volatile char* p = static_cast<volatile char*>(addr);
  for (std::size_t off = 0; off < n; off += static_cast<std::size_t>(page)) {
    p[off] = p[off];
  }
}

}  // namespace ucm
