// The native policy interface (the twin of ucm.placement.policies.base.PlacementPolicy),
// what a policy is built with, and the registry of native policies by name.
//
// A native policy makes exactly the decisions of its Python twin
// (tests/unit/test_placement_native.py compares every plan). To add one:
// a class derived from PolicyCore in its own cpp/src/policy_<name>.cpp, a
// maker `std::unique_ptr<PolicyCore> make_<name>_policy(const PolicyContext&)`
// declared below, and its row in the table in cpp/src/policies.cpp; then
// `native = "<name>"` on the Python class.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ucm/block_key.hpp"
#include "ucm/heat_mirror.hpp"

namespace ucm {

enum class AdmissionKind : std::uint8_t { kNew, kDemote, kPromote };

using KeyPred = std::function<bool(const BlockKey&)>;

class PolicyCore {
 public:
  virtual ~PolicyCore() = default;
  virtual void on_insert(const BlockKey& key, std::int64_t size_bytes) = 0;
  virtual void on_hit(const BlockKey& key) = 0;
  virtual void on_remove(const BlockKey& key) = 0;
  virtual bool victim(const KeyPred& evictable, BlockKey* out) = 0;
  // victim, where the core promises that `evictable` refuses every block
  // that has resident children in this tier (its first, strict call; the
  // relaxed fallback calls victim). A policy may skip such blocks unasked.
  virtual bool leaf_victim(const KeyPred& evictable, BlockKey* out) { return victim(evictable, out); }
  // `key`, resident here, now has some (`any`) / no longer has any resident
  // children in this tier: after on_insert of a block that enters with
  // some, after the on_insert of its first child and after the on_remove
  // of its last one.
  virtual void on_children(const BlockKey& /*key*/, bool /*any*/) {}
  virtual bool admit(const BlockKey&, AdmissionKind) { return true; }
  // The tracker's record of `key` changed without an access (its output kind).
  virtual void on_reclass(const BlockKey&) {}
  // `key` was read out of this tier by a promotion (its copy here stays);
  // nothing by default, lru counts it as a use (ucm/placement/policies/base.py).
  virtual void on_copied_up(const BlockKey&) {}
};

// What one tier's policy instance is built with (TierInfo and the tracker
// on the Python side). `heat` outlives the policy; a policy may subscribe
// a listener to it (one per core: find it first with heat.listener<T>()).
struct PolicyContext {
  HeatMirror& heat;
  const KeyCodec& codec;  // a long key's bytes (`codec.decode`)
  std::string tier_name;
  int tier_index;
  std::int64_t capacity_bytes;
  bool lowest;  // no tier below
};

using PolicyMaker = std::unique_ptr<PolicyCore> (*)(const PolicyContext&);

// The maker of the native policy `name`, or nullptr.
PolicyMaker policy_maker(const std::string& name);
// The names of the native policies, in table order.
std::vector<std::string> native_policy_names();

std::unique_ptr<PolicyCore> make_lru_policy(const PolicyContext& ctx);
std::unique_ptr<PolicyCore> make_fifo_policy(const PolicyContext& ctx);
std::unique_ptr<PolicyCore> make_lfu_policy(const PolicyContext& ctx);
std::unique_ptr<PolicyCore> make_arc_policy(const PolicyContext& ctx);
std::unique_ptr<PolicyCore> make_s3fifo_policy(const PolicyContext& ctx);
std::unique_ptr<PolicyCore> make_tinylfu_policy(const PolicyContext& ctx);  // cpp/src/policy_tinylfu.cpp
std::unique_ptr<PolicyCore> make_heat_policy(const PolicyContext& ctx);     // cpp/src/policy_heat.cpp
std::unique_ptr<PolicyCore> make_opt_policy(const PolicyContext& ctx);      // cpp/src/policy_opt.cpp

}  // namespace ucm
