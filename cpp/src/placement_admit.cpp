// How blocks enter a tier: new blocks written (insert, insert_run) and
// copies promoted to the landing tier (promote), each making room in its tier
// first (placement_evict.cpp).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ucm/placement.hpp"

namespace ucm {

bool PlacementCore::insert(const BlockKey& key, const BlockKey* parent, std::int64_t size_bytes, int t,
                           bool restored, PlanSteps& plan) {
  tier_at(t);
  if (size_bytes <= 0) throw std::invalid_argument("size_bytes must be > 0, got " + std::to_string(size_bytes));
  return insert_one(key, parent, size_bytes, t, restored, plan);
}

std::size_t PlacementCore::insert_run(const std::vector<BlockKey>& keys, const BlockKey* parent,
                                      const std::vector<std::int64_t>& sizes, int t, std::vector<bool>& placed,
                                      PlanSteps& plan) {
  tier_at(t);
  const std::size_t n = keys.size();
  if (sizes.size() != n) {
    throw std::invalid_argument("insert_run: " + std::to_string(n) + " keys but " + std::to_string(sizes.size()) +
                                " sizes");
  }
  for (auto s : sizes) {
    if (s <= 0) throw std::invalid_argument("size_bytes must be > 0, got " + std::to_string(s));
  }
  placed.assign(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    if (insert_one(keys[i], parent, sizes[i], t, false, plan)) {
      placed[i] = true;
    } else if (nodes_.count(keys[i]) == 0) {
      return i;
    }
    parent = &keys[i];
  }
  return n;
}

bool PlacementCore::insert_one(const BlockKey& key, const BlockKey* parent, std::int64_t size, int t, bool restored,
                               PlanSteps& plan) {
  if (nodes_.count(key) != 0) return false;
  if (parent != nullptr && nodes_.count(*parent) == 0) return false;
  Tier& dst = tiers_[static_cast<std::size_t>(t)];
  if (size > dst.capacity || !(restored || dst.policy->admit(key, AdmissionKind::kNew))) return false;
  if (dst.used + size > dst.capacity && !make_room(t, size, plan, parent)) return false;
  if (parent != nullptr && nodes_.count(*parent) == 0) return false;  // lost while making room
  link(key, parent, size);
  enter(key, t, size);
  if (!restored) plan.push_back({StepOp::kWrite, key, -1, t});  // a restored block's bytes are already there
  return true;
}

bool PlacementCore::promote(const BlockKey& key, bool force, PlanSteps& plan) {
  int src = where(key);
  int t = landing_;
  if (src < 0 || src <= t) return false;
  Tier& dst = tiers_[static_cast<std::size_t>(t)];
  std::int64_t size = nodes_.at(key).size;
  if (!(force || dst.policy->admit(key, AdmissionKind::kPromote))) return false;
  count_up(holds_, key);  // the source must survive the evictions made for it
  const BlockKey* parent = parent_of(key);
  OptKey protect = parent ? OptKey(*parent) : std::nullopt;
  bool room = make_room(t, size, plan, protect ? &*protect : nullptr);
  count_down(holds_, key);
  if (!room || nodes_.count(key) == 0) return false;
  tiers_[static_cast<std::size_t>(src)].policy->on_copied_up(key);  // the copy read stays (placement.py)
  enter(key, t, size);
  ++dst.counters.promotions_in;
  plan.push_back({StepOp::kCopy, key, src, t});
  return true;
}

}  // namespace ucm
