// Python bindings of the shared-memory key index (ucm/index.hpp).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "pinned.hpp"
#include "ucm/hash.hpp"
#include "ucm/index.hpp"

namespace py = pybind11;
using ucm::bindings::ArgumentError;
using ucm::bindings::pin;
using ucm::bindings::Pinned;

void bind_index(py::module_& m) {
  m.def("index_bytes", &ucm::index_bytes, py::arg("slots"), "Bytes a key index of `slots` entries needs.");
  m.def(
      "index_init",
      [](const py::buffer& buf, std::uint64_t slots) {
        if (slots < 8 || (slots & (slots - 1)) != 0) {
          throw ArgumentError("slots must be a power of two >= 8, got " + std::to_string(slots));
        }
        Pinned s = pin(buf, true, "buf");
        if (s.len < ucm::index_bytes(slots)) {
          throw ArgumentError("buffer of " + std::to_string(s.len) + " bytes is too small for " +
                                std::to_string(slots) + " slots");
        }
        ucm::index_init(s.ptr, slots);
      },
      py::arg("buf"), py::arg("slots"), "Formats a buffer as an empty key index.");
  auto checked = [](const Pinned& s) {
    if (ucm::index_slots(s.ptr, s.len) == 0) throw ArgumentError("buffer is not a ucm key index");
  };
  auto key_of = [](const py::bytes& key) {
    std::string k = key;
    if (k.size() != ucm::kKeyBytes) throw ArgumentError("keys must be 16 bytes, got " + std::to_string(k.size()));
    return k;
  };
  m.def(
      "index_insert",
      [checked, key_of](const py::buffer& buf, const py::bytes& key) {
        Pinned s = pin(buf, true, "buf");
        checked(s);
        std::string k = key_of(key);
        return ucm::index_insert(s.ptr, reinterpret_cast<const std::uint8_t*>(k.data()));
      },
      py::arg("buf"), py::arg("key"), "Adds a key (writer side); False when the index is too full.");
  m.def(
      "index_remove",
      [checked, key_of](const py::buffer& buf, const py::bytes& key) {
        Pinned s = pin(buf, true, "buf");
        checked(s);
        std::string k = key_of(key);
        return ucm::index_remove(s.ptr, reinterpret_cast<const std::uint8_t*>(k.data()));
      },
      py::arg("buf"), py::arg("key"), "Removes a key (writer side); False when it was absent.");
  m.def(
      "index_count",
      [checked](const py::buffer& buf) {
        Pinned s = pin(buf, false, "buf");
        checked(s);
        return ucm::index_count(s.ptr);
      },
      py::arg("buf"), "Keys in the index.");
  m.def(
      "index_prefix",
      [checked](const py::buffer& buf, const py::bytes& keys) {
        Pinned s = pin(buf, false, "buf");
        checked(s);
        char* data;
        py::ssize_t len;
        if (PyBytes_AsStringAndSize(keys.ptr(), &data, &len) != 0) throw py::error_already_set();
        if (len % static_cast<py::ssize_t>(ucm::kKeyBytes) != 0) {
          throw ArgumentError("keys must be a concatenation of 16-byte keys");
        }
        return ucm::index_prefix(s.ptr, reinterpret_cast<const std::uint8_t*>(data),
                                 static_cast<std::size_t>(len) / ucm::kKeyBytes);
      },
      py::arg("buf"), py::arg("keys"),
      "Leading keys (concatenated, 16 bytes each) present in the index; -1: ask the service.");
}
