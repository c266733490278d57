// Python bindings of block keys and checksums (ucm/hash.hpp).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "pinned.hpp"
#include "ucm/hash.hpp"

namespace py = pybind11;
using ucm::bindings::ArgumentError;
using ucm::bindings::pin;
using ucm::bindings::Pinned;

void bind_hash(py::module_& m) {
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
      "chunk_checksums",
      [](const py::buffer& data, std::size_t chunk_bytes) {
        if (chunk_bytes == 0) throw ArgumentError("chunk_bytes must be > 0");
        Pinned s = pin(data, false, "data");
        std::string out(8 * ucm::chunk_count(s.len, chunk_bytes), '\0');
        {
          py::gil_scoped_release nogil;
          ucm::chunk_checksums(s.ptr, s.len, chunk_bytes, reinterpret_cast<std::uint8_t*>(out.data()));
        }
        return py::bytes(out);
      },
      py::arg("data"), py::arg("chunk_bytes"),
      "XXH3-64 of each chunk_bytes piece of a buffer (the last one may be shorter), as little-endian "
      "uint64s concatenated.");
}
