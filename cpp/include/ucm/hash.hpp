// Block identity and payload checksums (xxHash, vendored in third_party/).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ucm {

constexpr std::size_t kKeyBytes = 16;

// 128-bit digest of `len` bytes, written in canonical (big-endian) order.
void digest128(const void* data, std::size_t len, std::uint8_t out[kKeyBytes]);

// Chained block keys: key_i = XXH3-128(key_{i-1} || tokens of block i), with
// key_{-1} = seed. Tokens are hashed as little-endian uint32. Only full blocks
// are keyed: n_tokens / block_tokens keys are written to `out`.
std::size_t chain_keys(const std::uint8_t seed[kKeyBytes], const std::uint32_t* tokens,
                       std::size_t n_tokens, std::size_t block_tokens, std::uint8_t* out);

// 64-bit payload checksum (XXH3-64).
std::uint64_t checksum(const void* data, std::size_t len);

// Number of `chunk`-byte pieces `len` bytes split into (the last one may be
// shorter): ceil(len / chunk); 0 for `len` 0. `chunk` must be > 0.
std::size_t chunk_count(std::size_t len, std::size_t chunk);

// XXH3-64 of each consecutive `chunk`-byte piece of `len` bytes (the last one
// shorter when `chunk` does not divide `len`), written to `out` as
// little-endian uint64 (8 * chunk_count(len, chunk) bytes, the same on every
// host). Returns the number of checksums. `chunk` must be > 0.
std::size_t chunk_checksums(const void* data, std::size_t len, std::size_t chunk, std::uint8_t* out);

}  // namespace ucm
