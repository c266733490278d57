// The placement core: which tier holds which block, and every decision that
// moves one, for the policies that have a native implementation (the table
// in cpp/src/policies.cpp, see ucm/policy_core.hpp). It makes exactly the
// decisions of ucm/placement/engine.py with the same policy in ucm/placement/policies/*.py; see
// that module for the invariants it keeps. Not thread-safe: the owner
// serialises calls.
//
// The policies read the prefix tree, the clock and the access records from
// a HeatMirror (ucm/heat_mirror.hpp): the records of the Python
// HeatTracker, kept the same way from the same record_request and
// finish_request calls.
//
// Defined in cpp/src/placement.cpp (state, queries, accesses),
// placement_admit.cpp (insert, promote), placement_evict.cpp (making room,
// evicting, removing) and placement_tree.cpp (the prefix tree and each
// tier's accounting).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ucm/block_key.hpp"
#include "ucm/heat_mirror.hpp"
#include "ucm/policy_core.hpp"

namespace ucm {

enum class StepOp : std::uint8_t { kWrite = 0, kMove = 1, kCopy = 2, kDrop = 3 };

// One step of a plan; src/dst -1 when not used.
struct PlanStep {
  StepOp op;
  BlockKey key;
  int src;
  int dst;
};
using PlanSteps = std::vector<PlanStep>;

struct TierCounts {
  std::int64_t inserts = 0;
  std::int64_t hits = 0;
  std::int64_t evictions = 0;
  std::int64_t demotions_in = 0;
  std::int64_t promotions_in = 0;
  std::int64_t bytes_written = 0;
};

struct TierSetup {
  std::string name;
  std::int64_t capacity_bytes;
};

class PlacementCore {
 public:
  // Throws std::invalid_argument for no tiers, a bad landing index, a
  // negative capacity or a policy with no native twin (policy_maker).
  PlacementCore(const std::vector<TierSetup>& tiers, const std::string& policy, std::size_t history_blocks,
                int landing);
  ~PlacementCore();
  PlacementCore(const PlacementCore&) = delete;
  PlacementCore& operator=(const PlacementCore&) = delete;

  KeyCodec& codec() { return codec_; }
  const KeyCodec& codec() const { return codec_; }

  // ---- queries (a bad tier index throws std::out_of_range) ----
  int tier_count() const { return static_cast<int>(tiers_.size()); }
  int landing() const { return landing_; }
  const std::string& tier_name(int t) const;
  std::int64_t capacity_bytes(int t) const;
  std::int64_t used_bytes(int t) const;
  std::size_t blocks(int t) const;
  TierCounts counters(int t) const;
  bool contains(const BlockKey& key) const { return nodes_.count(key) != 0; }
  std::vector<int> tiers_of(const BlockKey& key) const;
  int where(const BlockKey& key) const;  // -1: nowhere
  std::size_t lookup(const std::vector<BlockKey>& keys) const;
  std::vector<int> locate(const std::vector<BlockKey>& keys) const;  // -1: nowhere
  std::int64_t size_of(const BlockKey& key) const;  // -1: unknown
  const BlockKey* parent_of(const BlockKey& key) const;
  std::vector<BlockKey> resident_keys(int t) const;
  std::vector<BlockKey> cached_keys() const;

  // ---- pins and holds ----
  void pin(const std::vector<BlockKey>& keys);
  void unpin(const std::vector<BlockKey>& keys);
  void hold(const std::vector<BlockKey>& keys);
  void unhold(const std::vector<BlockKey>& keys);

  // ---- accesses ----
  // next_uses: one per key (the oracle's, trace replay only), or nullptr (all unknown).
  void record_request(const std::vector<BlockKey>& keys, const BlockKey* parent,
                      const std::vector<double>* next_uses = nullptr);
  // The request that used `keys` generated `output_tokens`: the tracker's
  // output kinds, then on_reclass to every tier holding a changed block.
  void finish_request(const std::vector<BlockKey>& keys, std::int64_t output_tokens);
  void touch(const std::vector<BlockKey>& keys);

  // ---- changes ----
  bool insert(const BlockKey& key, const BlockKey* parent, std::int64_t size_bytes, int t, bool restored,
              PlanSteps& plan);
  // Per key whether placed; returns `stop`.
  std::size_t insert_run(const std::vector<BlockKey>& keys, const BlockKey* parent,
                         const std::vector<std::int64_t>& sizes, int t, std::vector<bool>& placed,
                         PlanSteps& plan);
  bool promote(const BlockKey& key, bool force, PlanSteps& plan);
  void reclaim(int t, std::int64_t free_bytes, std::int64_t max_victims, PlanSteps& plan);
  bool may_evict(int t, const std::vector<BlockKey>& keys, const BlockKey* protect, bool relaxed) const;
  void evict_keys(int t, const std::vector<BlockKey>& keys, bool any_one, const BlockKey* protect, bool relaxed,
                  PlanSteps& plan);
  void remove(const BlockKey& key, int tier, PlanSteps& plan);  // tier -1: every copy

  // ---- link events (for `watch`): recorded only once enabled ----
  void watch_events(bool on) { watching_ = on; }
  // (linked, key) in order since the last call.
  std::vector<std::pair<bool, BlockKey>> take_events();

 private:
  using ChildList = std::list<BlockKey>;  // in link order
  static constexpr int kMaxTiers = 8;
  // A cached block: its parent, bytes, the tiers holding it and, per tier,
  // how many of its children that tier holds.
  struct Node {
    OptKey parent;
    std::int64_t size = 0;
    ChildList::iterator sib;  // its place in its parent's ChildList
    std::uint32_t mask = 0;   // bit t: tier t holds it
    std::int32_t kids[kMaxTiers] = {};
  };
  struct Tier {
    std::string name;
    int index;
    std::int64_t capacity;
    bool lowest;
    std::uint32_t bit;
    std::int64_t used = 0;
    std::size_t count = 0;  // blocks it holds
    TierCounts counters;
    std::unique_ptr<PolicyCore> policy;
  };

  static void count_up(KeyMap<int>& counts, const BlockKey& key);
  static void count_down(KeyMap<int>& counts, const BlockKey& key);  // forgets the key at zero
  const Tier& tier_at(int t) const;
  std::uint32_t mask_of(const BlockKey& key) const;
  bool holds_block(int t, const BlockKey& key) const { return (mask_of(key) >> t & 1u) != 0; }
  bool stuck(const BlockKey& key, const Tier& tier) const;
  bool is_protected(int t, const BlockKey& key) const;
  bool evictable(int t, const BlockKey& key) const;
  bool relaxed_ok(int t, const BlockKey& key) const;
  bool insert_one(const BlockKey& key, const BlockKey* parent, std::int64_t size, int t, bool restored,
                  PlanSteps& plan);
  bool make_room(int t, std::int64_t size, PlanSteps& plan, const BlockKey* protect);
  void evict(const BlockKey& key, int t, PlanSteps& plan);
  void link(const BlockKey& key, const BlockKey* parent, std::int64_t size);
  void unlink(const BlockKey& key);
  void enter(const BlockKey& key, int t, std::int64_t size);
  void leave(const BlockKey& key, int t);
  void drop_descendants(const BlockKey& key, PlanSteps& plan);
  std::vector<BlockKey> children_first(const std::vector<BlockKey>& group,
                                       const KeySet& in_group) const;

  KeyCodec codec_;
  HeatMirror heat_;  // before tiers_: the policies read it (and its listeners) until they go
  std::vector<Tier> tiers_;
  int landing_;
  std::vector<OptKey> protect_;                      // per tier, while making room
  KeyMap<Node> nodes_;                               // cached anywhere -> parent, size
  KeyMap<ChildList> children_;                       // cached parent -> cached children
  KeyMap<int> pins_;
  KeyMap<int> holds_;
  bool watching_ = false;
  std::vector<std::pair<bool, BlockKey>> events_;
};

}  // namespace ucm
