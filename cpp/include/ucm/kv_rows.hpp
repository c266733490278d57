// The codecs' row loops and scans (kv_quant.cpp's kernels; formats in
// kv_quant.hpp). Internal to the native library: each works on one row or
// one segment's floats, is written so that the compiler vectorises it, and
// is built twice on x86-64 GCC (AVX2 and baseline, chosen at load time by
// the CPU); nothing here needs AVX2 to be correct, and both builds give
// the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ucm/kv_quant.hpp"

namespace ucm {
namespace kvrows {

template <typename T>
inline T load_le(const std::uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
inline void store_le(std::uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// n elements of type e at src into floats.
void load_row(const std::uint8_t* src, float* x, std::int64_t n, KvElem e);
// True if no element is NaN or infinite.
bool all_finite(const float* x, std::int64_t n);
// The largest of n floats >= 0 (|x|, not NaN); 0 for n = 0.
float max_nonneg(const float* x, std::int64_t n);
// acc[i] = max(acc[i], |x[i]|).
void absmax_acc(const float* x, float* acc, std::int64_t n);
// lo[i] = min(lo[i], x[i]), hi[i] = max(hi[i], x[i]); a NaN x[i] leaves both.
void minmax_acc(const float* x, float* lo, float* hi, std::int64_t n);
// acc[c] += (row[c]^2 + row[c + half]^2) / tr, in double, for c < half.
void pair_energy_acc(const float* row, double* acc, std::int64_t half, double tr);
// q[i] = round(x[i] * inv[i]) clamped to +-127 (half away from zero).
void quant8_row(const float* x, const float* inv, std::int8_t* q, std::int64_t n);
// Codes clamp(round(x / s) - z, 0, 15), two per byte (even element low).
void quant4_row(const float* x, const float* inv, const float* z, std::uint8_t* out, std::int64_t n);
// Floats into bfloat16, rounded to nearest even.
void store_row_bf16(const float* y, std::uint16_t* o, std::int64_t n);
// One row of int8 or int4 codes (n elements from column `first`) into dst
// as type e: per-element steps / zeros (`vs`, `vz`) or one (s, z) for the
// run; `tmp` holds n floats (float16 goes through it).
void dequant_run(const std::uint8_t* data, int bits, std::int64_t first, std::int64_t n, const float* vs,
                 const float* vz, float s, float z, KvElem e, std::uint8_t* dst, float* tmp);
// The k-th largest of x (1 <= k <= x.size(), x >= 0, no NaN).
float kth_largest(const std::vector<float>& x, std::int64_t k);
// Appends the indexes of x's elements > thr, then of those == thr until
// idx holds `want` (x >= 0, no NaN; each group in index order).
void outlier_indexes(const std::vector<float>& x, float thr, std::int64_t want, std::vector<std::uint32_t>& idx);

}  // namespace kvrows
}  // namespace ucm
