// ReuseModel: the twin of ucm/placement/policies/reuse.py. A HeatListener that learns
// each class's reuse hazard per age bucket from the tracker's events, with
// the same counts in the same order (whole numbers kept in doubles, so
// exact either way), read by the heat policy (cpp/src/policy_heat.cpp).
//
// `reuse_hazard` and `reuse_density` are the one implementation of the
// hazard estimate and the hit-density table: ucm._native binds them and the
// Python ReuseModel uses them whenever ucm._native is importable (its numpy
// code is the fallback), so both engines value blocks with the same numbers.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <utility>

#include "ucm/block_key.hpp"
#include "ucm/heat_mirror.hpp"

namespace ucm {
namespace reuse {

constexpr int kUseKinds = 4;
constexpr int kClasses = 4 * kUseKinds;  // x (tail or not) x (long output or not)
constexpr int kAgeBuckets = 20;
constexpr int kCells = kClasses * kAgeBuckets;
constexpr double kPriorEvents = 1.0;

using Table = std::array<double, kCells>;  // row-major (class, age bucket)

// ucm.placement.policies.reuse.classify
inline int classify(std::int64_t count, bool tail, bool ext, bool long_out) {
  const int kind = count <= 1 ? (ext ? 1 : 0) : (count == 2 ? 2 : 3);
  return kind + (tail ? kUseKinds : 0) + (long_out ? 2 * kUseKinds : 0);
}

// ucm.placement.policies.reuse.class_of: the class of the record in slot s as the tracker knows it now.
inline int class_of(const HeatMirror& heat, int s) {
  const std::uint8_t f = heat.flags(s);
  return classify(heat.count(s), (f & HeatMirror::kTail) != 0, (f & HeatMirror::kExt) != 0,
                  (f & HeatMirror::kLongOut) != 0);
}

// ucm.placement.policies.reuse.age_bucket: [0,2) -> 0, [2,4) -> 1, [4,8) -> 2, ... capped.
inline int age_bucket(std::int64_t age) {
  if (age <= 1) return 0;
  const int bits = 64 - __builtin_clzll(static_cast<unsigned long long>(age));  // bit_length
  return bits - 1 < kAgeBuckets - 1 ? bits - 1 : kAgeBuckets - 1;
}

// The first age of bucket i (_START).
inline std::int64_t bucket_start(int i) { return i == 0 ? 0 : std::int64_t{1} << i; }

}  // namespace reuse

// ReuseModel.hazard's estimate (`_estimate`) from the reuses and exposure per cell.
void reuse_hazard(const double* events, const double* exposure, double* out);
// ReuseModel.density: hit density per cell over `horizon` ticks from the hazards.
void reuse_density(const double* hazard, double horizon, double* out);
// One cell of it, (class, bucket j), from the class's row of hazards and a
// horizon >= 1: what reuse_density writes there (it calls this, and it is
// never inlined, so both callers run one compiled body), so a policy may
// compute only the cells it reads.
__attribute__((noinline)) double reuse_density_at(const double* hazard_row, double horizon, int j);

class ReuseModel : public HeatListener {
 public:
  explicit ReuseModel(HeatMirror& heat) : heat_(heat) {
    events_.fill(0.0);
    exposure_.fill(0.0);
    alive_.fill(0.0);
  }

  void on_access(const BlockKey& key, int slot, std::int64_t now, bool first, bool ext) override;
  void on_tick(std::int64_t now) override;
  void on_forget(const BlockKey& key, int slot, std::int64_t now) override;
  void on_reclass(const BlockKey& key, int slot, std::int64_t now, bool long_out) override;

  // Bumped every tick: tables derived from the model go stale.
  std::uint64_t version() const { return version_; }
  const reuse::Table& events() const { return events_; }
  const reuse::Table& exposure() const { return exposure_; }
  const reuse::Table& alive() const { return alive_; }
  // Cached until the next tick (computed at the first call after it).
  const reuse::Table& hazard();

 private:
  HeatMirror& heat_;
  reuse::Table events_;
  reuse::Table exposure_;
  reuse::Table alive_;
  // waiting_[i]: episodes (start, slot) that may cross into bucket i.
  std::array<std::deque<std::pair<std::int64_t, int>>, reuse::kAgeBuckets> waiting_;
  std::uint64_t version_ = 0;
  reuse::Table hazard_;
  bool have_hazard_ = false;
  std::uint64_t hazard_version_ = 0;
};

}  // namespace ucm
