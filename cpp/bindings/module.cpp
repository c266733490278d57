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
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ucm/copy.hpp"
#include "ucm/hash.hpp"
#include "ucm/index.hpp"
#include "ucm/io_engine.hpp"
#include "ucm/placement.hpp"
#include "ucm/reuse_model.hpp"

namespace py = pybind11;

void bind_kv_quant(py::module_& m);  // kv_quant.cpp

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

// A PlacementCore and the Python types its plans are made of (ucm.placement.engine.Step
// and the four ucm.placement.engine.Op members, in StepOp order). Keys cross as
// bytes, converted by the core's KeyCodec.
struct PlacementHandle {
  std::unique_ptr<ucm::PlacementCore> core;
  py::object step_type;
  py::object ops[4];

  ucm::BlockKey key(py::handle obj) const {
    char* data;
    py::ssize_t len;
    if (!PyBytes_Check(obj.ptr())) throw ArgumentError("keys must be bytes");
    if (PyBytes_AsStringAndSize(obj.ptr(), &data, &len) != 0) throw py::error_already_set();
    return core->codec().encode(data, static_cast<std::size_t>(len));
  }

  std::optional<ucm::BlockKey> opt_key(py::handle obj) const {
    if (obj.is_none()) return std::nullopt;
    return key(obj);
  }

  std::vector<ucm::BlockKey> keys(py::handle seq) const {
    PyObject* fast = PySequence_Fast(seq.ptr(), "keys must be a sequence of bytes");
    if (fast == nullptr) throw py::error_already_set();
    py::object hold = py::reinterpret_steal<py::object>(fast);
    const py::ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject** items = PySequence_Fast_ITEMS(fast);
    std::vector<ucm::BlockKey> out;
    out.reserve(static_cast<std::size_t>(n));
    for (py::ssize_t i = 0; i < n; ++i) out.push_back(key(items[i]));
    return out;
  }

  py::bytes bytes(const ucm::BlockKey& k) const { return py::bytes(core->codec().decode(k)); }

  py::object bytes_or_none(const ucm::BlockKey* k) const { return k ? py::object(bytes(*k)) : py::object(py::none()); }

  py::list bytes_list(const std::vector<ucm::BlockKey>& ks) const {
    py::list out(ks.size());
    for (std::size_t i = 0; i < ks.size(); ++i) {
      PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i), bytes(ks[i]).release().ptr());
    }
    return out;
  }

  // The plan as a list of Steps. Step is a tuple subclass without slots of
  // its own, allocated here as tuple.__new__ would and filled in place. Each
  // is then untracked by the cycle collector: it holds an Op member, bytes
  // and ints only, so it can never be part of a cycle, and a run's
  // thousands of Steps, alive until the caller drops the plan, would
  // otherwise drive collections of the whole heap.
  py::list plan_of(const ucm::PlanSteps& steps) const {
    py::list out(steps.size());
    auto* type = reinterpret_cast<PyTypeObject*>(step_type.ptr());
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const ucm::PlanStep& s = steps[i];
      py::object key = bytes(s.key);
      py::object src = s.src < 0 ? py::object(py::none()) : py::object(py::int_(s.src));
      py::object dst = s.dst < 0 ? py::object(py::none()) : py::object(py::int_(s.dst));
      PyObject* step = type->tp_alloc(type, 4);
      if (step == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(step, 0, ops[static_cast<int>(s.op)].inc_ref().ptr());
      PyTuple_SET_ITEM(step, 1, key.release().ptr());
      PyTuple_SET_ITEM(step, 2, src.release().ptr());
      PyTuple_SET_ITEM(step, 3, dst.release().ptr());
      PyObject_GC_UnTrack(step);
      PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i), step);
    }
    return out;
  }
};

const ucm::BlockKey* opt(const std::optional<ucm::BlockKey>& key) { return key ? &*key : nullptr; }

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

  // ---- the heat policy's tables (ucm/reuse_model.hpp; used by ucm/placement/policies/reuse.py) ----
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

  // ---- placement core (see ucm/placement.hpp; the Python facade is ucm/placement/native.py) ----
  m.def(
      "placement_policies",
      []() { return ucm::native_policy_names(); },
      "Names of the policies the placement core implements.");
  py::class_<PlacementHandle>(m, "PlacementCore")
      .def(py::init([](const std::vector<std::pair<std::string, std::int64_t>>& tiers, const std::string& policy,
                       std::size_t history_blocks, int landing, py::object step_type, const std::vector<py::object>& ops) {
             if (ucm::policy_maker(policy) == nullptr) throw ArgumentError("no native placement policy " + policy);
             if (ops.size() != 4) throw ArgumentError("ops must name the 4 step kinds, got " + std::to_string(ops.size()));
             std::vector<ucm::TierSetup> setup;
             for (const auto& [name, cap] : tiers) setup.push_back({name, cap});
             auto* type = reinterpret_cast<PyTypeObject*>(step_type.ptr());
             if (!PyType_Check(step_type.ptr()) || !PyType_IsSubtype(type, &PyTuple_Type) ||
                 type->tp_basicsize != PyTuple_Type.tp_basicsize) {
               throw ArgumentError("step_type must be a tuple subclass without slots (ucm.placement.engine.Step)");
             }
             auto h = std::make_unique<PlacementHandle>();
             h->core = std::make_unique<ucm::PlacementCore>(setup, policy, history_blocks, landing);
             h->step_type = std::move(step_type);
             for (int i = 0; i < 4; ++i) h->ops[i] = ops[static_cast<std::size_t>(i)];
             return h;
           }),
           py::arg("tiers"), py::arg("policy"), py::arg("history_blocks"), py::arg("landing"), py::arg("step_type"),
           py::arg("ops"))
      .def("capacity_bytes", [](const PlacementHandle& h, int t) { return h.core->capacity_bytes(t); },
           py::arg("t"))
      .def("used_bytes", [](const PlacementHandle& h, int t) { return h.core->used_bytes(t); }, py::arg("t"))
      .def("blocks", [](const PlacementHandle& h, int t) { return h.core->blocks(t); }, py::arg("t"))
      .def(
          "counters",
          [](const PlacementHandle& h, int t) {
            ucm::TierCounts c = h.core->counters(t);
            return py::make_tuple(c.inserts, c.hits, c.evictions, c.demotions_in, c.promotions_in, c.bytes_written);
          },
          py::arg("t"), "(inserts, hits, evictions, demotions_in, promotions_in, bytes_written) of tier t.")
      .def("contains", [](const PlacementHandle& h, py::handle key) { return h.core->contains(h.key(key)); },
           py::arg("key"))
      .def("tiers_of", [](const PlacementHandle& h, py::handle key) { return h.core->tiers_of(h.key(key)); },
           py::arg("key"))
      .def(
          "where",
          [](const PlacementHandle& h, py::handle key) {
            int t = h.core->where(h.key(key));
            return t < 0 ? py::object(py::none()) : py::object(py::int_(t));
          },
          py::arg("key"))
      .def("lookup", [](const PlacementHandle& h, py::handle keys) { return h.core->lookup(h.keys(keys)); },
           py::arg("keys"))
      .def(
          "locate",
          [](const PlacementHandle& h, py::handle keys) {
            std::vector<int> at = h.core->locate(h.keys(keys));
            py::list out(at.size());
            for (std::size_t i = 0; i < at.size(); ++i) {
              py::object v = at[i] < 0 ? py::object(py::none()) : py::object(py::int_(at[i]));
              PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i), v.release().ptr());
            }
            return out;
          },
          py::arg("keys"))
      .def(
          "size_of",
          [](const PlacementHandle& h, py::handle key) {
            std::int64_t n = h.core->size_of(h.key(key));
            return n < 0 ? py::object(py::none()) : py::object(py::int_(n));
          },
          py::arg("key"))
      .def("parent_of", [](const PlacementHandle& h, py::handle key) { return h.bytes_or_none(h.core->parent_of(h.key(key))); },
           py::arg("key"))
      .def("resident_keys", [](const PlacementHandle& h, int t) { return h.bytes_list(h.core->resident_keys(t)); },
           py::arg("t"))
      .def("cached_keys", [](const PlacementHandle& h) { return h.bytes_list(h.core->cached_keys()); })
      .def("pin", [](PlacementHandle& h, py::handle keys) { h.core->pin(h.keys(keys)); }, py::arg("keys"))
      .def("unpin", [](PlacementHandle& h, py::handle keys) { h.core->unpin(h.keys(keys)); },
           py::arg("keys"))
      .def("hold", [](PlacementHandle& h, py::handle keys) { h.core->hold(h.keys(keys)); },
           py::arg("keys"))
      .def("unhold", [](PlacementHandle& h, py::handle keys) { h.core->unhold(h.keys(keys)); },
           py::arg("keys"))
      .def(
          "record_request",
          [](PlacementHandle& h, py::handle keys, py::handle parent, py::handle next_uses) {
            std::vector<ucm::BlockKey> ks = h.keys(keys);
            std::optional<ucm::BlockKey> p = h.opt_key(parent);
            std::optional<std::vector<double>> nus;
            if (!next_uses.is_none()) nus = next_uses.cast<std::vector<double>>();
            py::gil_scoped_release nogil;
            h.core->record_request(ks, opt(p), nus ? &*nus : nullptr);
          },
          py::arg("keys"), py::arg("parent"), py::arg("next_uses") = py::none(),
          "next_uses: one float per key (trace replay's oracle) or None.")
      .def(
          "finish_request",
          [](PlacementHandle& h, py::handle keys, std::int64_t output_tokens) {
            std::vector<ucm::BlockKey> ks = h.keys(keys);
            py::gil_scoped_release nogil;
            h.core->finish_request(ks, output_tokens);
          },
          py::arg("keys"), py::arg("output_tokens"))
      .def(
          "touch",
          [](PlacementHandle& h, py::handle keys) {
            std::vector<ucm::BlockKey> ks = h.keys(keys);
            py::gil_scoped_release nogil;
            h.core->touch(ks);
          },
          py::arg("keys"))
      .def(
          "insert",
          [](PlacementHandle& h, py::handle key, py::handle parent, std::int64_t size_bytes, int t, bool restored) {
            ucm::PlanSteps plan;
            std::optional<ucm::BlockKey> p = h.opt_key(parent);
            bool placed = h.core->insert(h.key(key), opt(p), size_bytes, t, restored, plan);
            return py::make_tuple(placed, h.plan_of(plan));
          },
          py::arg("key"), py::arg("parent"), py::arg("size_bytes"), py::arg("t"), py::arg("restored"),
          "(placed, plan).")
      .def(
          "insert_run",
          [](PlacementHandle& h, py::handle keys_obj, py::handle parent, const std::vector<std::int64_t>& sizes, int t) {
            std::vector<ucm::BlockKey> keys = h.keys(keys_obj);
            std::optional<ucm::BlockKey> p = h.opt_key(parent);
            ucm::PlanSteps plan;
            std::vector<bool> placed;
            std::size_t stop;
            {
              py::gil_scoped_release nogil;
              stop = h.core->insert_run(keys, opt(p), sizes, t, placed, plan);
            }
            py::list flags(placed.size());
            for (std::size_t i = 0; i < placed.size(); ++i) {
              PyList_SET_ITEM(flags.ptr(), static_cast<py::ssize_t>(i), py::bool_(placed[i]).release().ptr());
            }
            return py::make_tuple(flags, h.plan_of(plan), stop);
          },
          py::arg("keys"), py::arg("parent"), py::arg("sizes"), py::arg("t"), "(placed, plan, stop).")
      .def(
          "promote",
          [](PlacementHandle& h, py::handle key, bool force) {
            ucm::PlanSteps plan;
            bool placed = h.core->promote(h.key(key), force, plan);
            return py::make_tuple(placed, h.plan_of(plan));
          },
          py::arg("key"), py::arg("force"), "(placed, plan).")
      .def(
          "reclaim",
          [](PlacementHandle& h, int t, std::int64_t free_bytes, std::int64_t max_victims) {
            ucm::PlanSteps plan;
            h.core->reclaim(t, free_bytes, max_victims, plan);
            return h.plan_of(plan);
          },
          py::arg("t"), py::arg("free_bytes"), py::arg("max_victims"))
      .def(
          "may_evict",
          [](const PlacementHandle& h, int t, py::handle keys, py::handle protect, bool relaxed) {
            std::optional<ucm::BlockKey> p = h.opt_key(protect);
            return h.core->may_evict(t, h.keys(keys), opt(p), relaxed);
          },
          py::arg("t"), py::arg("keys"), py::arg("protect"), py::arg("relaxed"))
      .def(
          "evict_keys",
          [](PlacementHandle& h, int t, py::handle keys, bool any_one, py::handle protect, bool relaxed) {
            ucm::PlanSteps plan;
            std::optional<ucm::BlockKey> p = h.opt_key(protect);
            h.core->evict_keys(t, h.keys(keys), any_one, opt(p), relaxed, plan);
            return h.plan_of(plan);
          },
          py::arg("t"), py::arg("keys"), py::arg("any_one"), py::arg("protect"), py::arg("relaxed"))
      .def(
          "remove",
          [](PlacementHandle& h, py::handle key, int tier) {
            ucm::PlanSteps plan;
            h.core->remove(h.key(key), tier, plan);
            return h.plan_of(plan);
          },
          py::arg("key"), py::arg("tier"), "tier -1: every copy.")
      .def("watch_events", [](PlacementHandle& h, bool on) { h.core->watch_events(on); }, py::arg("on"))
      .def(
          "take_events",
          [](PlacementHandle& h) {
            auto events = h.core->take_events();
            py::list out(events.size());
            for (std::size_t i = 0; i < events.size(); ++i) {
              PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i),
                              py::make_tuple(events[i].first, h.bytes(events[i].second)).release().ptr());
            }
            return out;
          },
          "(linked, key) since the last call, in order.");
}
