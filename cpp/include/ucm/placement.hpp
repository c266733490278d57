// The placement core: which tier holds which block, and every decision that
// moves one, for the policies that have a native implementation (lru, fifo,
// lfu, arc, s3fifo). It makes exactly the decisions of ucm/placement.py with
// the same policy in ucm/policy/*.py; see that module for the invariants it
// keeps. Keys are byte strings. Not thread-safe: the owner serialises calls.
//
// The policies learn the prefix tree and the clock from a HeatMirror: the
// parent links and clock of the Python HeatTracker, kept the same way
// (bounded history, least recently accessed forgotten first) from the same
// record_request calls.
//
// Keys are byte strings of any length; up to 16 bytes (ucm's keys are 16)
// they are packed into a BlockKey by value, a longer one is interned by the
// core's KeyCodec for the life of the core.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace ucm {

// A key as the core keeps it: up to 16 bytes packed in two words with their
// count in `tag`, or a longer key's surrogate (kInterned | its number).
struct BlockKey {
  static constexpr std::uint64_t kInterned = 1ULL << 63;
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  std::uint64_t tag = 0;
  bool operator==(const BlockKey& o) const { return lo == o.lo && hi == o.hi && tag == o.tag; }
  bool operator!=(const BlockKey& o) const { return !(*this == o); }
  // Any strict order (the policies' priorities never tie, so it decides nothing).
  bool operator<(const BlockKey& o) const {
    if (lo != o.lo) return lo < o.lo;
    if (hi != o.hi) return hi < o.hi;
    return tag < o.tag;
  }
};

struct BlockKeyHash {
  std::size_t operator()(const BlockKey& k) const {
    std::uint64_t h = k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL) ^ (k.tag * 0xC2B2AE3D27D4EB4FULL);
    h ^= h >> 33;  // murmur3's finaliser
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return static_cast<std::size_t>(h);
  }
};

template <class V>
using KeyMap = std::unordered_map<BlockKey, V, BlockKeyHash>;
using KeySet = std::unordered_set<BlockKey, BlockKeyHash>;
using OptKey = std::optional<BlockKey>;

// Bytes <-> BlockKey.
class KeyCodec {
 public:
  BlockKey encode(const char* data, std::size_t len);
  std::string decode(const BlockKey& key) const;

 private:
  std::unordered_map<std::string, std::uint64_t> ids_;  // interned keys longer than 16 bytes
  std::vector<std::string> long_;
};

enum class StepOp : std::uint8_t { kWrite = 0, kMove = 1, kCopy = 2, kDrop = 3 };

// One step of a plan; src/dst -1 when not used.
struct PlanStep {
  StepOp op;
  BlockKey key;
  int src;
  int dst;
};
using PlanSteps = std::vector<PlanStep>;

enum class AdmissionKind : std::uint8_t { kNew, kDemote, kPromote };

enum class PolicyKind : std::uint8_t { kLru, kFifo, kLfu, kArc, kS3Fifo };

// The policy kind named `name` ("lru", ...); false when there is none.
bool policy_kind_of(const std::string& name, PolicyKind* out);

struct TierCounts {
  std::int64_t inserts = 0;
  std::int64_t hits = 0;
  std::int64_t evictions = 0;
  std::int64_t demotions_in = 0;
  std::int64_t promotions_in = 0;
  std::int64_t bytes_written = 0;
};

// The parent links and clock of ucm.heat.HeatTracker.
class HeatMirror {
 public:
  explicit HeatMirror(std::size_t history_blocks) : capacity_(history_blocks) {}
  void tick() { ++now_; }
  void touch(const BlockKey& key, const BlockKey* parent);
  // The last parent recorded for `key`, or nullptr.
  const BlockKey* parent(const BlockKey& key) const;
  std::int64_t now() const { return now_; }

 private:
  struct Record {
    OptKey parent;
    std::uint64_t order;  // its position in `order_`
  };
  std::size_t capacity_;
  std::int64_t now_ = 0;
  std::uint64_t next_order_ = 0;
  KeyMap<Record> records_;
  std::unordered_map<std::uint64_t, BlockKey> by_order_;  // least recently accessed: lowest order
  std::uint64_t oldest_ = 0;  // no record has a lower order
};

using KeyPred = std::function<bool(const BlockKey&)>;

// The native twin of ucm.policy.base.PlacementPolicy.
class PolicyCore {
 public:
  virtual ~PolicyCore() = default;
  virtual void on_insert(const BlockKey& key, std::int64_t size_bytes) = 0;
  virtual void on_hit(const BlockKey& key) = 0;
  virtual void on_remove(const BlockKey& key) = 0;
  virtual bool victim(const KeyPred& evictable, BlockKey* out) = 0;
  virtual bool admit(const BlockKey&, AdmissionKind) { return true; }
};

struct TierSetup {
  std::string name;
  std::int64_t capacity_bytes;
};

class PlacementCore {
 public:
  // Throws std::invalid_argument for no tiers, a bad landing index or a
  // negative capacity.
  PlacementCore(const std::vector<TierSetup>& tiers, PolicyKind policy, std::size_t history_blocks, int landing);
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
  void record_request(const std::vector<BlockKey>& keys, const BlockKey* parent);
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
  struct Node {
    OptKey parent;
    std::int64_t size;
    ChildList::iterator sib;  // its place in its parent's ChildList
  };
  struct Tier {
    std::string name;
    int index;
    std::int64_t capacity;
    bool lowest;
    std::uint32_t bit;
    std::int64_t used = 0;
    KeyMap<std::int64_t> blocks;
    KeyMap<std::int64_t> kids;  // resident children in this tier (> 0)
    TierCounts counters;
    std::unique_ptr<PolicyCore> policy;
  };

  const Tier& tier_at(int t) const;
  std::uint32_t mask_of(const BlockKey& key) const;
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
  std::vector<Tier> tiers_;
  int landing_;
  HeatMirror heat_;
  KeyMap<std::uint32_t> res_;  // resident key -> bit mask of its tiers
  std::vector<OptKey> protect_;                      // per tier, while making room
  KeyMap<Node> nodes_;                               // cached anywhere -> parent, size
  KeyMap<ChildList> children_;                       // cached parent -> cached children
  KeyMap<int> pins_;
  KeyMap<int> holds_;
  bool watching_ = false;
  std::vector<std::pair<bool, BlockKey>> events_;
};

}  // namespace ucm
