// Python bindings of the positional I/O threads (ucm/io_engine.hpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pinned.hpp"
#include "ucm/io_engine.hpp"

namespace py = pybind11;
using ucm::bindings::ArgumentError;
using ucm::bindings::pin;
using ucm::bindings::Pinned;

namespace {

// The buffers of a batch, pinned, and the requests that point into them.
struct PinnedBatch {
  std::vector<Pinned> pins;
  std::vector<ucm::IoRequest> reqs;
};

PinnedBatch requests_of(const std::vector<py::buffer>& bufs, const std::vector<std::int64_t>& offsets,
                        bool writable) {
  if (bufs.size() != offsets.size()) {
    throw ArgumentError("bufs and offsets differ in length: " + std::to_string(bufs.size()) +
                        " != " + std::to_string(offsets.size()));
  }
  PinnedBatch batch;
  batch.pins.reserve(bufs.size());
  batch.reqs.reserve(bufs.size());
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    if (offsets[i] < 0) {
      throw ArgumentError("offsets[" + std::to_string(i) + "] must be >= 0, got " + std::to_string(offsets[i]));
    }
    batch.pins.push_back(pin(bufs[i], writable, "buffer"));
    batch.reqs.push_back(ucm::IoRequest{batch.pins.back().ptr, batch.pins.back().len, offsets[i]});
  }
  return batch;
}

}  // namespace

void bind_io_engine(py::module_& m) {
  py::class_<ucm::IoEngine>(m, "IoEngine")
      .def(py::init<int>(), py::arg("threads"))
      .def_property_readonly("threads", &ucm::IoEngine::threads)
      .def(
          "read_batch",
          [](ucm::IoEngine& self, int fd, const std::vector<py::buffer>& bufs,
             const std::vector<std::int64_t>& offsets) {
            PinnedBatch batch = requests_of(bufs, offsets, true);
            py::gil_scoped_release nogil;
            return self.read_batch(fd, batch.reqs);
          },
          py::arg("fd"), py::arg("bufs"), py::arg("offsets"),
          "Reads into each buffer from its offset, all in flight; bytes read or -errno each.")
      .def(
          "write_batch",
          [](ucm::IoEngine& self, int fd, const std::vector<py::buffer>& bufs,
             const std::vector<std::int64_t>& offsets) {
            PinnedBatch batch = requests_of(bufs, offsets, false);
            py::gil_scoped_release nogil;
            return self.write_batch(fd, batch.reqs);
          },
          py::arg("fd"), py::arg("bufs"), py::arg("offsets"),
          "Writes each buffer at its offset, all in flight; bytes written or -errno each.");
}
