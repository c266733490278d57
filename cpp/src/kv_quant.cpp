// KV quantisation kernels (formats in kv_quant.hpp): the encoded layout of
// a segment, int8 and int4 encode and decode segment by segment, and the
// threads a block's segments run on. The loops over rows are in
// kv_rows.cpp, int4's paired-key widths and packing in kv_pack.cpp, its
// unpacking in kv_unpack.cpp.
#include "ucm/kv_quant.hpp"

#include "ucm/kv_pack.hpp"
#include "ucm/kv_rows.hpp"
#include "ucm/kv_unpack.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ucm {
namespace {

// s(c) = base * 2^(-c/16): one table, so that encoder and decoder agree bit for bit.
struct Pow2Table {
  float v[256];
  Pow2Table() {
    for (int c = 0; c < 256; ++c) v[c] = std::exp2(-static_cast<float>(c) / 16.0f);
  }
};
const Pow2Table kPow2;

using namespace kvrows;  // the row loops and scans (kv_rows.cpp)

// Outlier indexes: u16 where a segment has at most 65536 elements, else u32.
inline void store_index(std::uint8_t* at, std::size_t width, std::int64_t k, std::uint32_t i) {
  if (width == 2) {
    store_le<std::uint16_t>(at + 2 * k, static_cast<std::uint16_t>(i));
  } else {
    store_le<std::uint32_t>(at + 4 * k, i);
  }
}

inline std::int64_t load_index(const std::uint8_t* at, std::size_t width, std::int64_t k) {
  return width == 2 ? load_le<std::uint16_t>(at + 2 * k) : load_le<std::uint32_t>(at + 4 * k);
}

// ---- layout of an encoded segment --------------------------------------------
struct Parts {
  std::int64_t n_tiles, n_tc;
  std::size_t idx_bytes;                              // bytes of one outlier index (4-bit)
  std::size_t params, widths, idx, raw, data, total;  // offsets (total = size)
};

void check_spec(const KvSegment& s, KvElem e) {
  auto bad = [](const std::string& why) { throw std::invalid_argument("kv segment: " + why); };
  if (e != KvElem::F32 && e != KvElem::F16 && e != KvElem::BF16) bad("unknown element type");
  if (s.rows <= 0 || s.cols <= 0) bad("rows and cols must be > 0");
  if (s.bits != 8 && s.bits != 4) bad("bits must be 8 or 4, got " + std::to_string(s.bits));
  if (s.tile_rows <= 0 || s.rows % s.tile_rows) bad("tile_rows must divide rows");
  if (s.tile_cols <= 0 || s.cols % s.tile_cols) bad("tile_cols must divide cols");
  if (s.bits == 4 && s.cols % 2) bad("4-bit segments need an even number of cols");
  if (s.rows * s.cols > (std::int64_t{1} << 32)) bad("a segment holds at most 2^32 elements");
  if (s.outliers < 0 || s.outliers > s.rows * s.cols) bad("outliers out of range");
  if (s.bits == 8 && s.outliers) bad("8-bit segments keep no outliers");
  if (s.paired && (s.bits != 4 || s.tile_cols != 1 || s.tile_rows % 8 || s.cols % 2))
    bad("paired widths need bits 4, tile_cols 1, tile_rows a multiple of 8 and an even number of cols");
}

Parts parts_of(const KvSegment& s, KvElem e) {
  check_spec(s, e);
  Parts p{};
  p.n_tc = s.cols / s.tile_cols;
  p.n_tiles = (s.rows / s.tile_rows) * p.n_tc;
  const std::size_t n = static_cast<std::size_t>(s.rows * s.cols);
  if (s.bits == 8) {
    p.params = 0;
    p.widths = p.idx = p.raw = p.data = 2 * static_cast<std::size_t>(p.n_tiles);
    p.total = p.data + n;
  } else {
    p.params = 4;
    p.idx_bytes = kv_outlier_index_bytes(s);
    p.widths = p.params + 2 * static_cast<std::size_t>(p.n_tiles);
    p.idx = p.widths + (s.paired ? (static_cast<std::size_t>(p.n_tiles / 2) + 1) / 2 : 0);
    p.raw = p.idx + p.idx_bytes * static_cast<std::size_t>(s.outliers);
    p.data = p.raw + kv_elem_bytes(e) * static_cast<std::size_t>(s.outliers);
    p.total = p.data + n / 2;
  }
  return p;
}

bool load_segment(const std::uint8_t* src, const std::int64_t* row_offsets, const KvSegment& s, KvElem e,
                  std::vector<float>& x) {
  x.resize(static_cast<std::size_t>(s.rows * s.cols));
  for (std::int64_t r = 0; r < s.rows; ++r) load_row(src + row_offsets[r], x.data() + r * s.cols, s.cols, e);
  return all_finite(x.data(), static_cast<std::int64_t>(x.size()));
}

std::uint16_t f16_at_least(float v) {  // the smallest half >= v (v >= 0, finite)
  std::uint16_t h = kv_f32_to_f16(v);
  if (kv_f16_to_f32(h) < v) ++h;
  return h;
}


bool encode8(const std::vector<float>& x, const KvSegment& s, const Parts& p, std::uint8_t* out) {
  const std::int64_t D = s.cols, tr = s.tile_rows, tc = s.tile_cols;
  std::vector<float> acc(D), inv(D);
  auto* q = reinterpret_cast<std::int8_t*>(out + p.data);
  for (std::int64_t b = 0; b < s.rows / tr; ++b) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r) absmax_acc(x.data() + r * D, acc.data(), D);
    for (std::int64_t c = 0; c < p.n_tc; ++c) {
      float amax = max_nonneg(acc.data() + c * tc, tc);
      float want = amax / 127.0f;
      if (!(want <= 65504.0f)) return false;  // beyond half precision
      std::uint16_t h = f16_at_least(want);
      store_le<std::uint16_t>(out + 2 * (b * p.n_tc + c), h);
      float sf = kv_f16_to_f32(h);
      std::fill(inv.begin() + c * tc, inv.begin() + (c + 1) * tc, sf > 0.0f ? 1.0f / sf : 0.0f);
    }
    for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r) quant8_row(x.data() + r * D, inv.data(), q + r * D, D);
  }
  return true;
}

bool encode4(std::vector<float>& x, const std::uint8_t* src, const std::int64_t* row_offsets, const KvSegment& s,
             KvElem e, const Parts& p, std::uint8_t* out) {
  const std::int64_t D = s.cols, tr = s.tile_rows, tc = s.tile_cols, nb = s.rows / tr;
  const std::size_t eb = kv_elem_bytes(e);
  const std::int64_t half = D / 2;
  // paired: the mean energy of each RoPE pair of each row block, outliers included.
  std::vector<double> energy;
  if (s.paired) {
    energy.assign(static_cast<std::size_t>(nb * half), 0.0);
    for (std::int64_t b = 0; b < nb; ++b)
      for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r)
        pair_energy_acc(x.data() + r * D, energy.data() + b * half, half, static_cast<double>(tr));
  }
  // Tile means: the centre outliers are measured from and put back to.
  std::vector<float> mean(static_cast<std::size_t>(p.n_tiles), 0.0f);
  if (s.outliers) {
    // Summed in double: float sums of values near FLT_MAX overflow to +inf
    // and -inf in one tile, whose NaN mean left no element >= the threshold
    // below (and `idx` short of `outliers`: a read and write past its end).
    std::vector<double> sum(D);
    for (std::int64_t b = 0; b < nb; ++b) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r)
        for (std::int64_t d = 0; d < D; ++d) sum[d] += x[r * D + d];
      for (std::int64_t c = 0; c < p.n_tc; ++c)
        mean[b * p.n_tc + c] = static_cast<float>(
            std::accumulate(sum.begin() + c * tc, sum.begin() + (c + 1) * tc, 0.0) / static_cast<double>(tr * tc));
    }
    // The `outliers` elements farthest from their tile's mean (ties: lowest index).
    const std::int64_t n = s.rows * D;
    std::vector<float> dev(static_cast<std::size_t>(n));
    std::vector<float> mcol(D);
    for (std::int64_t b = 0; b < nb; ++b) {
      for (std::int64_t c = 0; c < p.n_tc; ++c) std::fill_n(mcol.begin() + c * tc, tc, mean[b * p.n_tc + c]);
      for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r)
        for (std::int64_t d = 0; d < D; ++d) dev[r * D + d] = std::fabs(x[r * D + d] - mcol[d]);
    }
    const float thr = kth_largest(dev, s.outliers);
    std::vector<std::uint32_t> idx;
    idx.reserve(static_cast<std::size_t>(s.outliers));
    outlier_indexes(dev, thr, s.outliers, idx);
    if (static_cast<std::int64_t>(idx.size()) < s.outliers) return false;  // never past idx's end
    std::sort(idx.begin(), idx.begin() + s.outliers);
    for (std::int64_t k = 0; k < s.outliers; ++k) {
      std::uint32_t i = idx[k];
      store_index(out + p.idx, p.idx_bytes, k, i);
      std::memcpy(out + p.raw + eb * k, src + row_offsets[i / D] + (i % D) * eb, eb);
      x[i] = NAN;  // left out of its tile's range (min/max keep the other operand); decoded exactly
    }
  }
  // Per tile: the step each needs, then the base and the codes.
  std::vector<float> need(static_cast<std::size_t>(p.n_tiles)), lo_t(need.size()), hi_t(need.size()), lo(D), hi(D);
  for (std::int64_t b = 0; b < nb; ++b) {
    std::fill(lo.begin(), lo.end(), INFINITY);
    std::fill(hi.begin(), hi.end(), -INFINITY);
    for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r) minmax_acc(x.data() + r * D, lo.data(), hi.data(), D);
    for (std::int64_t c = 0; c < p.n_tc; ++c) {
      float mn = *std::min_element(lo.begin() + c * tc, lo.begin() + (c + 1) * tc);
      float mx = *std::max_element(hi.begin() + c * tc, hi.begin() + (c + 1) * tc);
      if (!(mn <= mx)) mn = mx = 0.0f;  // every element of the tile is an outlier
      lo_t[b * p.n_tc + c] = mn;
      hi_t[b * p.n_tc + c] = mx;
    }
  }
  // Widths: 4 per tile, or (paired) 1..8 per pair, 4 on average.
  std::vector<int> width(need.size(), 4);
  if (s.paired) {
    const std::int64_t n_pairs = nb * half;
    std::vector<int> w(static_cast<std::size_t>(n_pairs));
    std::vector<double> prio(w.size());
    for (std::int64_t q = 0; q < n_pairs; ++q) {
      std::int64_t t0 = (q / half) * D + q % half;
      double r0 = static_cast<double>(hi_t[t0]) - lo_t[t0], r1 = static_cast<double>(hi_t[t0 + half]) - lo_t[t0 + half];
      double v = energy[q] * (r0 * r0 + r1 * r1);
      prio[q] = v > 0.0 && std::isfinite(v) ? std::log2(v) : -HUGE_VAL;
    }
    kv_pair_widths(prio.data(), n_pairs, w.data());
    for (std::int64_t q = 0; q < n_pairs; ++q) {
      std::int64_t t0 = (q / half) * D + q % half;
      width[t0] = width[t0 + half] = w[q];
      std::uint8_t& nib = out[p.widths + q / 2];
      if (q % 2 == 0) nib = static_cast<std::uint8_t>(w[q] - 1);
      else nib = static_cast<std::uint8_t>(nib | ((w[q] - 1) << 4));
    }
  }
  // The step each tile needs. Width w <= 4: z = round(mn / s) puts mn
  // within s / 2 of the grid's first level, so s >= (mx - mn) / (2^w - 1)
  // reaches mx within s / 2 of the last; |z| <= 127 needs s >= |mn| / 127.
  // w > 4: the grid starts at z f s with f = 2^(w-4) and z = floor(mn /
  // (f s)), within f s below mn: s >= (mx - mn) / (2^w - 1/2 - f) reaches
  // mx, s >= |mn| / (127 f) keeps z in an i8.
  float base = 0.0f;
  for (std::size_t t = 0; t < need.size(); ++t) {
    const int w = width[t];
    const float levels = static_cast<float>((1 << w) - 1), f = w > 4 ? static_cast<float>(1 << (w - 4)) : 1.0f;
    const float span = hi_t[t] - lo_t[t];
    need[t] = w > 4 ? std::max(span / (levels + 0.5f - f), std::fabs(lo_t[t]) / (127.0f * f))
                    : std::max(span / levels, std::fabs(lo_t[t]) / 127.0f);
    base = std::max(base, need[t]);
  }
  if (!std::isfinite(base)) return false;
  store_le<float>(out, base);
  std::vector<float> step(need.size()), zero(need.size());
  for (std::size_t t = 0; t < need.size(); ++t) {
    int c = 0;
    if (base > 0.0f) {
      c = need[t] > 0.0f ? static_cast<int>(std::floor(-16.0f * std::log2(need[t] / base))) : 255;
      c = std::min(255, std::max(0, c));
      while (c > 0 && base * kPow2.v[c] < need[t]) --c;
    }
    float st = base * kPow2.v[c];
    float z;
    if (width[t] > 4) {
      const float u = st * static_cast<float>(1 << (width[t] - 4));
      z = u > 0.0f ? std::floor(lo_t[t] / u) : 0.0f;
      if (z * u > lo_t[t]) z -= 1.0f;  // the division rounded up
    } else {
      z = st > 0.0f ? std::floor(lo_t[t] / st + 0.5f) : 0.0f;
    }
    z = std::min(127.0f, std::max(-128.0f, z));
    out[p.params + 2 * t] = static_cast<std::uint8_t>(c);
    out[p.params + 2 * t + 1] = static_cast<std::uint8_t>(static_cast<std::int8_t>(z));
    step[t] = st;
    zero[t] = z;
  }
  if (s.paired) {  // per tile, in tile order: tile_rows codes of w bits
    std::vector<float> inv(D), off(D);
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(tr * D));
    std::size_t at = 0;
    for (std::int64_t b = 0; b < nb; ++b) {
      for (std::int64_t c = 0; c < D; ++c) {
        const std::size_t t = static_cast<std::size_t>(b * D + c);
        off[c] = zero[t] * (width[t] > 4 ? static_cast<float>(1 << (width[t] - 4)) : 1.0f);
        inv[c] = step[t] > 0.0f ? 1.0f / step[t] : 0.0f;  // an outlier's NaN: code 0
      }
      at += kv_pack_key_tiles(x.data() + b * tr * D, tr, D, width.data() + b * D, inv.data(), off.data(), codes.data(),
                              out + p.data + at);
    }
    return true;
  }
  std::vector<float> inv(D), zc(D);
  for (std::int64_t b = 0; b < nb; ++b) {
    for (std::int64_t c = 0; c < p.n_tc; ++c) {  // one division per tile (a tile may be a single row's run)
      const std::size_t t = static_cast<std::size_t>(b * p.n_tc + c);
      std::fill_n(inv.begin() + c * tc, tc, step[t] > 0.0f ? 1.0f / step[t] : 0.0f);
      std::fill_n(zc.begin() + c * tc, tc, zero[t]);
    }
    for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r)
      quant4_row(x.data() + r * D, inv.data(), zc.data(), out + p.data + r * D / 2, D);
  }
  return true;
}

}  // namespace

std::size_t kv_elem_bytes(KvElem e) { return e == KvElem::F32 ? 4 : 2; }

std::size_t kv_outlier_index_bytes(const KvSegment& s) { return s.rows * s.cols <= 65536 ? 2 : 4; }

std::size_t kv_encoded_bytes(const KvSegment& s, KvElem e) { return parts_of(s, e).total; }

bool kv_encode(const std::uint8_t* src, const std::int64_t* row_offsets, const KvSegment& s, KvElem e,
               std::uint8_t* out) {
  Parts p = parts_of(s, e);
  std::vector<float> x;
  if (!load_segment(src, row_offsets, s, e, x)) return false;
  return s.bits == 8 ? encode8(x, s, p, out) : encode4(x, src, row_offsets, s, e, p, out);
}

void kv_tile_steps(const std::uint8_t* enc, const KvSegment& s, KvElem e, float* steps) {
  Parts p = parts_of(s, e);
  if (s.bits == 8) {
    for (std::int64_t t = 0; t < p.n_tiles; ++t) steps[t] = kv_f16_to_f32(load_le<std::uint16_t>(enc + 2 * t));
  } else {
    float base = load_le<float>(enc);
    for (std::int64_t t = 0; t < p.n_tiles; ++t) steps[t] = base * kPow2.v[enc[p.params + 2 * t]];
  }
}

bool kv_decode(const std::uint8_t* enc, const KvSegment& s, KvElem e, std::uint8_t* dst,
               const std::int64_t* row_offsets) {
  Parts p = parts_of(s, e);
  const std::int64_t D = s.cols, tr = s.tile_rows, tc = s.tile_cols, nb = s.rows / tr;
  const std::size_t eb = kv_elem_bytes(e);
  std::vector<float> st(static_cast<std::size_t>(p.n_tiles)), sc(D), zc(D, 0.0f), y(D);
  kv_tile_steps(enc, s, e, st.data());
  if (s.bits == 4) {
    if (!std::isfinite(load_le<float>(enc)) || load_le<float>(enc) < 0.0f) return false;
    std::int64_t prev = -1;
    for (std::int64_t k = 0; k < s.outliers; ++k) {
      std::int64_t i = load_index(enc + p.idx, p.idx_bytes, k);
      if (i <= prev || i >= s.rows * D) return false;
      prev = i;
    }
  } else {
    for (float v : st) {
      if (!std::isfinite(v)) return false;
    }
  }
  auto zero_of = [&](std::size_t t) {
    return s.bits == 4 ? static_cast<float>(static_cast<std::int8_t>(enc[p.params + 2 * t + 1])) : 0.0f;
  };
  const std::uint8_t* data = enc + p.data;
  if (s.paired) {  // widths 1..8 summing to 4 per tile, else the bytes are not ours
    const std::int64_t half = D / 2, n_pairs = nb * half;
    std::vector<int> width(static_cast<std::size_t>(n_pairs));
    std::int64_t bits_total = 0;
    for (std::int64_t q = 0; q < n_pairs; ++q) {
      int nib = (enc[p.widths + q / 2] >> (4 * (q % 2))) & 0x0F;
      if (nib > 7) return false;
      width[q] = nib + 1;
      bits_total += 2 * width[q];
    }
    if (bits_total != 4 * p.n_tiles) return false;
    std::vector<float> blk(static_cast<std::size_t>(tr * D)), off(D);
    std::vector<int> wc(D);
    std::size_t at = 0;
    for (std::int64_t b = 0; b < nb; ++b) {
      for (std::int64_t c = 0; c < D; ++c) {
        const std::size_t t = static_cast<std::size_t>(b * D + c);
        wc[c] = width[b * half + c % half];
        off[c] = zero_of(t) * (wc[c] > 4 ? static_cast<float>(1 << (wc[c] - 4)) : 1.0f);
      }
      at += kv_unpack_key_tiles(data + at, enc + p.total, wc.data(), st.data() + b * D, off.data(), tr, D,
                                blk.data());
      for (std::int64_t r = 0; r < tr; ++r) {
        std::uint8_t* o = dst + row_offsets[b * tr + r];
        const float* y = blk.data() + r * D;
        if (e == KvElem::F32) {
          std::memcpy(o, y, static_cast<std::size_t>(D) * 4);
        } else if (e == KvElem::BF16) {
          store_row_bf16(y, reinterpret_cast<std::uint16_t*>(o), D);
        } else {
          for (std::int64_t d = 0; d < D; ++d) store_le<std::uint16_t>(o + 2 * d, kv_f32_to_f16(y[d]));
        }
      }
    }
  }
  for (std::int64_t b = 0; b < nb && !s.paired; ++b) {
    if (tr > 1) {  // steps per column, shared by the block's rows (keys)
      for (std::int64_t d = 0; d < D; ++d) {
        std::size_t t = static_cast<std::size_t>(b * p.n_tc + d / tc);
        sc[d] = st[t];
        zc[d] = zero_of(t);
      }
      for (std::int64_t r = b * tr; r < (b + 1) * tr; ++r)
        dequant_run(data, s.bits, r * D, D, sc.data(), zc.data(), 0, 0, e, dst + row_offsets[r], y.data());
    } else {  // one row: one step per run of tile_cols (values)
      for (std::int64_t c = 0; c < p.n_tc; ++c) {
        std::size_t t = static_cast<std::size_t>(b * p.n_tc + c);
        dequant_run(data, s.bits, b * D + c * tc, tc, nullptr, nullptr, st[t], zero_of(t), e,
                    dst + row_offsets[b] + c * tc * eb, y.data());
      }
    }
  }
  for (std::int64_t k = 0; k < s.outliers; ++k) {
    std::int64_t i = load_index(enc + p.idx, p.idx_bytes, k);
    std::memcpy(dst + row_offsets[i / D] + (i % D) * eb, enc + p.raw + eb * k, eb);
  }
  return true;
}

bool kv_run_segments(bool encode, const std::uint8_t* raw, std::uint8_t* raw_out, const std::int64_t* row_offsets,
                     const KvSegmentAt* segs, std::size_t n, KvElem e, std::uint8_t* enc, const std::uint8_t* enc_in,
                     int threads) {
  std::atomic<bool> ok{true};
  std::atomic<std::size_t> next{0};
  auto work = [&]() {
    for (std::size_t i; ok.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
      const KvSegmentAt& g = segs[i];
      bool r = encode ? kv_encode(raw, row_offsets + g.row_start, g.seg, e, enc + g.enc_offset)
                      : kv_decode(enc_in + g.enc_offset, g.seg, e, raw_out, row_offsets + g.row_start);
      if (!r) ok = false;
    }
  };
  int t = std::max(1, std::min<int>(threads, static_cast<int>(n)));
  std::vector<std::thread> pool;
  for (int k = 1; k < t; ++k) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return ok;
}

std::uint16_t kv_f32_to_f16(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t mag = x & 0x7FFFFFFFu;
  if (mag >= 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7C00u | (mag > 0x7F800000u ? 0x200u : 0u));
  if (mag >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (mag < 0x38800000u) {  // subnormal half (or zero)
    if (mag < 0x33000000u) return static_cast<std::uint16_t>(sign);
    std::uint32_t exp = mag >> 23, man = (mag & 0x7FFFFFu) | 0x800000u;
    std::uint32_t shift = 126 - exp;  // value = man * 2^(exp-150) = half * 2^-24
    std::uint32_t half = man >> shift;
    std::uint32_t rem = man & ((1u << shift) - 1u), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t r = mag - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xFFFu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

float kv_f16_to_f32(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
  if (exp == 0) {
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  if (exp == 31) {
    u = sign | 0x7F800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace ucm
