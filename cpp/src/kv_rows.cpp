// The codecs' row loops and scans (kv_rows.hpp).
#include "ucm/kv_rows.hpp"

#include <algorithm>
#include <cmath>
#include <functional>

#include "ucm/clones.hpp"
#include "ucm/kv_unpack.hpp"

namespace ucm {
namespace kvrows {

UCM_CLONES void load_row_bf16(const std::uint8_t* src, float* x, std::int64_t n) {
  const std::uint16_t* s = reinterpret_cast<const std::uint16_t*>(src);
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t u = static_cast<std::uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    x[i] = f;
  }
}

void load_row(const std::uint8_t* src, float* x, std::int64_t n, KvElem e) {
  if (e == KvElem::BF16) {
    load_row_bf16(src, x, n);
  } else if (e == KvElem::F32) {
    std::memcpy(x, src, static_cast<std::size_t>(n) * 4);
  } else {
    for (std::int64_t i = 0; i < n; ++i) x[i] = kv_f16_to_f32(load_le<std::uint16_t>(src + 2 * i));
  }
}

// No early exit, so that it vectorises (a branch per element took half of int8's encode).
UCM_CLONES bool all_finite(const float* x, std::int64_t n) {
  std::uint32_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, x + i, 4);
    bad |= static_cast<std::uint32_t>((u & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}

// The largest of n floats >= 0 (|x|, finite): their bits order as they do,
// and an integer max vectorises (a float max chain ran one element per 4 cycles).
UCM_CLONES float max_nonneg(const float* x, std::int64_t n) {
  std::uint32_t m = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, x + i, 4);
    m = std::max(m, u);
  }
  float f;
  std::memcpy(&f, &m, 4);
  return f;
}

UCM_CLONES void absmax_acc(const float* x, float* acc, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], std::fabs(x[i]));
}

// NaN (an outlier's place) leaves lo and hi as they are.
UCM_CLONES void minmax_acc(const float* x, float* lo, float* hi, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    lo[i] = std::min(lo[i], x[i]);
    hi[i] = std::max(hi[i], x[i]);
  }
}

// Adds each RoPE pair's (c, c + half) energy of one row, over `tr` rows,
// to acc (element by element, as a scalar loop adds it).
UCM_CLONES void pair_energy_acc(const float* row, double* acc, std::int64_t half, double tr) {
  for (std::int64_t c = 0; c < half; ++c) {
    const double a = row[c], z = row[c + half];
    acc[c] += (a * a + z * z) / tr;
  }
}

UCM_CLONES void quant8_row(const float* x, const float* inv, std::int8_t* q, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    float v = x[i] * inv[i];
    v = std::min(127.0f, std::max(-127.0f, v));
    q[i] = static_cast<std::int8_t>(static_cast<int>(v + (v >= 0.0f ? 0.5f : -0.5f)));
  }
}

// q = clamp(round(x / s) - z, 0, 15), two per byte (even element low);
// rounding half away from zero, written without floor() so that the
// baseline build (no SSE4.1 rounding instruction) vectorises it too.
UCM_CLONES void quant4_row(const float* x, const float* inv, const float* z, std::uint8_t* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n / 2; ++i) {
    float a = x[2 * i] * inv[2 * i] - z[2 * i], b = x[2 * i + 1] * inv[2 * i + 1] - z[2 * i + 1];
    a = std::min(15.0f, std::max(0.0f, a)) + 0.5f;  // z is an integer: round(x / s) - z == round(x / s - z)
    b = std::min(15.0f, std::max(0.0f, b)) + 0.5f;
    out[i] = static_cast<std::uint8_t>(static_cast<int>(a) | (static_cast<int>(b) << 4));
  }
}

// Fused dequantise-and-store row kernels: per-element steps (`v`, keys:
// one step per channel) or one step for the run (`s`, values: one per
// token or channel group), into bfloat16 or float32.
inline std::uint16_t put(float f, std::uint16_t*) { return kv_f32_to_bf16(f); }
inline float put(float f, float*) { return f; }

#define UCM_DEQUANT_KERNELS(SUFFIX, OUT)                                                                       \
  UCM_CLONES void dq8v_##SUFFIX(const std::int8_t* q, const float* s, OUT* o, std::int64_t n) {                \
    for (std::int64_t i = 0; i < n; ++i) o[i] = put(static_cast<float>(q[i]) * s[i], o);                       \
  }                                                                                                            \
  UCM_CLONES void dq8s_##SUFFIX(const std::int8_t* q, float s, OUT* o, std::int64_t n) {                       \
    for (std::int64_t i = 0; i < n; ++i) o[i] = put(static_cast<float>(q[i]) * s, o);                          \
  }                                                                                                            \
  UCM_CLONES void dq4v_##SUFFIX(const std::uint8_t* in, const float* s, const float* z, OUT* o, std::int64_t n) { \
    for (std::int64_t i = 0; i < n / 2; ++i) {                                                                 \
      o[2 * i] = put((static_cast<float>(in[i] & 0x0F) + z[2 * i]) * s[2 * i], o);                             \
      o[2 * i + 1] = put((static_cast<float>(in[i] >> 4) + z[2 * i + 1]) * s[2 * i + 1], o);                   \
    }                                                                                                          \
  }                                                                                                            \

UCM_DEQUANT_KERNELS(bf16, std::uint16_t)
UCM_CLONES void store_row_bf16(const float* y, std::uint16_t* o, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) o[i] = kv_f32_to_bf16(y[i]);
}
UCM_DEQUANT_KERNELS(f32, float)
#undef UCM_DEQUANT_KERNELS

// One row (n elements from column `at`) into dst: per-element steps/zeros
// (`vs`, `vz`) or one (s, z) for the run.
void dequant_run(const std::uint8_t* data, int bits, std::int64_t first, std::int64_t n, const float* vs,
                 const float* vz, float s, float z, KvElem e, std::uint8_t* dst, float* tmp) {
  const bool vec = vs != nullptr;
  if (bits == 8) {
    const auto* q = reinterpret_cast<const std::int8_t*>(data) + first;
    if (e == KvElem::BF16) {
      auto* o = reinterpret_cast<std::uint16_t*>(dst);
      vec ? dq8v_bf16(q, vs, o, n) : dq8s_bf16(q, s, o, n);
    } else {
      float* o = e == KvElem::F32 ? reinterpret_cast<float*>(dst) : tmp;
      vec ? dq8v_f32(q, vs, o, n) : dq8s_f32(q, s, o, n);
    }
  } else {
    const std::uint8_t* q = data + first / 2;
    if (e == KvElem::BF16) {
      auto* o = reinterpret_cast<std::uint16_t*>(dst);
      vec ? dq4v_bf16(q, vs, vz, o, n) : kv_unpack_run_bf16(q, s, z, o, n);
    } else {
      float* o = e == KvElem::F32 ? reinterpret_cast<float*>(dst) : tmp;
      vec ? dq4v_f32(q, vs, vz, o, n) : kv_unpack_run_f32(q, s, z, o, n);
    }
  }
  if (e == KvElem::F16) {
    for (std::int64_t i = 0; i < n; ++i) store_le<std::uint16_t>(dst + 2 * i, kv_f32_to_f16(tmp[i]));
  }
}

// Elements >= 0 and not NaN (|deviations|) are scanned a chunk at a time:
// a chunk whose max (a loop that vectorises) is below what the scan looks
// for is skipped; most are, and the scans find exactly what an element
// by element loop finds (one element at a time they were a fifth of
// int4's encode).
constexpr std::size_t kScanChunk = 32;

// The k-th largest of x (1 <= k <= x.size(), x >= 0, no NaN), as
// nth_element would give it: a min-heap of the k largest so far (a full
// selection over a value segment was a quarter of int4's encode).
float kth_largest(const std::vector<float>& x, std::int64_t k) {
  std::vector<float> heap(x.begin(), x.begin() + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (std::size_t i = static_cast<std::size_t>(k); i < x.size();) {
    const std::size_t end = std::min(x.size(), i + kScanChunk);
    if (!(max_nonneg(x.data() + i, static_cast<std::int64_t>(end - i)) > heap.front())) {
      i = end;
      continue;
    }
    for (; i < end; ++i) {
      if (x[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = x[i];
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
  }
  return heap.front();
}

// The indexes of the `want` elements of x (>= 0, no NaN) above thr, then
// at thr, in index order: the elements > thr first (all of them), then
// those == thr until `want` (ties: lowest index).
void outlier_indexes(const std::vector<float>& x, float thr, std::int64_t want, std::vector<std::uint32_t>& idx) {
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; i += kScanChunk) {
    const std::size_t end = std::min(n, i + kScanChunk);
    if (!(max_nonneg(x.data() + i, static_cast<std::int64_t>(end - i)) > thr)) continue;
    for (std::size_t j = i; j < end; ++j)
      if (x[j] > thr) idx.push_back(static_cast<std::uint32_t>(j));
  }
  for (std::size_t i = 0; i < n && static_cast<std::int64_t>(idx.size()) < want; i += kScanChunk) {
    const std::size_t end = std::min(n, i + kScanChunk);
    if (max_nonneg(x.data() + i, static_cast<std::int64_t>(end - i)) < thr) continue;
    for (std::size_t j = i; j < end && static_cast<std::int64_t>(idx.size()) < want; ++j)
      if (x[j] == thr) idx.push_back(static_cast<std::uint32_t>(j));
  }
}

}  // namespace kvrows
}  // namespace ucm
