// The prefix tree of cached blocks and each tier's accounting of them: a block
// linked into the cache under its parent (link, unlink), entering and leaving
// a tier (its bytes, counts, counters, per-tier child counts and the policy's
// callbacks), and the walks over its descendants.
#include <cstdint>
#include <iterator>
#include <utility>
#include <vector>

#include "ucm/placement.hpp"

namespace ucm {

void PlacementCore::link(const BlockKey& key, const BlockKey* parent, std::int64_t size) {
  if (watching_ && nodes_.count(key) == 0) events_.emplace_back(true, key);
  Node& node = nodes_[key];
  node.parent = parent ? OptKey(*parent) : std::nullopt;
  node.size = size;
  if (parent != nullptr) {
    ChildList& kids = children_[*parent];
    kids.push_back(key);
    node.sib = std::prev(kids.end());
  }
}

void PlacementCore::unlink(const BlockKey& key) {
  auto it = nodes_.find(key);
  OptKey parent = std::move(it->second.parent);
  ChildList::iterator sib = it->second.sib;
  nodes_.erase(it);
  if (watching_) events_.emplace_back(false, key);
  if (parent) {
    auto kids = children_.find(*parent);
    if (kids != children_.end()) {
      kids->second.erase(sib);
      if (kids->second.empty()) children_.erase(kids);
    }
  }
}

void PlacementCore::enter(const BlockKey& key, int t, std::int64_t size) {
  Tier& tier = tiers_[static_cast<std::size_t>(t)];
  Node& node = nodes_.at(key);  // only cached blocks enter a tier
  node.mask |= tier.bit;
  ++tier.count;
  tier.used += size;
  ++tier.counters.inserts;
  tier.counters.bytes_written += size;
  auto kids = children_.find(key);
  std::int32_t n = 0;
  if (kids != children_.end()) {
    for (const auto& c : kids->second) n += holds_block(t, c) ? 1 : 0;
  }
  node.kids[t] = n;
  bool first_child = false;  // of its parent in this tier
  if (node.parent) {
    auto p = nodes_.find(*node.parent);
    if (p != nodes_.end() && (p->second.mask & tier.bit)) first_child = ++p->second.kids[t] == 1;
  }
  tier.policy->on_insert(key, size);
  if (n > 0) tier.policy->on_children(key, true);
  if (first_child) tier.policy->on_children(*node.parent, true);
}

void PlacementCore::leave(const BlockKey& key, int t) {
  Tier& tier = tiers_[static_cast<std::size_t>(t)];
  Node& node = nodes_.at(key);
  tier.used -= node.size;
  --tier.count;
  node.mask &= ~tier.bit;
  node.kids[t] = 0;
  bool last_child = false;  // of its parent in this tier
  if (node.parent) {
    auto p = nodes_.find(*node.parent);
    if (p != nodes_.end() && (p->second.mask & tier.bit)) last_child = --p->second.kids[t] == 0;
  }
  tier.policy->on_remove(key);
  if (last_child) tier.policy->on_children(*node.parent, false);
}

std::vector<BlockKey> PlacementCore::children_first(const std::vector<BlockKey>& group,
                                                    const KeySet& in_group) const {
  std::vector<BlockKey> order;
  std::vector<std::pair<BlockKey, bool>> stack;
  for (const auto& k : group) {
    const BlockKey* p = parent_of(k);
    if (p == nullptr || in_group.count(*p) == 0) stack.emplace_back(k, false);
  }
  while (!stack.empty()) {
    auto [k, expanded] = std::move(stack.back());
    stack.pop_back();
    if (expanded) {
      order.push_back(std::move(k));
      continue;
    }
    stack.emplace_back(k, true);
    auto kids = children_.find(k);
    if (kids != children_.end()) {
      for (const auto& c : kids->second) {
        if (in_group.count(c) != 0) stack.emplace_back(c, false);
      }
    }
  }
  return order;
}

void PlacementCore::drop_descendants(const BlockKey& key, PlanSteps& plan) {
  std::vector<BlockKey> order;
  std::vector<BlockKey> stack{key};
  while (!stack.empty()) {  // depth first, as ucm/placement/engine.py walks them
    BlockKey k = stack.back();
    stack.pop_back();
    order.push_back(k);
    auto kids = children_.find(k);
    if (kids != children_.end()) stack.insert(stack.end(), kids->second.begin(), kids->second.end());
  }
  for (std::size_t i = order.size(); i-- > 0;) {  // deepest first
    const BlockKey& k = order[i];
    std::uint32_t m = mask_of(k);
    for (int x = 0; m; ++x, m >>= 1) {
      if (m & 1u) {
        leave(k, x);
        plan.push_back({StepOp::kDrop, k, x, -1});
      }
    }
    unlink(k);
  }
}

}  // namespace ucm
