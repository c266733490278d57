// The placement core (the twin of ucm/placement/engine.py): its tiers, the
// queries on what they hold, pins and holds, and the accesses the policies
// learn from. How blocks enter a tier is in placement_admit.cpp, how they
// leave one in placement_evict.cpp, the prefix tree and each tier's
// accounting in placement_tree.cpp; the native policies are in policies.cpp
// and policy_<name>.cpp.
#include "ucm/placement.hpp"

#include <stdexcept>
#include <string>

namespace ucm {

namespace {

int lowest_bit(std::uint32_t m) { return __builtin_ctz(m); }

}  // namespace

void PlacementCore::count_up(KeyMap<int>& counts, const BlockKey& key) { ++counts[key]; }

void PlacementCore::count_down(KeyMap<int>& counts, const BlockKey& key) {
  auto it = counts.find(key);
  if (it == counts.end()) return;
  if (it->second <= 1) {
    counts.erase(it);
  } else {
    --it->second;
  }
}

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

std::vector<std::pair<bool, BlockKey>> PlacementCore::take_events() {
  std::vector<std::pair<bool, BlockKey>> out;
  out.swap(events_);
  return out;
}

}  // namespace ucm
