// int4's paired keys, encoder side (kv_pack.hpp).
//
// Widths: a priority queue handing out 3 n bits one at a time took about a
// third of int4's encode (a pop per bit, its compares unpredictable). The
// bits it hands out are the 3 n largest of the candidates (prio[q] - 2k,
// q), k = 0..6, in (priority descending, pair ascending) order: each
// pair's candidates fall, so the queue pops them in that global order. So
// a selection finds the 3n-th candidate and one pass counts each pair's.
//
// Key tiles: a tile is one channel over `rows` tokens, D floats apart in
// x. The plain loop quantises and packs one code at a time down each
// column; here the codes of the whole row block are computed a row at a
// time (a loop the compiler vectorises) and each column's codes are then
// packed eight at a time into w bytes (w a template parameter).
#include "ucm/kv_pack.hpp"

#include "ucm/clones.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

namespace ucm {
namespace {

constexpr int kSteps = 7;  // bits a pair can get beyond its first (1 -> 8)

// The plain loop's arithmetic, element by element (NaN: std::max gives 0).
inline std::uint8_t code_of(float x, float inv, float off, float levels) {
  float v = x * inv - off;
  v = std::min(levels, std::max(0.0f, v)) + 0.5f;
  return static_cast<std::uint8_t>(static_cast<int>(v));
}

UCM_CLONES void code_rows(const float* x, std::int64_t rows, std::int64_t D, const float* inv, const float* off,
                               const float* levels, std::uint8_t* codes) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < D; ++c) codes[r * D + c] = code_of(x[r * D + c], inv[c], off[c], levels[c]);
}

template <int W>
void pack_column(const std::uint8_t* codes, std::int64_t rows, std::int64_t D, std::uint8_t* out) {
  for (std::int64_t r = 0; r < rows; r += 8, out += W) {
    std::uint64_t acc = 0;
    for (int i = 0; i < 8; ++i) acc |= static_cast<std::uint64_t>(codes[(r + i) * D]) << (i * W);
    std::memcpy(out, &acc, W);  // little-endian: the low W bytes
  }
}

void pack_column(int w, const std::uint8_t* codes, std::int64_t rows, std::int64_t D, std::uint8_t* out) {
  switch (w) {
    case 1: return pack_column<1>(codes, rows, D, out);
    case 2: return pack_column<2>(codes, rows, D, out);
    case 3: return pack_column<3>(codes, rows, D, out);
    case 4: return pack_column<4>(codes, rows, D, out);
    case 5: return pack_column<5>(codes, rows, D, out);
    case 6: return pack_column<6>(codes, rows, D, out);
    case 7: return pack_column<7>(codes, rows, D, out);
    default: return pack_column<8>(codes, rows, D, out);
  }
}

}  // namespace

void kv_pair_widths(const double* prio, std::int64_t n, int* widths) {
  if (n <= 0) return;
  // Each pair's candidates, falling as the queue computes them (prio - 2.0, again and again).
  std::vector<double> cand(static_cast<std::size_t>(n * kSteps));
  for (std::int64_t q = 0; q < n; ++q) {
    double v = prio[q];
    for (int k = 0; k < kSteps; ++k, v -= 2.0) cand[q * kSteps + k] = v;
  }
  const std::int64_t bits = 3 * n;  // < 7 n: the threshold is a candidate
  std::vector<double> sel(cand);
  std::nth_element(sel.begin(), sel.begin() + (bits - 1), sel.end(), std::greater<double>());
  const double thr = sel[bits - 1];
  std::int64_t left = bits;
  std::vector<int> ties(static_cast<std::size_t>(n), 0);
  for (std::int64_t q = 0; q < n; ++q) {
    int above = 0, at = 0;
    for (int k = 0; k < kSteps; ++k) {
      const double v = cand[q * kSteps + k];
      above += v > thr;
      at += v == thr;
    }
    widths[q] = 1 + above;
    ties[q] = at;
    left -= above;
  }
  for (std::int64_t q = 0; q < n && left > 0; ++q) {  // the threshold's ties, lowest pair first
    const int take = static_cast<int>(std::min<std::int64_t>(ties[q], left));
    widths[q] += take;
    left -= take;
  }
}

void kv_pair_widths_plain(const double* prio, std::int64_t n, int* widths) {
  std::priority_queue<std::pair<double, std::int64_t>> heap;  // (priority, -pair): ties go to the lowest pair
  for (std::int64_t q = 0; q < n; ++q) {
    widths[q] = 1;
    heap.emplace(prio[q], -q);
  }
  for (std::int64_t left = 3 * n; left > 0; --left) {  // all 8: 7 n > 3 n, never empty
    auto [p, mq] = heap.top();
    heap.pop();
    if (++widths[-mq] < 8) heap.emplace(p - 2.0, mq);
  }
}

std::size_t kv_pack_key_tiles(const float* x, std::int64_t rows, std::int64_t D, const int* widths, const float* inv,
                              const float* off, std::uint8_t* codes, std::uint8_t* out) {
  std::vector<float> levels(static_cast<std::size_t>(D));
  for (std::int64_t c = 0; c < D; ++c) levels[c] = static_cast<float>((1 << widths[c]) - 1);
  code_rows(x, rows, D, inv, off, levels.data(), codes);
  std::size_t at = 0;
  for (std::int64_t c = 0; c < D; ++c) {
    pack_column(widths[c], codes + c, rows, D, out + at);
    at += static_cast<std::size_t>(rows * widths[c] / 8);
  }
  return at;
}

std::size_t kv_pack_key_tiles_plain(const float* x, std::int64_t rows, std::int64_t D, const int* widths,
                                    const float* inv, const float* off, std::uint8_t* out) {
  std::size_t at = 0;
  for (std::int64_t c = 0; c < D; ++c) {
    const int w = widths[c];
    const float levels = static_cast<float>((1 << w) - 1);
    std::uint64_t acc = 0;
    int nbits = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      acc |= static_cast<std::uint64_t>(code_of(x[r * D + c], inv[c], off[c], levels)) << nbits;
      nbits += w;
      while (nbits >= 8) {
        out[at++] = static_cast<std::uint8_t>(acc);
        acc >>= 8;
        nbits -= 8;
      }
    }
  }
  return at;
}

}  // namespace ucm
