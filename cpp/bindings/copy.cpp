// Python bindings of the bulk memory copies and prefaulting (ucm/copy.hpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "pinned.hpp"
#include "ucm/copy.hpp"

namespace py = pybind11;
using ucm::bindings::ArgumentError;
using ucm::bindings::pin;
using ucm::bindings::Pinned;

void bind_copy(py::module_& m) {
  m.def(
      "copy",
      [](const py::buffer& dst, const py::buffer& src, int threads) {
        Pinned d = pin(dst, true, "dst");
        Pinned s = pin(src, false, "src");
        if (d.len != s.len) {
          throw ArgumentError("dst and src differ in size: " + std::to_string(d.len) + " != " +
                                std::to_string(s.len));
        }
        py::gil_scoped_release nogil;
        ucm::copy_bytes(d.ptr, s.ptr, d.len, threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("threads") = 1,
      "Copies src into dst (equal sizes) with the GIL released.");

  m.def(
      "copy_spans",
      [](const py::buffer& dst, const std::vector<std::size_t>& dst_offsets, const py::buffer& src,
         const std::vector<std::size_t>& src_offsets, std::size_t length, int threads) {
        if (dst_offsets.size() != src_offsets.size()) {
          throw ArgumentError("dst_offsets and src_offsets differ in length: " +
                                std::to_string(dst_offsets.size()) + " != " + std::to_string(src_offsets.size()));
        }
        Pinned d = pin(dst, true, "dst");
        Pinned s = pin(src, false, "src");
        for (std::size_t i = 0; i < dst_offsets.size(); ++i) {
          if (dst_offsets[i] > d.len || length > d.len - dst_offsets[i]) {
            throw ArgumentError("dst_offsets[" + std::to_string(i) + "] = " + std::to_string(dst_offsets[i]) +
                                  " + length " + std::to_string(length) + " exceeds dst (" +
                                  std::to_string(d.len) + " bytes)");
          }
          if (src_offsets[i] > s.len || length > s.len - src_offsets[i]) {
            throw ArgumentError("src_offsets[" + std::to_string(i) + "] = " + std::to_string(src_offsets[i]) +
                                  " + length " + std::to_string(length) + " exceeds src (" +
                                  std::to_string(s.len) + " bytes)");
          }
        }
        py::gil_scoped_release nogil;
        ucm::copy_spans(static_cast<char*>(d.ptr), dst_offsets.data(), static_cast<const char*>(s.ptr),
                        src_offsets.data(), dst_offsets.size(), length, threads);
      },
      py::arg("dst"), py::arg("dst_offsets"), py::arg("src"), py::arg("src_offsets"), py::arg("length"),
      py::arg("threads") = 1,
      "For every i copies `length` bytes from src[src_offsets[i]:] to dst[dst_offsets[i]:] (bounds checked, "
      "GIL released).");

  m.def(
      "prefault",
      [](const py::buffer& buf) {
        Pinned s = pin(buf, true, "buf");
        py::gil_scoped_release nogil;
        ucm::prefault(s.ptr, s.len);
      },
      py::arg("buf"), "Touches every page of a writable buffer.");
}
