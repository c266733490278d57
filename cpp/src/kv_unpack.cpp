// int4 codes into rows (kv_unpack.hpp). Key tiles are columns of their
// row block, so the plain loop writes each code to its own row, D floats
// apart, one at a time; with AVX2 the codes of 8 columns x 8 rows are
// unpacked as 8 vectors (one per column, a shift per lane) and an 8 x 8
// transpose turns them into 8 row pieces written whole. Value runs: 16
// bytes (32 codes) at a time, nibbles split and widened in registers.
// int4's decode of a SmolLM2 block, one thread (docs/lab/benchmarks.md): bf16
// 2.0 -> 3.8 GB/s, float32 4.1 -> 6.2 GB/s against one code at a time.
#include "ucm/kv_unpack.hpp"

#include <cstring>
#include <vector>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define UCM_UNPACK_AVX2 1
#include <immintrin.h>
#endif

namespace ucm {
namespace {

template <int W>
void unpack_tile_w(const std::uint8_t* in, std::int64_t rows, float off, float s, float* out, std::int64_t stride) {
  constexpr std::uint64_t mask = (std::uint64_t{1} << W) - 1u;
  for (std::int64_t r = 0; r < rows; r += 8, in += W) {
    std::uint64_t v = 0;
    std::memcpy(&v, in, W);
    for (int i = 0; i < 8; ++i) out[(r + i) * stride] = (static_cast<float>((v >> (i * W)) & mask) + off) * s;
  }
}

void unpack_tile(int w, const std::uint8_t* in, std::int64_t rows, float off, float s, float* out,
                 std::int64_t stride) {
  switch (w) {
    case 1: return unpack_tile_w<1>(in, rows, off, s, out, stride);
    case 2: return unpack_tile_w<2>(in, rows, off, s, out, stride);
    case 3: return unpack_tile_w<3>(in, rows, off, s, out, stride);
    case 4: return unpack_tile_w<4>(in, rows, off, s, out, stride);
    case 5: return unpack_tile_w<5>(in, rows, off, s, out, stride);
    case 6: return unpack_tile_w<6>(in, rows, off, s, out, stride);
    case 7: return unpack_tile_w<7>(in, rows, off, s, out, stride);
    default: return unpack_tile_w<8>(in, rows, off, s, out, stride);
  }
}

#ifdef UCM_UNPACK_AVX2
// 32 codes from 16 bytes as 4 x 8 floats (q + z) * s, in element order.
__attribute__((target("avx2"))) inline void run32(const std::uint8_t* in, __m256 z, __m256 s, __m256 y[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  const __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);  // elements 0-15, 16-31
  const __m128i q[4] = {e0, _mm_srli_si128(e0, 8), e1, _mm_srli_si128(e1, 8)};
  for (int k = 0; k < 4; ++k) {
    y[k] = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[k])), z), s);
  }
}

// bfloat16 of 8 floats, rounded to nearest even as kv_f32_to_bf16.
__attribute__((target("avx2"))) inline __m128i bf16x8(__m256 y) {
  __m256i u = _mm256_castps_si256(y);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

__attribute__((target("avx2"))) std::int64_t run_bf16_avx2(const std::uint8_t* in, float s, float z,
                                                           std::uint16_t* out, std::int64_t n) {
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 y[4];
    run32(in + i / 2, vz, vs, y);
    for (int k = 0; k < 4; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 8 * k), bf16x8(y[k]));
  }
  return i;
}

__attribute__((target("avx2"))) std::int64_t run_f32_avx2(const std::uint8_t* in, float s, float z, float* out,
                                                          std::int64_t n) {
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 y[4];
    run32(in + i / 2, vz, vs, y);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + i + 8 * k, y[k]);
  }
  return i;
}

// Per width w (1..8): the shifts of codes 0-3 and 4-7 (64-bit lanes) and the mask.
struct alignas(32) CodeShifts {
  std::int64_t lo[4], hi[4];
  std::int32_t mask[8];
};
struct ShiftTable {
  CodeShifts w[9];
  ShiftTable() {
    for (int k = 1; k <= 8; ++k) {
      for (int i = 0; i < 4; ++i) {
        w[k].lo[i] = i * k;
        w[k].hi[i] = (i + 4) * k;
      }
      for (int i = 0; i < 8; ++i) w[k].mask[i] = (1 << k) - 1;
    }
  }
};
const ShiftTable kShifts;

// The 8 codes of the 64 bits v (code i at bit i w) as floats (q + off) * s.
__attribute__((target("avx2"))) inline __m256 codes8(std::uint64_t v, const CodeShifts& t, __m256 off, __m256 s) {
  const __m256i vv = _mm256_set1_epi64x(static_cast<long long>(v));
  const __m256i lo = _mm256_srlv_epi64(vv, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.lo)));
  const __m256i hi = _mm256_srlv_epi64(vv, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.hi)));
  // 32-bit lanes [lo0, hi0, lo1, hi1, ...] -> [lo0..lo3, hi0..hi3], then the mask.
  const __m256i mixed = _mm256_blend_epi32(lo, _mm256_slli_epi64(hi, 32), 0xAA);
  __m256i q = _mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  q = _mm256_and_si256(q, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.mask)));
  return _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(q), off), s);
}

__attribute__((target("avx2"))) std::size_t unpack_avx2(const std::uint8_t* data, const std::uint8_t* end,
                                                        const int* widths, const float* steps, const float* offs,
                                                        std::int64_t rows, std::int64_t D, float* out) {
  const std::uint8_t* at_small[64];
  std::vector<const std::uint8_t*> at_big(D > 64 ? static_cast<std::size_t>(D) : 0);
  const std::uint8_t** at = D > 64 ? at_big.data() : at_small;
  const std::uint8_t* const start = data;
  for (std::int64_t c = 0; c < D; ++c) {
    at[c] = data;
    data += rows * widths[c] / 8;
  }
  for (std::int64_t c0 = 0; c0 < D; c0 += 8) {
    for (std::int64_t r0 = 0; r0 < rows; r0 += 8) {
      __m256 col[8];
      for (int j = 0; j < 8; ++j) {
        const int w = widths[c0 + j];
        const std::uint8_t* p = at[c0 + j] + r0 / 8 * w;
        std::uint64_t v = 0;
        if (end - p >= 8) {
          std::memcpy(&v, p, 8);  // bits past 8 w are never read
        } else {
          std::memcpy(&v, p, static_cast<std::size_t>(w));
        }
        col[j] = codes8(v, kShifts.w[w], _mm256_set1_ps(offs[c0 + j]), _mm256_set1_ps(steps[c0 + j]));
      }
      // 8 x 8 transpose: col[j][i] -> row i, column j.
      __m256 t0 = _mm256_unpacklo_ps(col[0], col[1]), t1 = _mm256_unpackhi_ps(col[0], col[1]);
      __m256 t2 = _mm256_unpacklo_ps(col[2], col[3]), t3 = _mm256_unpackhi_ps(col[2], col[3]);
      __m256 t4 = _mm256_unpacklo_ps(col[4], col[5]), t5 = _mm256_unpackhi_ps(col[4], col[5]);
      __m256 t6 = _mm256_unpacklo_ps(col[6], col[7]), t7 = _mm256_unpackhi_ps(col[6], col[7]);
      __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = out + r0 * D + c0;
      _mm256_storeu_ps(o + 0 * D, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * D, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * D, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * D, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * D, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * D, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * D, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * D, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
  return static_cast<std::size_t>(data - start);
}

// Set while the library loads: __builtin_cpu_init first, as GCC asks of a
// check that may run before the other constructors.
const bool kHasAvx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();
#endif

}  // namespace

void kv_unpack_run_bf16(const std::uint8_t* in, float s, float z, std::uint16_t* out, std::int64_t n) {
  std::int64_t i = 0;
#ifdef UCM_UNPACK_AVX2
  if (kHasAvx2) i = run_bf16_avx2(in, s, z, out, n);
#endif
  kv_unpack_run_bf16_plain(in + i / 2, s, z, out + i, n - i);
}

void kv_unpack_run_f32(const std::uint8_t* in, float s, float z, float* out, std::int64_t n) {
  std::int64_t i = 0;
#ifdef UCM_UNPACK_AVX2
  if (kHasAvx2) i = run_f32_avx2(in, s, z, out, n);
#endif
  kv_unpack_run_f32_plain(in + i / 2, s, z, out + i, n - i);
}

void kv_unpack_run_bf16_plain(const std::uint8_t* in, float s, float z, std::uint16_t* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n / 2; ++i) {
    out[2 * i] = kv_f32_to_bf16((static_cast<float>(in[i] & 0x0F) + z) * s);
    out[2 * i + 1] = kv_f32_to_bf16((static_cast<float>(in[i] >> 4) + z) * s);
  }
}

void kv_unpack_run_f32_plain(const std::uint8_t* in, float s, float z, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n / 2; ++i) {
    out[2 * i] = (static_cast<float>(in[i] & 0x0F) + z) * s;
    out[2 * i + 1] = (static_cast<float>(in[i] >> 4) + z) * s;
  }
}

std::size_t kv_unpack_key_tiles(const std::uint8_t* data, const std::uint8_t* end, const int* widths,
                                const float* steps, const float* offs, std::int64_t rows, std::int64_t D, float* out) {
#ifdef UCM_UNPACK_AVX2
  if (kHasAvx2 && D % 8 == 0) return unpack_avx2(data, end, widths, steps, offs, rows, D, out);
#endif
  (void)end;
  return kv_unpack_key_tiles_plain(data, widths, steps, offs, rows, D, out);
}

std::size_t kv_unpack_key_tiles_plain(const std::uint8_t* data, const int* widths, const float* steps,
                                      const float* offs, std::int64_t rows, std::int64_t D, float* out) {
  std::size_t at = 0;
  for (std::int64_t c = 0; c < D; ++c) {
    unpack_tile(widths[c], data + at, rows, offs[c], steps[c], out + c, D);
    at += static_cast<std::size_t>(rows * widths[c] / 8);
  }
  return at;
}

}  // namespace ucm
