// KV quantisation kernels for the codecs of the tiers below DRAM (int8, int4).
//
// A segment is one K or V tensor of one layer of a block, seen as R rows of
// D contiguous elements (one row = one token of one head, D = the channels);
// row r starts `row_offsets[r]` bytes into the block. Tiles of
// `tile_rows` x `tile_cols` elements share their quantisation parameters:
// keys per channel (tile_rows = tokens of a head or a group of them,
// tile_cols = 1), values per token (tile_rows = 1, tile_cols = D or a group
// of channels). Rows are grouped into tiles in the order given, so the
// caller lists the rows of one head consecutively.
//
// Encoded segment formats (little-endian, back to back; sizes in
// `encoded_bytes`, n_tiles = R / tile_rows * D / tile_cols):
//   bits 8 (symmetric):  n_tiles x fp16 scale s (rounded up, so |x| / s <= 127)
//                        || R * D x int8 q;             x' = q * s
//   bits 4 (asymmetric): f32 base || n_tiles x (u8 c, i8 z) || n_out x
//                        index (r * D + d, ascending; u16 where R * D <=
//                        65536, else u32) || n_out x raw element
//                        || R * D / 2 bytes of u4 q (element 2i in the low
//                        nibble);  s = base * 2^(-c/16), x' = (q + z) * s,
//                        outliers restored exactly. The encoder picks per
//                        tile the smallest code with s >= max((max - min)
//                        / 15, |min| / 127) and z = round(min / s), so all
//                        16 levels span the tile's range.
//   bits 4, `paired` (keys, tile_cols 1, tile_rows a multiple of 8, D
//   even): as bits 4, but each pair of tiles (c, c + D/2) of a row block
//   (one RoPE pair of channels, rotate_half convention) has its own width
//   w of 1..8 bits instead of 4: f32 base || n_tiles x (u8 c, i8 z)
//   || n_tiles / 2 nibbles of w - 1 (pair p = b * D/2 + c, c < D/2, low
//   nibble first) || outliers as above || per tile, in tile order,
//   tile_rows * w / 8 bytes of w-bit codes (code i at bit i * w, LSB
//   first). The widths of a segment sum to 4 per tile, so its size is that
//   of bits 4 plus the nibbles. The encoder gives the bits where a query
//   would feel their error: greedily, to the pair with the largest
//   (its keys' mean energy) x (the sum of its two tiles' squared ranges)
//   x 4^-w (the logit error q.dk of a RoPE pair scales with both its
//   query's and its key's energy, and queries are large where keys are).
//   x' = (q + z f) s with f = 2^(w-4) for w > 4 (then z = floor(min / (f
//   s)) and s >= max((max - min) / (2^w - 1/2 - f), |min| / (127 f)))
//   and f = 1 otherwise (z = round(min / s), s >= max((max - min) /
//   (2^w - 1), |min| / 127)).
// Reconstruction error per element is at most s / 2 (plus the rounding of
// x' to the element type); `outliers` elements per segment (those farthest
// from their tile's mean) are kept exact.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ucm {

enum class KvElem : int { F32 = 0, F16 = 1, BF16 = 2 };

struct KvSegment {
  std::int64_t rows = 0;       // R
  std::int64_t cols = 0;       // D (elements per row, contiguous)
  std::int64_t tile_rows = 1;  // divides R
  std::int64_t tile_cols = 1;  // divides D
  int bits = 8;                // 8 or 4
  std::int64_t outliers = 0;   // kept exact (bits 4 only)
  bool paired = false;         // bits 4: a width per RoPE pair of key tiles (above)
};

std::size_t kv_elem_bytes(KvElem e);

// Bytes of one outlier index of a 4-bit segment: 2 where it has at most
// 65536 elements, else 4.
std::size_t kv_outlier_index_bytes(const KvSegment& s);

// Bytes of one encoded segment; throws std::invalid_argument for a bad spec.
std::size_t kv_encoded_bytes(const KvSegment& s, KvElem e);

// Encodes the segment whose rows start at src + row_offsets[r] into `out`
// (kv_encoded_bytes(s, e) bytes). Non-finite inputs are refused (false).
bool kv_encode(const std::uint8_t* src, const std::int64_t* row_offsets, const KvSegment& s, KvElem e,
               std::uint8_t* out);

// Decodes `enc` (exactly kv_encoded_bytes bytes) into dst + row_offsets[r].
// Returns false for inconsistent bytes (an outlier index out of range or
// not ascending, a zero-point that cannot hold); dst may be partly written.
bool kv_decode(const std::uint8_t* enc, const KvSegment& s, KvElem e, std::uint8_t* dst,
               const std::int64_t* row_offsets);

// The quantisation step s of each tile (n_tiles floats, row-major over the
// tile grid) of an encoded segment: what the error bound is derived from.
void kv_tile_steps(const std::uint8_t* enc, const KvSegment& s, KvElem e, float* steps);

// One segment of a block: its spec, where its row offsets start in the
// block's table and where its encoded bytes lie.
struct KvSegmentAt {
  KvSegment seg;
  std::int64_t row_start = 0;
  std::size_t enc_offset = 0;
};

// Encodes (raw -> enc) or decodes (enc_in -> raw_out) `n` segments of one
// block on up to `threads` threads; false if any segment failed (specs are
// checked by the caller with kv_encoded_bytes first).
bool kv_run_segments(bool encode, const std::uint8_t* raw, std::uint8_t* raw_out, const std::int64_t* row_offsets,
                     const KvSegmentAt* segs, std::size_t n, KvElem e, std::uint8_t* enc, const std::uint8_t* enc_in,
                     int threads);

// Half-precision conversions (round to nearest even), exposed for tests.
std::uint16_t kv_f32_to_f16(float f);
float kv_f16_to_f32(std::uint16_t h);

}  // namespace ucm
