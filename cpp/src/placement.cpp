// The placement core (the twin of ucm/placement/engine.py) and the KeyCodec; the
// native policies are in policies.cpp and policy_<name>.cpp.
#include "ucm/placement.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

namespace ucm {

// ---- KeyCodec ------------------------------------------------------------------

BlockKey KeyCodec::encode(const char* data, std::size_t len) {
  BlockKey k;
  if (len <= 16) {
    char buf[16] = {0};
    std::memcpy(buf, data, len);
    std::memcpy(&k.lo, buf, 8);
    std::memcpy(&k.hi, buf + 8, 8);
    k.tag = len;
    return k;
  }
  std::string s(data, len);
  auto it = ids_.find(s);
  if (it == ids_.end()) {
    it = ids_.emplace(s, long_.size()).first;
    long_.push_back(std::move(s));
  }
  k.tag = BlockKey::kInterned | it->second;
  return k;
}

std::string KeyCodec::decode(const BlockKey& key) const {
  if (key.tag & BlockKey::kInterned) return long_.at(static_cast<std::size_t>(key.tag & ~BlockKey::kInterned));
  char buf[16];
  std::memcpy(buf, &key.lo, 8);
  std::memcpy(buf + 8, &key.hi, 8);
  return std::string(buf, static_cast<std::size_t>(key.tag));
}

namespace {

int lowest_bit(std::uint32_t m) { return __builtin_ctz(m); }

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

void count_up(KeyMap<int>& counts, const BlockKey& key) { ++counts[key]; }

void count_down(KeyMap<int>& counts, const BlockKey& key) {
  auto it = counts.find(key);
  if (it == counts.end()) return;
  if (it->second <= 1) {
    counts.erase(it);
  } else {
    --it->second;
  }
}

}  // namespace

// ---- PlacementCore -------------------------------------------------------------

PlacementCore::PlacementCore(const std::vector<TierSetup>& tiers, const std::string& policy,
                             std::size_t history_blocks, int landing)
    : heat_(history_blocks), landing_(landing) {
  if (tiers.empty()) throw std::invalid_argument("placement needs at least one tier");
  if (tiers.size() > static_cast<std::size_t>(kMaxTiers)) {
    throw std::invalid_argument("placement takes at most " + std::to_string(kMaxTiers) + " tiers");
  }
  if (landing < 0 || landing >= static_cast<int>(tiers.size())) {
    throw std::invalid_argument("landing tier index " + std::to_string(landing) + " outside 0.." +
                                std::to_string(tiers.size() - 1));
  }
  if (history_blocks < 1) throw std::invalid_argument("history_blocks must be >= 1");
  const PolicyMaker make = policy_maker(policy);
  if (make == nullptr) throw std::invalid_argument("no native placement policy '" + policy + "'");
  tiers_.resize(tiers.size());
  for (std::size_t i = 0; i < tiers.size(); ++i) {
    if (tiers[i].capacity_bytes < 0) {
      throw std::invalid_argument("tier '" + tiers[i].name + "': capacity_bytes must be >= 0");
    }
    Tier& tier = tiers_[i];
    tier.name = tiers[i].name;
    tier.index = static_cast<int>(i);
    tier.capacity = tiers[i].capacity_bytes;
    tier.lowest = i + 1 == tiers.size();
    tier.bit = 1u << i;
    tier.policy = make(PolicyContext{heat_, codec_, tier.name, tier.index, tier.capacity, tier.lowest});
  }
  protect_.resize(tiers.size());
}

PlacementCore::~PlacementCore() = default;

const PlacementCore::Tier& PlacementCore::tier_at(int t) const {
  if (t < 0 || t >= static_cast<int>(tiers_.size())) {
    throw std::out_of_range("tier index " + std::to_string(t) + " outside 0.." + std::to_string(tiers_.size() - 1));
  }
  return tiers_[static_cast<std::size_t>(t)];
}

const std::string& PlacementCore::tier_name(int t) const { return tier_at(t).name; }
std::int64_t PlacementCore::capacity_bytes(int t) const { return tier_at(t).capacity; }
std::int64_t PlacementCore::used_bytes(int t) const { return tier_at(t).used; }
std::size_t PlacementCore::blocks(int t) const { return tier_at(t).count; }
TierCounts PlacementCore::counters(int t) const { return tier_at(t).counters; }

std::uint32_t PlacementCore::mask_of(const BlockKey& key) const {
  auto it = nodes_.find(key);
  return it == nodes_.end() ? 0u : it->second.mask;
}

std::vector<int> PlacementCore::tiers_of(const BlockKey& key) const {
  std::vector<int> out;
  std::uint32_t m = mask_of(key);
  for (int t = 0; t < tier_count(); ++t) {
    if (m >> t & 1u) out.push_back(t);
  }
  return out;
}

int PlacementCore::where(const BlockKey& key) const {
  std::uint32_t m = mask_of(key);
  return m ? lowest_bit(m) : -1;
}

std::size_t PlacementCore::lookup(const std::vector<BlockKey>& keys) const {
  std::size_t n = 0;
  while (n < keys.size() && nodes_.count(keys[n]) != 0) ++n;
  return n;
}

std::vector<int> PlacementCore::locate(const std::vector<BlockKey>& keys) const {
  std::vector<int> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(where(k));
  return out;
}

std::int64_t PlacementCore::size_of(const BlockKey& key) const {
  auto it = nodes_.find(key);
  return it == nodes_.end() ? -1 : it->second.size;
}

const BlockKey* PlacementCore::parent_of(const BlockKey& key) const {
  auto it = nodes_.find(key);
  if (it == nodes_.end() || !it->second.parent) return nullptr;
  return &*it->second.parent;
}

std::vector<BlockKey> PlacementCore::resident_keys(int t) const {
  const Tier& tier = tier_at(t);
  std::vector<BlockKey> out;
  out.reserve(tier.count);
  for (const auto& kv : nodes_) {
    if (kv.second.mask & tier.bit) out.push_back(kv.first);
  }
  return out;
}

std::vector<BlockKey> PlacementCore::cached_keys() const {
  std::vector<BlockKey> out;
  out.reserve(nodes_.size());
  for (const auto& kv : nodes_) out.push_back(kv.first);
  return out;
}

void PlacementCore::pin(const std::vector<BlockKey>& keys) {
  for (const auto& k : keys) count_up(pins_, k);
}
void PlacementCore::unpin(const std::vector<BlockKey>& keys) {
  for (const auto& k : keys) count_down(pins_, k);
}
void PlacementCore::hold(const std::vector<BlockKey>& keys) {
  for (const auto& k : keys) count_up(holds_, k);
}
void PlacementCore::unhold(const std::vector<BlockKey>& keys) {
  for (const auto& k : keys) count_down(holds_, k);
}

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

void PlacementCore::record_request(const std::vector<BlockKey>& keys, const BlockKey* parent,
                                   const std::vector<double>* next_uses) {
  if (next_uses != nullptr && next_uses->size() != keys.size()) {
    throw std::invalid_argument("record_request: " + std::to_string(keys.size()) + " keys but " +
                                std::to_string(next_uses->size()) + " next uses");
  }
  auto nu = [&](std::size_t i) { return next_uses == nullptr ? HeatMirror::kInf : (*next_uses)[i]; };
  heat_.tick();
  for (std::size_t i = keys.size(); i-- > 1;) heat_.touch(keys[i], &keys[i - 1], nu(i));
  if (!keys.empty()) heat_.touch(keys[0], parent, nu(0));
}

void PlacementCore::finish_request(const std::vector<BlockKey>& keys, std::int64_t output_tokens) {
  for (const auto& key : heat_.finish(keys, output_tokens)) {
    const std::uint32_t m = mask_of(key);
    for (auto& tier : tiers_) {
      if (m & tier.bit) tier.policy->on_reclass(key);
    }
  }
}

void PlacementCore::touch(const std::vector<BlockKey>& keys) {
  for (std::size_t i = keys.size(); i-- > 0;) {
    std::uint32_t m = mask_of(keys[i]);
    if (m) {
      Tier& tier = tiers_[static_cast<std::size_t>(lowest_bit(m))];
      tier.policy->on_hit(keys[i]);
      ++tier.counters.hits;
    }
  }
}

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

std::vector<std::pair<bool, BlockKey>> PlacementCore::take_events() {
  std::vector<std::pair<bool, BlockKey>> out;
  out.swap(events_);
  return out;
}

// ---- internals ---------------------------------------------------------------

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