// C++ tests of the native core, built and run by `make test` (no framework).
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ucm/copy.hpp"
#include "ucm/hash.hpp"
#include "ucm/io_engine.hpp"

static int failures = 0;
#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                    \
    }                                                                \
  } while (0)

static void test_chain_keys() {
  std::uint8_t seed[16] = {1};
  std::vector<std::uint32_t> tokens(1000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>(i * 7);
  std::vector<std::uint8_t> a(16 * 3), b(16 * 3);
  CHECK(ucm::chain_keys(seed, tokens.data(), 1000, 256, a.data()) == 3);  // partial block not keyed
  CHECK(ucm::chain_keys(seed, tokens.data(), 768, 256, b.data()) == 3);
  CHECK(a == b);
  // Chaining: changing block 0 changes every later key; changing block 2 only key 2.
  tokens[600] ^= 1;
  CHECK(ucm::chain_keys(seed, tokens.data(), 768, 256, b.data()) == 3);
  CHECK(std::memcmp(a.data(), b.data(), 32) == 0);
  CHECK(std::memcmp(a.data() + 32, b.data() + 32, 16) != 0);
  tokens[600] ^= 1;
  tokens[0] ^= 1;
  ucm::chain_keys(seed, tokens.data(), 768, 256, b.data());
  for (int i = 0; i < 3; ++i) CHECK(std::memcmp(a.data() + 16 * i, b.data() + 16 * i, 16) != 0);
}

static void test_copy() {
  const std::size_t n = (40u << 20) + 123;
  std::vector<char> src(n), dst(n, 0);
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<char>(i * 31);
  ucm::copy_bytes(dst.data(), src.data(), n, 4);
  CHECK(std::memcmp(dst.data(), src.data(), n) == 0);
  CHECK(ucm::checksum(src.data(), n) == ucm::checksum(dst.data(), n));
  dst[n / 2] ^= 1;
  CHECK(ucm::checksum(src.data(), n) != ucm::checksum(dst.data(), n));
}

static void test_io_engine() {
  char path[] = "/tmp/ucm_io_testXXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  ucm::IoEngine io(4);
  const std::size_t chunk = 1 << 16;
  std::vector<std::vector<char>> bufs(16, std::vector<char>(chunk));
  std::vector<ucm::IoRequest> reqs;
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    std::memset(bufs[i].data(), static_cast<int>(i + 1), chunk);
    reqs.push_back({bufs[i].data(), chunk, static_cast<std::int64_t>(i * chunk)});
  }
  for (auto r : io.write_batch(fd, reqs)) CHECK(r == static_cast<std::int64_t>(chunk));
  std::vector<std::vector<char>> back(16, std::vector<char>(chunk));
  std::vector<ucm::IoRequest> rreqs;
  for (std::size_t i = 0; i < back.size(); ++i)
    rreqs.push_back({back[i].data(), chunk, static_cast<std::int64_t>(i * chunk)});
  for (auto r : io.read_batch(fd, rreqs)) CHECK(r == static_cast<std::int64_t>(chunk));
  CHECK(back == bufs);
  // Reading past the end gives a short count, a bad fd gives -EBADF.
  std::vector<char> tail(chunk);
  auto res = io.read_batch(fd, {{tail.data(), chunk, static_cast<std::int64_t>(16 * chunk - 10)}});
  CHECK(res[0] == 10);
  res = io.read_batch(-1, {{tail.data(), chunk, 0}});
  CHECK(res[0] < 0);
  close(fd);
  unlink(path);
}

int main() {
  test_chain_keys();
  test_copy();
  test_io_engine();
  if (failures) {
    std::fprintf(stderr, "%d failed\n", failures);
    return 1;
  }
  std::printf("native core: all checks passed\n");
  return 0;
}
