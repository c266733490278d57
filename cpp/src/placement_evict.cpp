// How blocks leave a tier: which blocks may go (evictable, may_evict), the
// victims the tier's policy picks to make room, a victim demoted to the tier
// below or dropped with its descendants (evict), and the explicit evictions
// and removals the owner asks for (reclaim, evict_keys, remove).
#include <cstdint>
#include <utility>
#include <vector>

#include "ucm/placement.hpp"

namespace ucm {

namespace {

// Restores protect_[t] when a make_room returns.
class ProtectGuard {
 public:
  ProtectGuard(OptKey& slot, const BlockKey* protect) : slot_(slot), saved_(std::move(slot)) {
    if (protect != nullptr) {
      slot_ = *protect;
    } else {
      slot_.reset();
    }
  }
  ~ProtectGuard() { slot_ = std::move(saved_); }
  ProtectGuard(const ProtectGuard&) = delete;
  ProtectGuard& operator=(const ProtectGuard&) = delete;

 private:
  OptKey& slot_;
  OptKey saved_;
};

}  // namespace

bool PlacementCore::stuck(const BlockKey& key, const Tier& tier) const {
  if (holds_.count(key) != 0) return true;
  return pins_.count(key) != 0 && (mask_of(key) & ~tier.bit) == 0;
}

bool PlacementCore::is_protected(int t, const BlockKey& key) const {
  const OptKey& p = protect_[static_cast<std::size_t>(t)];
  return p && *p == key;
}

bool PlacementCore::relaxed_ok(int t, const BlockKey& key) const {
  const Tier& tier = tiers_[static_cast<std::size_t>(t)];
  return !is_protected(t, key) && holds_.count(key) == 0 &&
         (pins_.count(key) == 0 || (mask_of(key) & ~tier.bit) != 0);
}

bool PlacementCore::evictable(int t, const BlockKey& key) const {
  const Tier& tier = tiers_[static_cast<std::size_t>(t)];
  if (is_protected(t, key) || holds_.count(key) != 0) return false;
  auto node = nodes_.find(key);
  if (node != nodes_.end() && node->second.kids[t] > 0) return false;
  std::uint32_t elsewhere = (node == nodes_.end() ? 0u : node->second.mask) & ~tier.bit;
  if (pins_.count(key) != 0 && elsewhere == 0) return false;
  // From the lowest tier a block leaves the cache unless another tier holds
  // it; then its children anywhere would be orphaned.
  return !tier.lowest || children_.count(key) == 0 || elsewhere != 0;
}

void PlacementCore::reclaim(int t, std::int64_t free_bytes, std::int64_t max_victims, PlanSteps& plan) {
  Tier& tier = const_cast<Tier&>(tier_at(t));
  if (tier.lowest) return;
  const std::int64_t cap = tier.capacity;
  for (std::int64_t i = 0; i < max_victims; ++i) {
    if (tier.used + free_bytes <= cap) break;
    std::int64_t before = tier.used;  // room for one byte more than is free: exactly one victim
    if (!make_room(t, cap - before + 1, plan, nullptr) || tier.used >= before) break;
  }
}

bool PlacementCore::may_evict(int t, const std::vector<BlockKey>& keys, const BlockKey* protect,
                              bool relaxed) const {
  const Tier& tier = tier_at(t);
  KeySet group(keys.begin(), keys.end());
  if (group.empty()) return false;
  for (const auto& k : group) {
    if (!holds_block(t, k) || stuck(k, tier) || (protect != nullptr && k == *protect)) return false;
  }
  if (relaxed && !tier.lowest) return true;
  for (const auto& k : group) {
    auto kids = children_.find(k);
    if (kids == children_.end()) continue;
    if (!tier.lowest || (mask_of(k) & ~tier.bit) != 0) {
      if (nodes_.at(k).kids[t] > 0) {
        for (const auto& c : kids->second) {
          if (holds_block(t, c) && group.count(c) == 0) return false;
        }
      }
    } else {
      for (const auto& c : kids->second) {
        if (group.count(c) == 0 || __builtin_popcount(mask_of(c)) > 1) return false;
      }
    }
  }
  return true;
}

void PlacementCore::evict_keys(int t, const std::vector<BlockKey>& keys, bool any_one, const BlockKey* protect,
                               bool relaxed, PlanSteps& plan) {
  Tier& tier = const_cast<Tier&>(tier_at(t));
  if (any_one) {
    KeySet named;
    for (const auto& k : keys) {
      if (holds_block(t, k)) named.insert(k);
    }
    if (named.empty()) return;
    BlockKey victim;
    bool found;
    {
      ProtectGuard guard(protect_[static_cast<std::size_t>(t)], protect);
      found = tier.policy->leaf_victim([&](const BlockKey& k) { return named.count(k) != 0 && evictable(t, k); },
                                       &victim);
    }
    if (!found && relaxed && !tier.lowest) {
      found = tier.policy->victim(
          [&](const BlockKey& k) {
            return named.count(k) != 0 && !stuck(k, tier) && !(protect != nullptr && k == *protect);
          },
          &victim);
    }
    if (found) evict(victim, t, plan);
    return;
  }
  if (!may_evict(t, keys, protect, relaxed)) return;
  std::vector<BlockKey> group;
  KeySet in_group;
  for (const auto& k : keys) {
    if (in_group.insert(k).second) group.push_back(k);
  }
  for (const auto& k : children_first(group, in_group)) {
    if (holds_block(t, k)) evict(k, t, plan);  // not dropped meanwhile with a parent whose demotion failed
  }
}

void PlacementCore::remove(const BlockKey& key, int tier, PlanSteps& plan) {
  if (tier >= 0) tier_at(tier);
  if (nodes_.count(key) == 0) return;
  std::vector<int> ts = tier < 0 ? tiers_of(key) : std::vector<int>{tier};
  for (int t : ts) {
    if (holds_block(t, key)) leave(key, t);
  }
  if (mask_of(key) == 0) drop_descendants(key, plan);
}

bool PlacementCore::make_room(int t, std::int64_t size, PlanSteps& plan, const BlockKey* protect) {
  Tier& tier = tiers_[static_cast<std::size_t>(t)];
  const std::int64_t cap = tier.capacity;
  if (size > cap) return false;
  if (tier.used + size <= cap) return true;
  ProtectGuard guard(protect_[static_cast<std::size_t>(t)], protect);
  const KeyPred evictable_here = [this, t](const BlockKey& k) { return evictable(t, k); };
  const KeyPred relaxed_here = [this, t](const BlockKey& k) { return relaxed_ok(t, k); };
  BlockKey victim;
  while (tier.used + size > cap) {
    bool found = tier.policy->leaf_victim(evictable_here, &victim);
    if (!found && !tier.lowest) {
      // Only parents are left: demote one ahead of its children (it stays
      // cached below, so the prefix survives).
      found = tier.policy->victim(relaxed_here, &victim);
    }
    if (!found) return false;
    evict(victim, t, plan);
  }
  return true;
}

void PlacementCore::evict(const BlockKey& key, int t, PlanSteps& plan) {
  Tier& tier = tiers_[static_cast<std::size_t>(t)];
  ++tier.counters.evictions;
  const std::int64_t size = nodes_.at(key).size;  // the bytes it holds in every tier
  const std::uint32_t elsewhere = mask_of(key) & ~tier.bit;
  const int lower = t + 1;
  if (lower < tier_count() && elsewhere == 0) {
    Tier& below = tiers_[static_cast<std::size_t>(lower)];
    const bool needed = children_.count(key) != 0;  // has resident children: keep the prefix
    if (needed || below.policy->admit(key, AdmissionKind::kDemote)) {
      leave(key, t);
      count_up(holds_, key);
      const BlockKey* parent = parent_of(key);
      OptKey protect = parent ? OptKey(*parent) : std::nullopt;
      const bool room = make_room(lower, size, plan, protect ? &*protect : nullptr);
      count_down(holds_, key);
      const bool linked = nodes_.count(key) != 0;  // else lost while making room: an ancestor left the cache
      if (room && linked) {
        enter(key, lower, size);
        ++below.counters.demotions_in;
        plan.push_back({StepOp::kMove, key, t, lower});
        return;
      }
      plan.push_back({StepOp::kDrop, key, t, -1});
      if (linked) drop_descendants(key, plan);
      return;
    }
  }
  leave(key, t);
  plan.push_back({StepOp::kDrop, key, t, -1});
  if (elsewhere == 0) drop_descendants(key, plan);
}

}  // namespace ucm
