// Python bindings of the heat policy's tables (ucm/reuse_model.hpp; used by
// ucm/placement/policies/reuse.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "pinned.hpp"
#include "ucm/reuse_model.hpp"

namespace py = pybind11;
using ucm::bindings::ArgumentError;
using ucm::bindings::pin;
using ucm::bindings::Pinned;

namespace {

// A (classes x age buckets) table of float64 from a C-contiguous buffer.
std::vector<double> reuse_table(const py::buffer& obj, const char* name) {
  Pinned p = pin(obj, false, name);
  if (p.info.format != py::format_descriptor<double>::format() || p.info.size != ucm::reuse::kCells) {
    throw ArgumentError(std::string(name) + " must hold " + std::to_string(ucm::reuse::kCells) +
                        " float64 values (" + std::to_string(ucm::reuse::kClasses) + " classes x " +
                        std::to_string(ucm::reuse::kAgeBuckets) + " age buckets)");
  }
  const auto* d = static_cast<const double*>(p.ptr);
  return std::vector<double>(d, d + ucm::reuse::kCells);
}

std::vector<std::vector<double>> reuse_rows(const double* cells) {
  std::vector<std::vector<double>> out(ucm::reuse::kClasses);
  for (int c = 0; c < ucm::reuse::kClasses; ++c) {
    out[static_cast<std::size_t>(c)].assign(cells + c * ucm::reuse::kAgeBuckets, cells + (c + 1) * ucm::reuse::kAgeBuckets);
  }
  return out;
}

}  // namespace

void bind_reuse_model(py::module_& m) {
  m.def(
      "reuse_hazard",
      [](const py::buffer& events, const py::buffer& exposure) {
        std::vector<double> ev = reuse_table(events, "events"), ex = reuse_table(exposure, "exposure");
        std::vector<double> out(ucm::reuse::kCells);
        ucm::reuse_hazard(ev.data(), ex.data(), out.data());
        return reuse_rows(out.data());
      },
      py::arg("events"), py::arg("exposure"),
      "ReuseModel.hazard from reuses and exposure per (class, age bucket): rows of floats.");
  m.def(
      "reuse_density",
      [](const py::buffer& hazard, double horizon) {
        std::vector<double> lam = reuse_table(hazard, "hazard");
        std::vector<double> out(ucm::reuse::kCells);
        ucm::reuse_density(lam.data(), horizon, out.data());
        return reuse_rows(out.data());
      },
      py::arg("hazard"), py::arg("horizon"),
      "ReuseModel.density: hit density per (class, age bucket) over `horizon` ticks from the hazards.");
}
