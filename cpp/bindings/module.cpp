// Python bindings for ucm._native: converts arguments, releases the GIL for
// the blocking part, and translates errors. No logic lives here. One file
// binds each core header (hash.cpp binds ucm/hash.hpp, ...); this one makes
// the module, registers the error translator and calls each in turn. The
// buffer pins they share are in pinned.hpp.
#include <pybind11/pybind11.h>

#include <exception>
#include <stdexcept>

#include "pinned.hpp"
#include "ucm/hash.hpp"

namespace py = pybind11;

void bind_kv_quant(py::module_& m);     // kv_quant.cpp
void bind_hash(py::module_& m);         // hash.cpp
void bind_copy(py::module_& m);         // copy.cpp
void bind_index(py::module_& m);        // index.cpp
void bind_io_engine(py::module_& m);    // io_engine.cpp
void bind_reuse_model(py::module_& m);  // reuse_model.cpp
void bind_placement(py::module_& m);    // placement.cpp

namespace {

using ucm::bindings::ArgumentError;

// ucm.errors.ArgumentError, looked up at import and kept for the life of the process.
PyObject* argument_error_type = nullptr;

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "ucm native core: block keys, checksums, copies, positional I/O threads";
  m.attr("KEY_BYTES") = ucm::kKeyBytes;
  bind_kv_quant(m);

  argument_error_type = py::object(py::module_::import("ucm.errors").attr("ArgumentError")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ArgumentError& e) {
      PyErr_SetString(argument_error_type, e.what());
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(argument_error_type, e.what());
    }
  });

  bind_hash(m);
  bind_copy(m);
  bind_index(m);
  bind_io_engine(m);
  bind_reuse_model(m);
  bind_placement(m);
}
