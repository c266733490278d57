// Python bindings of the placement core (ucm/placement.hpp; the Python facade
// is ucm/placement/native.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pinned.hpp"
#include "ucm/placement.hpp"

namespace py = pybind11;
using ucm::bindings::ArgumentError;

namespace {

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

}  // namespace

void bind_placement(py::module_& m) {
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
