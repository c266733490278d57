// int4's paired keys, encoder side: the widths of the RoPE pairs and the
// packing of key tiles (formats in kv_quant.hpp; the decoder's side is
// kv_unpack.hpp).
//
// Each function gives exactly what its `_plain` version gives (the
// one-at-a-time reference the tests hold it to), so the encoded bytes do
// not depend on which one runs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ucm {

// Widths of `n` pairs, 4 on average: every pair starts at 1 bit, and 3 n
// more bits go one at a time to the pair with the largest priority (ties:
// the lowest pair), whose priority then falls by 2 (the error model's
// 4^-w), 8 bits at most. prio[q] is finite or -HUGE_VAL.
void kv_pair_widths(const double* prio, std::int64_t n, int* widths);
void kv_pair_widths_plain(const double* prio, std::int64_t n, int* widths);

// One row block of a key segment (`rows` tokens x D channels, row r at
// x + r * D) as D tiles of `rows` codes, one per channel, in column order:
// code = int(min(2^w - 1, max(0, x * inv[c] - off[c])) + 0.5) with w =
// widths[c] (1..8; NaN codes 0), `rows` codes of w bits in rows * w / 8
// bytes (code i at bit i * w, LSB first; rows a multiple of 8, the caller
// checks). Returns the bytes written. `codes` is scratch of rows * D bytes.
std::size_t kv_pack_key_tiles(const float* x, std::int64_t rows, std::int64_t D, const int* widths, const float* inv,
                              const float* off, std::uint8_t* codes, std::uint8_t* out);
std::size_t kv_pack_key_tiles_plain(const float* x, std::int64_t rows, std::int64_t D, const int* widths,
                                    const float* inv, const float* off, std::uint8_t* out);

}  // namespace ucm
