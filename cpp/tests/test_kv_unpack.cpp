// C++ tests of int4's decode loops (ucm/kv_unpack.hpp), built and run by `make test`:
// the dispatched paths (AVX2 where the CPU has it) give the same bits as the
// one-at-a-time references, and both the values an independent bit reader gives.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "ucm/kv_unpack.hpp"

static std::uint16_t bf16_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// Code i of a tile of width w, LSB first.
static unsigned code_at(const std::uint8_t* tile, int w, int i) {
  unsigned q = 0;
  for (int b = 0; b < w; ++b) {
    const int bit = i * w + b;
    q |= static_cast<unsigned>((tile[bit / 8] >> (bit % 8)) & 1u) << b;
  }
  return q;
}

static void test_key_tiles() {
  std::mt19937 rng(7);
  const int shapes[][2] = {{8, 8}, {32, 64}, {128, 64}, {32, 72}, {16, 6}, {8, 2}};
  for (const auto& shape : shapes) {
    const int rows = shape[0], D = shape[1];
    for (int round = 0; round < 4; ++round) {
      std::vector<int> widths(D);
      std::vector<float> steps(D), offs(D);
      std::size_t bytes = 0;
      for (int c = 0; c < D; ++c) {
        widths[c] = round == 0 ? 8 : round == 1 ? 1 : 1 + static_cast<int>(rng() % 8);
        steps[c] = std::ldexp(static_cast<float>(rng() % 1000 + 1), -static_cast<int>(rng() % 20));
        offs[c] = static_cast<float>(static_cast<int>(rng() % 256) - 128) * (widths[c] > 4 ? 1 << (widths[c] - 4) : 1);
        bytes += static_cast<std::size_t>(rows * widths[c] / 8);
      }
      std::vector<std::uint8_t> data(bytes);  // exactly the tiles: the last 8-byte read must not run past
      for (auto& b : data) b = static_cast<std::uint8_t>(rng());
      std::vector<float> fast(static_cast<std::size_t>(rows * D), -1.0f), plain(fast), ref(fast);
      CHECK(ucm::kv_unpack_key_tiles(data.data(), data.data() + data.size(), widths.data(), steps.data(),
                                     offs.data(), rows, D, fast.data()) == bytes);
      CHECK(ucm::kv_unpack_key_tiles_plain(data.data(), widths.data(), steps.data(), offs.data(), rows, D,
                                           plain.data()) == bytes);
      const std::uint8_t* tile = data.data();
      for (int c = 0; c < D; ++c) {
        for (int r = 0; r < rows; ++r)
          ref[r * D + c] = (static_cast<float>(code_at(tile, widths[c], r)) + offs[c]) * steps[c];
        tile += rows * widths[c] / 8;
      }
      CHECK(std::memcmp(fast.data(), plain.data(), fast.size() * 4) == 0);
      CHECK(std::memcmp(plain.data(), ref.data(), ref.size() * 4) == 0);
    }
  }
}

static void test_value_runs() {
  std::mt19937 rng(11);
  for (int n : {2, 30, 32, 34, 64, 96, 130}) {
    for (int round = 0; round < 8; ++round) {
      std::vector<std::uint8_t> in(static_cast<std::size_t>(n / 2));
      for (auto& b : in) b = static_cast<std::uint8_t>(rng());
      // Steps of few significant bits make bf16 ties (round to even); full ones, every other case.
      const float s = round % 2 ? std::ldexp(static_cast<float>(rng() % 512 + 1), -static_cast<int>(rng() % 30))
                                : std::uniform_real_distribution<float>(1e-4f, 10.0f)(rng);
      const float z = static_cast<float>(static_cast<int>(rng() % 256) - 128);
      std::vector<std::uint16_t> h(n), hp(n), href(n);
      std::vector<float> f(n), fp(n), fref(n);
      ucm::kv_unpack_run_bf16(in.data(), s, z, h.data(), n);
      ucm::kv_unpack_run_bf16_plain(in.data(), s, z, hp.data(), n);
      ucm::kv_unpack_run_f32(in.data(), s, z, f.data(), n);
      ucm::kv_unpack_run_f32_plain(in.data(), s, z, fp.data(), n);
      for (int i = 0; i < n; ++i) {
        const unsigned q = (in[i / 2] >> (4 * (i % 2))) & 0x0Fu;
        fref[i] = (static_cast<float>(q) + z) * s;
        href[i] = bf16_of(fref[i]);
      }
      CHECK(h == hp);
      CHECK(hp == href);
      CHECK(std::memcmp(f.data(), fp.data(), f.size() * 4) == 0);
      CHECK(std::memcmp(fp.data(), fref.data(), f.size() * 4) == 0);
    }
  }
}

int main() {
  test_key_tiles();
  test_value_runs();
  return finish("kv_unpack");
}
