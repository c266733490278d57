// C++ tests of the native core, built and run by `make test` (no framework);
// the placement core and the reuse model are in test_placement.cpp.
#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <algorithm>
#include <array>
#include <set>
#include <utility>
#include <vector>

#include "ucm/copy.hpp"
#include "ucm/kv_quant.hpp"
#include "ucm/index.hpp"
#include "ucm/hash.hpp"
#include "ucm/io_engine.hpp"

#include "check.hpp"

#define XXH_INLINE_ALL
#include "xxhash.h"

static void test_chain_keys() {
  std::uint8_t seed[16] = {1};
  std::vector<std::uint32_t> tokens(1000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>(i * 7);
  std::vector<std::uint8_t> a(16 * 3), b(16 * 3);
  CHECK(ucm::chain_keys(seed, tokens.data(), 1000, 256, a.data()) == 3);  // partial block not keyed
  CHECK(ucm::chain_keys(seed, tokens.data(), 768, 256, b.data()) == 3);
  CHECK(a == b);
  // Chaining: changing block 0 changes every later key; changing block 2 only key 2.
  tokens[600] ^= 1;
  CHECK(ucm::chain_keys(seed, tokens.data(), 768, 256, b.data()) == 3);
  CHECK(std::memcmp(a.data(), b.data(), 32) == 0);
  CHECK(std::memcmp(a.data() + 32, b.data() + 32, 16) != 0);
  tokens[600] ^= 1;
  tokens[0] ^= 1;
  ucm::chain_keys(seed, tokens.data(), 768, 256, b.data());
  for (int i = 0; i < 3; ++i) CHECK(std::memcmp(a.data() + 16 * i, b.data() + 16 * i, 16) != 0);
}

static std::string hex(const std::uint8_t* p, std::size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

static std::vector<std::uint8_t> unhex(const std::string& s) {
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i + 1 < s.size(); i += 2) {
    out.push_back(static_cast<std::uint8_t>(std::stoi(s.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// XXH3-128 of `data` straight from xxHash, written high 64 bits first, each
// half big-endian: the canonical order ucm::digest128 promises, built here
// without XXH128_canonicalFromHash.
static std::string xxh3_128_hex(const std::vector<std::uint8_t>& data) {
  const XXH128_hash_t h = XXH3_128bits(data.data(), data.size());
  std::uint8_t out[16];
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<std::uint8_t>(h.high64 >> (56 - 8 * i));
    out[8 + i] = static_cast<std::uint8_t>(h.low64 >> (56 - 8 * i));
  }
  return hex(out, 16);
}

// The key of one block from first principles: XXH3-128(prev || tokens as little-endian uint32).
static std::string block_key_hex(const std::vector<std::uint8_t>& prev, const std::uint32_t* tokens,
                                 std::size_t n) {
  std::vector<std::uint8_t> buf(prev);
  for (std::size_t j = 0; j < n; ++j) {
    for (int b = 0; b < 4; ++b) buf.push_back(static_cast<std::uint8_t>(tokens[j] >> (8 * b)));
  }
  return xxh3_128_hex(buf);
}

// Known-answer vectors: the same values as tests/unit/test_keys.py. Keys are
// stable across processes, releases and machines; a change here is a format change.
static void test_key_vectors() {
  std::uint8_t out[16];
  // Published XXH3-128 vectors (xxHash's sanity tests, canonical form).
  ucm::digest128("", 0, out);
  CHECK(hex(out, 16) == "99aa06d3014798d86001c324468d497f");
  ucm::digest128("abc", 3, out);
  CHECK(hex(out, 16) == "06b05ab6733a618578af5f94892f3950");
  CHECK(xxh3_128_hex({'a', 'b', 'c'}) == "06b05ab6733a618578af5f94892f3950");

  // A chain seeded from a digest: two full blocks of 4 and a partial one (not keyed).
  std::vector<std::uint8_t> seed(16);
  for (int i = 0; i < 16; ++i) seed[i] = static_cast<std::uint8_t>(i);
  const std::uint32_t tokens[] = {0, 1, 0xFFFFFFFFu, 42, 7, 7, 7, 7, 100000, 5};
  std::uint8_t keys[32];
  CHECK(ucm::chain_keys(seed.data(), tokens, 10, 4, keys) == 2);
  CHECK(hex(keys, 16) == "28f3cae8d82cef12f51f2eff5579f990");
  CHECK(hex(keys + 16, 16) == "27c93a501a256314d502a3393f855836");
  CHECK(block_key_hex(seed, tokens, 4) == hex(keys, 16));
  CHECK(block_key_hex(std::vector<std::uint8_t>(keys, keys + 16), tokens + 4, 4) == hex(keys + 16, 16));

  // Namespace(model="smollm2-135m", kv_dtype="bfloat16", num_layers=30,
  // num_kv_heads=3, head_size=64, block_tokens=256).canonical_bytes()
  // (DIGEST_VERSION 2, format in ucm/keys.py), its digest, and the keys of tokens 0..511.
  const std::vector<std::uint8_t> canon = unhex(
      "75636d2e6e616d657370616365020b056d6f64656c730c000000736d6f6c6c6d322d3133356d086b765f6474797065730800"
      "000062666c6f617431360a6e756d5f6c6179657273691e000000000000000c6e756d5f6b765f686561647369030000000000"
      "000009686561645f73697a656940000000000000000c626c6f636b5f746f6b656e736900010000000000000774705f72616e"
      "6b6900000000000000000774705f73697a65690100000000000000066c61796f757473000000000e6c61796f75745f766572"
      "73696f6e6901000000000000000473616c747300000000");
  CHECK(canon.size() == 223);
  std::uint8_t ns[16];
  ucm::digest128(canon.data(), canon.size(), ns);
  CHECK(hex(ns, 16) == "0ef30df10995485f95064255df088329");
  CHECK(xxh3_128_hex(canon) == hex(ns, 16));
  std::vector<std::uint32_t> seq(512);
  for (std::uint32_t i = 0; i < 512; ++i) seq[i] = i;
  CHECK(ucm::chain_keys(ns, seq.data(), seq.size(), 256, keys) == 2);
  CHECK(hex(keys, 16) == "bbf1185d8550a9e9a13ebefa2a3d543c");
  CHECK(hex(keys + 16, 16) == "20c680326eb9171d2fb25fc481000279");
  CHECK(block_key_hex(std::vector<std::uint8_t>(ns, ns + 16), seq.data(), 256) == hex(keys, 16));
  CHECK(block_key_hex(std::vector<std::uint8_t>(keys, keys + 16), seq.data() + 256, 256) == hex(keys + 16, 16));
}

static void test_copy() {
  const std::size_t n = (40u << 20) + 123;
  std::vector<char> src(n), dst(n, 0);
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<char>(i * 31);
  ucm::copy_bytes(dst.data(), src.data(), n, 4);
  CHECK(std::memcmp(dst.data(), src.data(), n) == 0);
  CHECK(ucm::checksum(src.data(), n) == ucm::checksum(dst.data(), n));
  dst[n / 2] ^= 1;
  CHECK(ucm::checksum(src.data(), n) != ucm::checksum(dst.data(), n));
}

static void test_chunk_checksums() {
  const std::size_t n = 3 * 4096 + 100;
  std::vector<std::uint8_t> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::uint8_t>(i * 13 + 1);
  CHECK(ucm::chunk_count(0, 4096) == 0);
  CHECK(ucm::chunk_count(4096, 4096) == 1);
  CHECK(ucm::chunk_count(n, 4096) == 4);
  std::vector<std::uint8_t> out(8 * 4, 0xee);
  CHECK(ucm::chunk_checksums(data.data(), n, 4096, out.data()) == 4);
  for (std::size_t i = 0; i < 4; ++i) {  // each piece's XXH3-64, little-endian; the last one is 100 bytes
    const std::size_t len = i < 3 ? 4096 : 100;
    std::uint64_t h = 0;
    for (int b = 7; b >= 0; --b) h = (h << 8) | out[8 * i + b];
    CHECK(h == ucm::checksum(data.data() + 4096 * i, len));
  }
  std::vector<std::uint8_t> again(8 * 4);
  data[2 * 4096 + 5] ^= 1;  // a flipped byte changes its own chunk's checksum only
  ucm::chunk_checksums(data.data(), n, 4096, again.data());
  CHECK(std::memcmp(out.data(), again.data(), 16) == 0);
  CHECK(std::memcmp(out.data() + 16, again.data() + 16, 8) != 0);
  CHECK(std::memcmp(out.data() + 24, again.data() + 24, 8) == 0);
  // one chunk covering everything is the whole buffer's checksum
  std::uint8_t one[8];
  CHECK(ucm::chunk_checksums(data.data(), n, n, one) == 1);
  std::uint64_t h = 0;
  for (int b = 7; b >= 0; --b) h = (h << 8) | one[b];
  CHECK(h == ucm::checksum(data.data(), n));
}

static void test_copy_spans() {
  // Scatter 64 spans of 1 MiB in reverse order over 4 threads, then gather back.
  const std::size_t len = 1u << 20, count = 64;
  std::vector<char> src(len * count), mid(len * count, 0), back(len * count, 0);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + i / len);
  std::vector<std::size_t> fwd(count), rev(count);
  for (std::size_t i = 0; i < count; ++i) {
    fwd[i] = i * len;
    rev[i] = (count - 1 - i) * len;
  }
  ucm::copy_spans(mid.data(), rev.data(), src.data(), fwd.data(), count, len, 4);
  CHECK(std::memcmp(mid.data(), src.data() + (count - 1) * len, len) == 0);
  CHECK(std::memcmp(mid.data() + (count - 1) * len, src.data(), len) == 0);
  ucm::copy_spans(back.data(), fwd.data(), mid.data(), rev.data(), count, len, 1);
  CHECK(back == src);
  // Streamed spans at every alignment of source and destination, with a
  // length that is no multiple of the 64-byte store group: exact bytes,
  // nothing written outside the spans.
  const std::size_t slen = (256u << 10) + 37;
  std::vector<char> s2(slen + 64), d2(slen + 128);
  for (std::size_t i = 0; i < s2.size(); ++i) s2[i] = static_cast<char>(i * 13 + 5);
  for (std::size_t so = 0; so < 17; so += 3) {
    for (std::size_t dof = 0; dof < 33; dof += 5) {
      std::fill(d2.begin(), d2.end(), static_cast<char>(0x5a));
      const std::size_t o1 = dof + 8, o2 = so;
      ucm::copy_spans(d2.data(), &o1, s2.data(), &o2, 1, slen, 1);
      CHECK(std::memcmp(d2.data() + o1, s2.data() + o2, slen) == 0);
      CHECK(d2[o1 - 1] == static_cast<char>(0x5a) && d2[o1 + slen] == static_cast<char>(0x5a));
    }
  }
}

static void test_index() {
  // Random inserts and removes against std::set, in a table kept small so
  // that clusters wrap around and backward-shift deletion is exercised.
  const std::uint64_t slots = 64;
  std::vector<char> mem(ucm::index_bytes(slots));
  ucm::index_init(mem.data(), slots);
  CHECK(ucm::index_slots(mem.data(), mem.size()) == slots);
  CHECK(ucm::index_slots(mem.data(), mem.size() - 1) == 0);
  std::vector<std::array<std::uint8_t, 16>> keys(80);
  std::uint64_t x = 12345;
  for (auto& k : keys) {
    for (auto& b : k) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      b = static_cast<std::uint8_t>(x >> 56);
    }
  }
  std::set<std::size_t> present;
  for (int step = 0; step < 20000; ++step) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const std::size_t i = (x >> 33) % keys.size();
    if ((x >> 20) & 1) {
      const bool ok = ucm::index_insert(mem.data(), keys[i].data());
      if (ok) present.insert(i);
      CHECK(ok || present.size() + 1 > slots / 4 * 3);
      if (!ok) ucm::index_init(mem.data(), slots), present.clear();  // full: start over
    } else {
      CHECK(ucm::index_remove(mem.data(), keys[i].data()) == (present.erase(i) == 1));
    }
    CHECK(ucm::index_count(mem.data()) == present.size());
    for (std::size_t j = 0; j < keys.size(); ++j) {
      CHECK((ucm::index_prefix(mem.data(), keys[j].data(), 1) == 1) == (present.count(j) == 1));
    }
  }
  // Prefix: stops at the first absent key; an overfull insert marks the index incomplete.
  ucm::index_init(mem.data(), slots);
  std::vector<std::uint8_t> run;
  for (int j = 0; j < 5; ++j) run.insert(run.end(), keys[j].begin(), keys[j].end());
  for (int j : {0, 1, 2, 4}) CHECK(ucm::index_insert(mem.data(), keys[j].data()));
  CHECK(ucm::index_prefix(mem.data(), run.data(), 5) == 3);
  const std::vector<std::uint8_t> zero(16, 0);  // the empty marker is never found (it matched an empty slot)
  CHECK(ucm::index_prefix(mem.data(), zero.data(), 1) == 0);
  for (std::size_t j = 5; j < keys.size(); ++j) ucm::index_insert(mem.data(), keys[j].data());
  CHECK(ucm::index_prefix(mem.data(), run.data(), 5) == -1);
}

static void test_io_engine() {
  char path[] = "/tmp/ucm_io_testXXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  ucm::IoEngine io(4);
  const std::size_t chunk = 1 << 16;
  std::vector<std::vector<char>> bufs(16, std::vector<char>(chunk));
  std::vector<ucm::IoRequest> reqs;
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    std::memset(bufs[i].data(), static_cast<int>(i + 1), chunk);
    reqs.push_back({bufs[i].data(), chunk, static_cast<std::int64_t>(i * chunk)});
  }
  for (auto r : io.write_batch(fd, reqs)) CHECK(r == static_cast<std::int64_t>(chunk));
  std::vector<std::vector<char>> back(16, std::vector<char>(chunk));
  std::vector<ucm::IoRequest> rreqs;
  for (std::size_t i = 0; i < back.size(); ++i)
    rreqs.push_back({back[i].data(), chunk, static_cast<std::int64_t>(i * chunk)});
  for (auto r : io.read_batch(fd, rreqs)) CHECK(r == static_cast<std::int64_t>(chunk));
  CHECK(back == bufs);
  // Reading past the end gives a short count, a bad fd gives -EBADF.
  std::vector<char> tail(chunk);
  auto res = io.read_batch(fd, {{tail.data(), chunk, static_cast<std::int64_t>(16 * chunk - 10)}});
  CHECK(res[0] == 10);
  res = io.read_batch(-1, {{tail.data(), chunk, 0}});
  CHECK(res[0] < 0);
  close(fd);
  unlink(path);
}

static void test_kv_quant() {
  // Half-precision conversions: golden bit patterns.
  const std::pair<float, std::uint16_t> golden[] = {{0.0f, 0x0000}, {1.0f, 0x3C00}, {-2.0f, 0xC000},
                                                     {65504.0f, 0x7BFF}, {6.103515625e-05f, 0x0400},
                                                     {5.9604644775390625e-08f, 0x0001}, {1e6f, 0x7C00},
                                                     {0.333251953125f, 0x3555}, {1.00048828125f, 0x3C00}};
  for (auto [f, h] : golden) {
    CHECK(ucm::kv_f32_to_f16(f) == h);
    if (h != 0x7C00 && f != 1.00048828125f) CHECK(ucm::kv_f16_to_f32(h) == f);
  }
  // int8 and int4 of a ramp with a spike: every element within half its tile's step, the spike exact.
  const std::int64_t R = 64, D = 64;
  std::vector<float> x(R * D);
  for (std::int64_t i = 0; i < R * D; ++i) x[i] = std::sin(0.01f * static_cast<float>(i)) * (1 + i % D);
  x[77] = 5000.0f;
  std::vector<std::int64_t> rows(R);
  for (std::int64_t r = 0; r < R; ++r) rows[r] = r * D * 4;
  for (int bits : {8, 4}) {
    ucm::KvSegment s{R, D, bits == 8 ? R : 32, 1, bits, bits == 8 ? 0 : 4};
    std::vector<std::uint8_t> enc(ucm::kv_encoded_bytes(s, ucm::KvElem::F32));
    CHECK(ucm::kv_encode(reinterpret_cast<const std::uint8_t*>(x.data()), rows.data(), s, ucm::KvElem::F32,
                         enc.data()));
    std::vector<float> y(R * D), steps(R / s.tile_rows * D);
    CHECK(ucm::kv_decode(enc.data(), s, ucm::KvElem::F32, reinterpret_cast<std::uint8_t*>(y.data()), rows.data()));
    ucm::kv_tile_steps(enc.data(), s, ucm::KvElem::F32, steps.data());
    for (std::int64_t i = 0; i < R * D; ++i) {
      float bound = steps[(i / D) / s.tile_rows * D + i % D] / 2 * 1.0001f;
      CHECK(std::fabs(x[i] - y[i]) <= bound || (bits == 4 && x[i] == y[i]));
    }
    if (bits == 4) CHECK(y[77] == 5000.0f);
    // An outlier index out of range is refused by decode.
    if (bits == 4) {
      std::size_t idx_at = 4 + 2 * static_cast<std::size_t>(R / 32 * D);
      std::memset(enc.data() + idx_at, 0xFF, 4);  // an outlier index past the segment
      CHECK(!ucm::kv_decode(enc.data(), s, ucm::KvElem::F32, reinterpret_cast<std::uint8_t*>(y.data()), rows.data()));
    }
  }
  // Paired widths (keys): the same bound per tile at every width, the size
  // of bits 4 plus a nibble per pair, and widths that do not sum to 4 per
  // tile are refused. Pair 0 carries the energy (it gets the most bits).
  for (std::int64_t outliers : {0, 4}) {
    std::vector<float> k(x);
    for (std::int64_t r = 0; r < R; ++r) k[r * D] = k[r * D + D / 2] = 10000.0f + 100.0f * static_cast<float>(r);
    ucm::KvSegment s{R, D, 32, 1, 4, outliers, true};
    ucm::KvSegment plain{R, D, 32, 1, 4, outliers};
    std::size_t n_tiles = static_cast<std::size_t>(R / 32 * D);
    CHECK(ucm::kv_encoded_bytes(s, ucm::KvElem::F32) == ucm::kv_encoded_bytes(plain, ucm::KvElem::F32) + n_tiles / 4);
    std::vector<std::uint8_t> enc(ucm::kv_encoded_bytes(s, ucm::KvElem::F32));
    CHECK(ucm::kv_encode(reinterpret_cast<const std::uint8_t*>(k.data()), rows.data(), s, ucm::KvElem::F32,
                         enc.data()));
    std::vector<float> y(R * D), steps(n_tiles);
    CHECK(ucm::kv_decode(enc.data(), s, ucm::KvElem::F32, reinterpret_cast<std::uint8_t*>(y.data()), rows.data()));
    ucm::kv_tile_steps(enc.data(), s, ucm::KvElem::F32, steps.data());
    for (std::int64_t i = 0; i < R * D; ++i) {
      float bound = steps[(i / D) / 32 * D + i % D] / 2 * 1.0001f;
      CHECK(std::fabs(k[i] - y[i]) <= bound || k[i] == y[i]);
    }
    const std::size_t widths_at = 4 + 2 * n_tiles;
    int w0 = (enc[widths_at] & 0x0F) + 1;
    CHECK(w0 == 8);
    enc[widths_at] = static_cast<std::uint8_t>((enc[widths_at] & 0xF0) | 0x06);  // 7 bits: the sum is off
    CHECK(!ucm::kv_decode(enc.data(), s, ucm::KvElem::F32, reinterpret_cast<std::uint8_t*>(y.data()), rows.data()));
    enc[widths_at] = static_cast<std::uint8_t>((enc[widths_at] & 0xF0) | 0x08);  // 9 bits: no such width
    CHECK(!ucm::kv_decode(enc.data(), s, ucm::KvElem::F32, reinterpret_cast<std::uint8_t*>(y.data()), rows.data()));
  }
}

int main() {
  test_kv_quant();
  test_chain_keys();
  test_key_vectors();
  test_copy();
  test_chunk_checksums();
  test_copy_spans();
  test_index();
  test_io_engine();
  return finish("native core");
}
