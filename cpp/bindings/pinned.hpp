// What every binding file shares: the buffer pins and the error a bad
// argument raises. Python headers stay in cpp/bindings/.
//
// Every buffer is pinned (its py::buffer_info export held) for as long as its
// pointer is used: a Pinned is declared before the py::gil_scoped_release of
// the call, so the GIL is taken back before the export is released
// (PyBuffer_Release needs the GIL) and no other thread can resize or free the
// memory while the core works on it. Misuse raises ucm.errors.ArgumentError
// (the translator is registered in module.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace ucm::bindings {

namespace py = pybind11;

// Thrown for a bad argument; translated to ucm.errors.ArgumentError.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A buffer export and the bytes it covers; the export lives as long as this.
struct Pinned {
  py::buffer_info info;
  void* ptr = nullptr;
  std::size_t len = 0;
};

// Every buffer must be C-contiguous; nothing is copied behind the caller's back.
inline Pinned pin(const py::buffer& obj, bool writable, const char* name) {
  Pinned p{obj.request(writable)};
  std::size_t expect = static_cast<std::size_t>(p.info.itemsize);
  for (auto i = p.info.ndim; i-- > 0;) {
    if (p.info.strides[i] != static_cast<py::ssize_t>(expect)) {
      throw ArgumentError(std::string(name) + " must be a C-contiguous buffer");
    }
    expect *= static_cast<std::size_t>(p.info.shape[i]);
  }
  p.ptr = p.info.ptr;
  p.len = static_cast<std::size_t>(p.info.size) * static_cast<std::size_t>(p.info.itemsize);
  return p;
}

}  // namespace ucm::bindings
