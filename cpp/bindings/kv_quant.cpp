// Python bindings of the KV quantisation kernels (ucm/kv_quant.hpp): argument
// checks and conversions only; the GIL is released while the kernels run,
// with every buffer export held (see pinned.hpp).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ucm/kv_quant.hpp"

namespace py = pybind11;

namespace {

struct View {
  py::buffer_info info;
  std::uint8_t* ptr;
  std::size_t len;
};

View view_of(const py::buffer& b, bool writable, const char* name) {
  py::buffer_info info = b.request(writable);
  std::size_t expect = static_cast<std::size_t>(info.itemsize);
  for (auto i = info.ndim; i-- > 0;) {
    if (info.strides[i] != static_cast<py::ssize_t>(expect)) {
      throw std::invalid_argument(std::string(name) + " must be a C-contiguous buffer");
    }
    expect *= static_cast<std::size_t>(info.shape[i]);
  }
  auto* p = static_cast<std::uint8_t*>(info.ptr);
  std::size_t n = static_cast<std::size_t>(info.size) * static_cast<std::size_t>(info.itemsize);
  return View{std::move(info), p, n};
}

ucm::KvElem elem_of(int e) {
  if (e < 0 || e > 2) throw std::invalid_argument("elem must be 0 (float32), 1 (float16) or 2 (bfloat16), got " +
                                                  std::to_string(e));
  return static_cast<ucm::KvElem>(e);
}

constexpr int kCols = 9;  // rows, cols, tile_rows, tile_cols, bits, outliers, row_start, enc_offset, paired

// The segment table, checked against the row table, the raw and the encoded buffer.
std::vector<ucm::KvSegmentAt> segments_of(const View& table, const View& rows, std::size_t raw_len,
                                          std::size_t enc_len, ucm::KvElem e) {
  if (table.len % (8 * kCols)) throw std::invalid_argument("segments must be an int64 array of 9 columns");
  if (rows.len % 8) throw std::invalid_argument("row_offsets must be an int64 array");
  const auto* t = reinterpret_cast<const std::int64_t*>(table.ptr);
  const auto* ro = reinterpret_cast<const std::int64_t*>(rows.ptr);
  const std::int64_t n_rows = static_cast<std::int64_t>(rows.len / 8);
  std::vector<ucm::KvSegmentAt> out(table.len / (8 * kCols));
  for (std::size_t i = 0; i < out.size(); ++i, t += kCols) {
    ucm::KvSegmentAt& g = out[i];
    g.seg = ucm::KvSegment{t[0], t[1], t[2], t[3], static_cast<int>(t[4]), t[5], t[8] != 0};
    std::size_t size = ucm::kv_encoded_bytes(g.seg, e);  // throws for a bad spec
    if (t[6] < 0 || t[6] + g.seg.rows > n_rows) throw std::invalid_argument("segment rows beyond row_offsets");
    if (t[7] < 0 || static_cast<std::size_t>(t[7]) + size > enc_len)
      throw std::invalid_argument("segment " + std::to_string(i) + " beyond the encoded buffer");
    g.row_start = t[6];
    g.enc_offset = static_cast<std::size_t>(t[7]);
    const std::int64_t row_bytes = g.seg.cols * static_cast<std::int64_t>(ucm::kv_elem_bytes(e));
    for (std::int64_t r = t[6]; r < t[6] + g.seg.rows; ++r) {
      if (ro[r] < 0 || static_cast<std::size_t>(ro[r] + row_bytes) > raw_len)
        throw std::invalid_argument("row offset " + std::to_string(ro[r]) + " beyond the raw buffer");
    }
  }
  return out;
}

}  // namespace

void bind_kv_quant(py::module_& m) {
  m.def(
      "kv_encoded_bytes",
      [](std::int64_t rows, std::int64_t cols, std::int64_t tile_rows, std::int64_t tile_cols, int bits,
         std::int64_t outliers, int elem, bool paired) {
        return ucm::kv_encoded_bytes(ucm::KvSegment{rows, cols, tile_rows, tile_cols, bits, outliers, paired},
                                     elem_of(elem));
      },
      py::arg("rows"), py::arg("cols"), py::arg("tile_rows"), py::arg("tile_cols"), py::arg("bits"),
      py::arg("outliers"), py::arg("elem"), py::arg("paired") = false,
      "Bytes of one encoded KV segment (format in kv_quant.hpp).");
  m.def(
      "kv_encode",
      [](const py::buffer& raw, const py::buffer& row_offsets, const py::buffer& segments, int elem,
         const py::buffer& out, int threads) {
        ucm::KvElem e = elem_of(elem);
        View r = view_of(raw, false, "raw"), ro = view_of(row_offsets, false, "row_offsets");
        View t = view_of(segments, false, "segments"), o = view_of(out, true, "out");
        auto segs = segments_of(t, ro, r.len, o.len, e);
        py::gil_scoped_release nogil;
        return ucm::kv_run_segments(true, r.ptr, nullptr, reinterpret_cast<const std::int64_t*>(ro.ptr), segs.data(),
                                    segs.size(), e, o.ptr, nullptr, threads);
      },
      py::arg("raw"), py::arg("row_offsets"), py::arg("segments"), py::arg("elem"), py::arg("out"),
      py::arg("threads") = 1,
      "Encodes the segments of one block (int64 table: rows, cols, tile_rows, tile_cols, bits, outliers, "
      "row_start, enc_offset, paired) into `out`; False if a segment holds non-finite values.");
  m.def(
      "kv_decode",
      [](const py::buffer& enc, const py::buffer& segments, int elem, const py::buffer& raw_out,
         const py::buffer& row_offsets, int threads) {
        ucm::KvElem e = elem_of(elem);
        View c = view_of(enc, false, "enc"), t = view_of(segments, false, "segments");
        View o = view_of(raw_out, true, "raw_out"), ro = view_of(row_offsets, false, "row_offsets");
        auto segs = segments_of(t, ro, o.len, c.len, e);
        py::gil_scoped_release nogil;
        return ucm::kv_run_segments(false, nullptr, o.ptr, reinterpret_cast<const std::int64_t*>(ro.ptr), segs.data(),
                                    segs.size(), e, nullptr, c.ptr, threads);
      },
      py::arg("enc"), py::arg("segments"), py::arg("elem"), py::arg("raw_out"), py::arg("row_offsets"),
      py::arg("threads") = 1, "Decodes the segments of one block into `raw_out`; False for inconsistent bytes.");
  m.def(
      "kv_tile_steps",
      [](const py::buffer& enc, std::size_t offset, std::int64_t rows, std::int64_t cols, std::int64_t tile_rows,
         std::int64_t tile_cols, int bits, std::int64_t outliers, int elem, bool paired) {
        ucm::KvElem e = elem_of(elem);
        ucm::KvSegment s{rows, cols, tile_rows, tile_cols, bits, outliers, paired};
        std::size_t size = ucm::kv_encoded_bytes(s, e);
        View c = view_of(enc, false, "enc");
        if (offset + size > c.len) throw std::invalid_argument("segment beyond the encoded buffer");
        std::string out(4 * static_cast<std::size_t>(rows / tile_rows * (cols / tile_cols)), '\0');
        ucm::kv_tile_steps(c.ptr + offset, s, e, reinterpret_cast<float*>(out.data()));
        return py::bytes(out);
      },
      py::arg("enc"), py::arg("offset"), py::arg("rows"), py::arg("cols"), py::arg("tile_rows"),
      py::arg("tile_cols"), py::arg("bits"), py::arg("outliers"), py::arg("elem"), py::arg("paired") = false,
      "The quantisation step of each tile of an encoded segment (float32s): the error bound is half of it.");
}
