#include "ucm/hash.hpp"

#include <cstring>
#include <vector>

#define XXH_INLINE_ALL
#include "xxhash.h"

namespace ucm {

namespace {
constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
}

void digest128(const void* data, std::size_t len, std::uint8_t out[kKeyBytes]) {
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, XXH3_128bits(data, len));
  std::memcpy(out, canon.digest, kKeyBytes);
}

std::size_t chain_keys(const std::uint8_t seed[kKeyBytes], const std::uint32_t* tokens,
                       std::size_t n_tokens, std::size_t block_tokens, std::uint8_t* out) {
  if (block_tokens == 0) return 0;
  const std::size_t n_blocks = n_tokens / block_tokens;
  const std::size_t token_bytes = block_tokens * sizeof(std::uint32_t);
  std::vector<std::uint8_t> buf(kKeyBytes + token_bytes);
  std::memcpy(buf.data(), seed, kKeyBytes);
  for (std::size_t i = 0; i < n_blocks; ++i) {
    std::uint8_t* t = buf.data() + kKeyBytes;
    const std::uint32_t* src = tokens + i * block_tokens;
    if constexpr (kLittleEndian) {
      std::memcpy(t, src, token_bytes);
    } else {
      for (std::size_t j = 0; j < block_tokens; ++j) {  // hash little-endian on every host
        const std::uint32_t v = src[j];
        t[4 * j] = static_cast<std::uint8_t>(v);
        t[4 * j + 1] = static_cast<std::uint8_t>(v >> 8);
        t[4 * j + 2] = static_cast<std::uint8_t>(v >> 16);
        t[4 * j + 3] = static_cast<std::uint8_t>(v >> 24);
      }
    }
    std::uint8_t* key = out + i * kKeyBytes;
    digest128(buf.data(), buf.size(), key);
    std::memcpy(buf.data(), key, kKeyBytes);
  }
  return n_blocks;
}

std::uint64_t checksum(const void* data, std::size_t len) { return XXH3_64bits(data, len); }

std::size_t chunk_count(std::size_t len, std::size_t chunk) { return len / chunk + (len % chunk != 0); }

std::size_t chunk_checksums(const void* data, std::size_t len, std::size_t chunk, std::uint8_t* out) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  const std::size_t n = chunk_count(len, chunk);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t at = i * chunk;
    const std::uint64_t h = XXH3_64bits(p + at, len - at < chunk ? len - at : chunk);
    for (int b = 0; b < 8; ++b) out[8 * i + b] = static_cast<std::uint8_t>(h >> (8 * b));
  }
  return n;
}

}  // namespace ucm
