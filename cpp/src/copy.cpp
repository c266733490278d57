#include "ucm/copy.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace ucm {

namespace {
constexpr std::size_t kMinChunk = 8u << 20;  // below this a thread costs more than it gives
}

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
    for (std::size_t i = lo; i < hi; ++i) std::memcpy(dst + dst_offsets[i], src + src_offsets[i], length);
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
