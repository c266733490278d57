// Python bindings for ucm._native: converts arguments, releases the GIL for
// the blocking part, and translates errors. No logic lives here.
//
// Every buffer is pinned (its py::buffer_info export held) for as long as its
// pointer is used: a Pinned is declared before the py::gil_scoped_release of
// the call, so the GIL is taken back before the export is released
// (PyBuffer_Release needs the GIL) and no other thread can resize or free the
// memory while the core works on it. Misuse raises ucm.errors.ArgumentError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ucm/copy.hpp"
#include "ucm/hash.hpp"
#include "ucm/index.hpp"
#include "ucm/io_engine.hpp"

namespace py = pybind11;

namespace {

// Thrown for a bad argument; translated to ucm.errors.ArgumentError.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// ucm.errors.ArgumentError, looked up at import and kept for the life of the process.
PyObject* argument_error_type = nullptr;

// A buffer export and the bytes it covers; the export lives as long as this.
struct Pinned {
  py::buffer_info info;
  void* ptr = nullptr;
  std::size_t len = 0;
};

// Every buffer must be C-contiguous; nothing is copied behind the caller's back.
Pinned pin(const py::buffer& obj, bool writable, const char* name) {
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

PYBIND11_MODULE(_native, m) {
  m.doc() = "ucm native core: block keys, checksums, copies, positional I/O threads";
  m.attr("KEY_BYTES") = ucm::kKeyBytes;

  argument_error_type = py::object(py::module_::import("ucm.errors").attr("ArgumentError")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ArgumentError& e) {
      PyErr_SetString(argument_error_type, e.what());
    }
  });

  m.def(
      "digest128",
      [](const py::buffer& data) {
        Pinned s = pin(data, false, "data");
        std::uint8_t out[ucm::kKeyBytes];
        ucm::digest128(s.ptr, s.len, out);
        return py::bytes(reinterpret_cast<const char*>(out), ucm::kKeyBytes);
      },
      py::arg("data"), "128-bit XXH3 digest of a buffer (16 bytes, canonical order).");

  m.def(
      "chain_keys",
      [](const py::bytes& seed, const py::buffer& tokens, std::size_t block_tokens) {
        std::string seed_s = seed;
        if (seed_s.size() != ucm::kKeyBytes) {
          throw ArgumentError("seed must be 16 bytes, got " + std::to_string(seed_s.size()));
        }
        if (block_tokens == 0) throw ArgumentError("block_tokens must be > 0");
        py::buffer_info info = tokens.request();
        if (info.itemsize != 4 || (info.format != "I" && info.format != "=I" && info.format != "<I" &&
                                   info.format != "L" && info.format != "<L" && info.format != "=L")) {
          throw ArgumentError("tokens must be a buffer of uint32, got format '" + info.format + "'");
        }
        if (info.ndim != 1 || info.strides[0] != 4) throw ArgumentError("tokens must be 1-D contiguous");
        const std::size_t n_tokens = static_cast<std::size_t>(info.shape[0]);
        const std::size_t n_blocks = n_tokens / block_tokens;
        std::string out(n_blocks * ucm::kKeyBytes, '\0');
        {
          py::gil_scoped_release nogil;
          ucm::chain_keys(reinterpret_cast<const std::uint8_t*>(seed_s.data()),
                          static_cast<const std::uint32_t*>(info.ptr), n_tokens, block_tokens,
                          reinterpret_cast<std::uint8_t*>(out.data()));
        }
        return py::bytes(out);
      },
      py::arg("seed"), py::arg("tokens"), py::arg("block_tokens"),
      "Chained 16-byte keys of the full blocks of `tokens`, concatenated.");

  m.def(
      "checksum",
      [](const py::buffer& data) {
        Pinned s = pin(data, false, "data");
        py::gil_scoped_release nogil;
        return ucm::checksum(s.ptr, s.len);
      },
      py::arg("data"), "XXH3-64 checksum of a buffer.");

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

  // ---- shared-memory key index (see ucm/index.hpp) ----
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

  m.def(
      "prefault",
      [](const py::buffer& buf) {
        Pinned s = pin(buf, true, "buf");
        py::gil_scoped_release nogil;
        ucm::prefault(s.ptr, s.len);
      },
      py::arg("buf"), "Touches every page of a writable buffer.");

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
