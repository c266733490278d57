// int4 codes into rows: the decoder's inner loops (formats in kv_quant.hpp).
//
// Every function computes each element as (float(q) + offset) * step in
// float arithmetic, whichever path runs (AVX2 where the CPU has it, one
// code at a time otherwise), so every build and CPU gives the same bits;
// the `_plain` versions are the one-at-a-time references the tests hold
// the vectorised paths to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ucm {

// float to bfloat16, rounded to nearest even (every bf16 store of the decoders).
inline std::uint16_t kv_f32_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// Values: a run of n codes of 4 bits (n even), two per byte (element 2i in
// the low nibble), into out[i] = (q_i + z) * s, as bfloat16 (rounded to
// nearest even) or float.
void kv_unpack_run_bf16(const std::uint8_t* in, float s, float z, std::uint16_t* out, std::int64_t n);
void kv_unpack_run_f32(const std::uint8_t* in, float s, float z, float* out, std::int64_t n);

// Keys, int4's paired format: one row block of a key segment is D tiles of
// `rows` tokens (one channel each) stored one after the other from `data`
// in column order; tile c holds `rows` codes of widths[c] bits (1..8, LSB
// first, eight codes in widths[c] bytes; rows a multiple of 8; the caller
// checks both). Writes out[r * D + c] = (q + offs[c]) * steps[c]. `end` is
// the end of the readable bytes (the vectorised path reads 8 bytes at a
// time where they are there). Returns the bytes of the row block's tiles.
std::size_t kv_unpack_key_tiles(const std::uint8_t* data, const std::uint8_t* end, const int* widths,
                                const float* steps, const float* offs, std::int64_t rows, std::int64_t D, float* out);

void kv_unpack_run_bf16_plain(const std::uint8_t* in, float s, float z, std::uint16_t* out, std::int64_t n);
void kv_unpack_run_f32_plain(const std::uint8_t* in, float s, float z, float* out, std::int64_t n);
std::size_t kv_unpack_key_tiles_plain(const std::uint8_t* data, const int* widths, const float* steps,
                                      const float* offs, std::int64_t rows, std::int64_t D, float* out);

}  // namespace ucm
