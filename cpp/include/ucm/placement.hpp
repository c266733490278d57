// The placement core: which tier holds which block, and every decision that
// moves one, for the policies that have a native implementation (lru, fifo,
// lfu, arc, s3fifo). It makes exactly the decisions of ucm/placement.py with
// the same policy in ucm/policy/*.py; see that module for the invariants it
// keeps. Not thread-safe: the owner serialises calls.
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

namespace ucm {

// A key as the core keeps it: up to 16 bytes packed in two words with their
// count in `tag`, or a longer key's surrogate (kInterned | its number).
struct BlockKey {
  static constexpr std::uint64_t kInterned = 1ULL << 63;  // ids stay below 2^63 - 1: ~0 marks an empty KeyMap slot
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

// An open-addressing hash map from BlockKey (linear probing, backward-shift
// deletion, at most half full): one probe sequence in one array, where the
// node-based std::unordered_map costs a cache miss per node. The subset of
// std::unordered_map's interface the core uses; an insert or erase
// invalidates iterators and references; iteration order is unspecified
// (nothing the core decides depends on it).
template <class V>
class KeyMap {
 public:
  struct Slot {
    BlockKey first{0, 0, kEmptyTag};
    V second{};
  };

  template <class S>
  class Iter {
   public:
    Iter(S* p, S* end) : p_(p), end_(end) { skip(); }
    S& operator*() const { return *p_; }
    S* operator->() const { return p_; }
    Iter& operator++() {
      ++p_;
      skip();
      return *this;
    }
    bool operator==(const Iter& o) const { return p_ == o.p_; }
    bool operator!=(const Iter& o) const { return p_ != o.p_; }

   private:
    void skip() {
      while (p_ != end_ && p_->first.tag == kEmptyTag) ++p_;
    }
    S* p_;
    S* end_;
  };
  using iterator = Iter<Slot>;
  using const_iterator = Iter<const Slot>;

  iterator begin() { return iterator(slots_.data(), slots_.data() + slots_.size()); }
  iterator end() { return iterator(slots_.data() + slots_.size(), slots_.data() + slots_.size()); }
  const_iterator begin() const { return const_iterator(slots_.data(), slots_.data() + slots_.size()); }
  const_iterator end() const {
    return const_iterator(slots_.data() + slots_.size(), slots_.data() + slots_.size());
  }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  iterator find(const BlockKey& key) {
    std::size_t i = index_of(key);
    return i == kNone ? end() : iterator(slots_.data() + i, slots_.data() + slots_.size());
  }
  const_iterator find(const BlockKey& key) const {
    std::size_t i = index_of(key);
    return i == kNone ? end() : const_iterator(slots_.data() + i, slots_.data() + slots_.size());
  }
  std::size_t count(const BlockKey& key) const { return index_of(key) == kNone ? 0 : 1; }
  V& at(const BlockKey& key) { return slots_[checked(key)].second; }
  const V& at(const BlockKey& key) const { return slots_[checked(key)].second; }
  V& operator[](const BlockKey& key) { return emplace(key, V{}).first->second; }

  std::pair<iterator, bool> emplace(const BlockKey& key, V value) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    std::size_t i = home(key);
    while (slots_[i].first.tag != kEmptyTag) {
      if (slots_[i].first == key) return {iterator(slots_.data() + i, slots_.data() + slots_.size()), false};
      i = (i + 1) & mask_;
    }
    slots_[i].first = key;
    slots_[i].second = std::move(value);
    ++size_;
    return {iterator(slots_.data() + i, slots_.data() + slots_.size()), true};
  }

  std::size_t erase(const BlockKey& key) {
    std::size_t i = index_of(key);
    if (i == kNone) return 0;
    erase_at(i);
    return 1;
  }
  void erase(iterator it) { erase_at(static_cast<std::size_t>(&*it - slots_.data())); }

 private:
  static constexpr std::uint64_t kEmptyTag = ~0ULL;  // no key has it (see BlockKey)
  static constexpr std::size_t kNone = ~std::size_t{0};

  std::size_t home(const BlockKey& key) const { return BlockKeyHash()(key) & mask_; }

  std::size_t index_of(const BlockKey& key) const {
    if (size_ == 0) return kNone;
    std::size_t i = home(key);
    while (slots_[i].first.tag != kEmptyTag) {
      if (slots_[i].first == key) return i;
      i = (i + 1) & mask_;
    }
    return kNone;
  }

  std::size_t checked(const BlockKey& key) const {
    std::size_t i = index_of(key);
    if (i == kNone) throw std::out_of_range("KeyMap: no such key");
    return i;
  }

  void erase_at(std::size_t i) {
    for (std::size_t j = (i + 1) & mask_; slots_[j].first.tag != kEmptyTag; j = (j + 1) & mask_) {
      const std::size_t k = home(slots_[j].first);
      if (((j - k) & mask_) >= ((j - i) & mask_)) {  // j's home is not in (i, j]: it may move back to i
        slots_[i] = std::move(slots_[j]);
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
  }

  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.resize(old.empty() ? 16 : old.size() * 2);
    mask_ = slots_.size() - 1;
    size_ = 0;
    for (auto& s : old) {
      if (s.first.tag != kEmptyTag) emplace(s.first, std::move(s.second));
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
};
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
  // (order, key) by access, least recent first; an entry is live while its
  // order is the record's
  std::deque<std::pair<std::uint64_t, BlockKey>> order_;
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
  std::vector<Tier> tiers_;
  int landing_;
  HeatMirror heat_;
  std::vector<OptKey> protect_;                      // per tier, while making room
  KeyMap<Node> nodes_;                               // cached anywhere -> parent, size
  KeyMap<ChildList> children_;                       // cached parent -> cached children
  KeyMap<int> pins_;
  KeyMap<int> holds_;
  bool watching_ = false;
  std::vector<std::pair<bool, BlockKey>> events_;
};

}  // namespace ucm
