// int4's paired-key encoder pieces (kv_pack.hpp) against their plain
// references: the widths a threshold selection gives against a priority
// queue handing out one bit at a time, and key tiles packed from a row
// block of codes against one code at a time down each column; both also
// against what the format says (widths in 1..8 summing to 4 per pair,
// code i of a tile at bit i * w).
#include "ucm/kv_pack.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"

static void test_widths() {
  std::mt19937 rng(5);
  for (int n : {1, 2, 3, 7, 32, 96, 384}) {
    for (int round = 0; round < 12; ++round) {
      std::vector<double> prio(n);
      for (auto& p : prio) {
        const unsigned kind = rng() % 8;
        if (kind == 0) p = -HUGE_VAL;  // a pair without energy or range
        else if (kind < 4 || round % 3 == 0) p = static_cast<double>(static_cast<int>(rng() % 9) - 4);  // ties, 2 apart
        else p = std::uniform_real_distribution<double>(-30.0, 30.0)(rng);
      }
      if (round == 11) std::fill(prio.begin(), prio.end(), -HUGE_VAL);
      std::vector<int> w(n, -1), wp(n, -1);
      ucm::kv_pair_widths(prio.data(), n, w.data());
      ucm::kv_pair_widths_plain(prio.data(), n, wp.data());
      CHECK(w == wp);
      long sum = 0;
      for (int q = 0; q < n; ++q) {
        CHECK(w[q] >= 1 && w[q] <= 8);
        sum += w[q];
      }
      CHECK(sum == 4L * n);
    }
  }
}

static void test_key_tiles() {
  std::mt19937 rng(9);
  for (int D : {2, 8, 48, 64, 65}) {
    for (int rows : {8, 32, 64}) {
      for (int round = 0; round < 6; ++round) {
        std::vector<float> x(static_cast<std::size_t>(rows * D));
        for (auto& v : x) v = std::normal_distribution<float>(0.0f, 3.0f)(rng);
        for (int k = 0; k < rows * D / 50 + 1; ++k) x[rng() % x.size()] = NAN;  // outlier places: code 0
        std::vector<int> w(D);
        std::vector<float> inv(D), off(D);
        std::size_t bytes = 0;
        for (int c = 0; c < D; ++c) {
          w[c] = static_cast<int>(rng() % 8) + 1;
          // x * inv over about +-levels / 2, shifted by up to levels: every code, and clamping at both ends.
          const float levels = static_cast<float>((1 << w[c]) - 1);
          inv[c] = c % 7 == 0 ? 0.0f : levels / 12.0f * std::uniform_real_distribution<float>(0.5f, 2.0f)(rng);
          off[c] = -static_cast<float>(static_cast<int>(rng() % (2u << w[c])) - (1 << w[c]) / 2);
          bytes += static_cast<std::size_t>(rows * w[c] / 8);
        }
        std::vector<std::uint8_t> out(bytes + 8, 0xAB), outp(bytes + 8, 0xAB), codes(static_cast<std::size_t>(rows * D));
        CHECK(ucm::kv_pack_key_tiles(x.data(), rows, D, w.data(), inv.data(), off.data(), codes.data(), out.data()) ==
              bytes);
        CHECK(ucm::kv_pack_key_tiles_plain(x.data(), rows, D, w.data(), inv.data(), off.data(), outp.data()) == bytes);
        CHECK(out == outp);  // the bytes past the tiles untouched too
        // An independent bit reader: code i of column c at bit i * w[c] of its tile.
        std::size_t at = 0;
        bool ok = true;
        for (int c = 0; c < D; ++c) {
          const float levels = static_cast<float>((1 << w[c]) - 1);
          for (int r = 0; r < rows; ++r) {
            float v = x[r * D + c] * inv[c] - off[c];
            const unsigned want = std::isnan(v) ? 0u : static_cast<unsigned>(std::fmin(levels, std::fmax(0.0f, v)) + 0.5f);
            unsigned got = 0;
            for (int b = 0; b < w[c]; ++b) {
              const std::size_t bit = at * 8 + static_cast<std::size_t>(r * w[c] + b);
              got |= ((out[bit / 8] >> (bit % 8)) & 1u) << b;
            }
            ok = ok && got == want;
          }
          at += static_cast<std::size_t>(rows * w[c] / 8);
        }
        CHECK(ok);
      }
    }
  }
}

int main() {
  test_widths();
  test_key_tiles();
  return finish("kv_pack");
}
