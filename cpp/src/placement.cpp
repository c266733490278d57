// The placement core and its native policies; the Python twins are
// ucm/placement.py, ucm/policy/leafqueue.py, classic.py, arc.py, s3fifo.py.
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

// ---- HeatMirror --------------------------------------------------------------

void HeatMirror::touch(const BlockKey& key, const BlockKey* parent) {
  auto it = records_.find(key);
  if (it == records_.end()) {
    if (records_.size() >= capacity_) {  // forget the least recently accessed
      for (;;) {
        auto [order, old] = order_.front();
        order_.pop_front();
        auto r = records_.find(old);
        if (r != records_.end() && r->second.order == order) {
          records_.erase(r);
          break;
        }
      }
    }
    it = records_.emplace(key, Record{std::nullopt, 0}).first;
  }
  it->second.order = next_order_;
  if (parent != nullptr) it->second.parent = *parent;
  order_.emplace_back(next_order_++, key);
  if (order_.size() > 1024 + 2 * records_.size()) {  // mostly stale: keep the live entries, in order
    std::deque<std::pair<std::uint64_t, BlockKey>> live;
    for (auto& entry : order_) {
      auto r = records_.find(entry.second);
      if (r != records_.end() && r->second.order == entry.first) live.push_back(entry);
    }
    order_.swap(live);
  }
}

const BlockKey* HeatMirror::parent(const BlockKey& key) const {
  auto it = records_.find(key);
  if (it == records_.end() || !it->second.parent) return nullptr;
  return &*it->second.parent;
}

namespace {

// ---- LeafQueues (ucm/policy/leafqueue.py) ----------------------------------
// As there: a min-heap of (priority, key) per queue with lazy invalidation
// (an entry is live while it matches the block's current queue and
// priority and the block is not parked); a parent that fails the predicate
// while it has resident children here is parked (in park order) until its
// last child leaves or `wake`. The policies' priorities never tie, so the
// order the heaps give is the Python one.
template <class Prio>
class LeafQueues {
 public:
  LeafQueues(const HeatMirror& heat, int queues) : heat_(heat), heaps_(static_cast<std::size_t>(queues)) {}

  std::size_t size() const { return where_.size(); }
  bool contains(const BlockKey& key) const { return where_.count(key) != 0; }
  int queue_of(const BlockKey& key) const {
    auto it = where_.find(key);
    return it == where_.end() ? -1 : it->second.queue;
  }

  void add(const BlockKey& key, int queue, const Prio& prio) {
    if (where_.count(key) != 0) {
      update(key, queue, prio);
      return;
    }
    Entry e{queue, prio, std::nullopt, 0};
    if (const BlockKey* parent = heat_.parent(key)) {
      e.parent = *parent;
      ++kids_[*parent];
    }
    where_.emplace(key, std::move(e));
    push(key, queue, prio);
  }

  void update(const BlockKey& key, int queue, const Prio& prio) {
    auto it = where_.find(key);
    if (it == where_.end()) return;
    it->second.queue = queue;
    it->second.prio = prio;
    if (it->second.parked == 0) push(key, queue, prio);
  }

  void wake(const BlockKey& key) {
    auto it = where_.find(key);
    if (it != where_.end() && it->second.parked != 0) unpark(key, it->second);
  }

  void remove(const BlockKey& key) {
    auto it = where_.find(key);
    if (it == where_.end()) return;
    if (it->second.parked != 0) parked_.erase(it->second.parked);
    OptKey parent = std::move(it->second.parent);
    where_.erase(it);
    if (!parent) return;
    auto k = kids_.find(*parent);
    if (k != kids_.end() && --k->second == 0) {
      kids_.erase(k);
      auto p = where_.find(*parent);
      if (p != where_.end() && p->second.parked != 0) unpark(*parent, p->second);  // a candidate again
    }
  }

  // The lowest block of `queue` passing `pred`, left in place; false if none.
  bool head(int queue, const KeyPred& pred, BlockKey* out, Prio* prio = nullptr) {
    auto& heap = heaps_[static_cast<std::size_t>(queue)];
    skipped_.clear();
    bool found = false;
    while (!heap.empty()) {
      const Item& top = heap.front();
      auto w = where_.find(top.second);
      if (w == where_.end() || w->second.queue != queue || !(w->second.prio == top.first) || w->second.parked != 0) {
        pop(heap);  // stale
        continue;
      }
      if (pred(top.second)) {
        *out = top.second;
        if (prio != nullptr) *prio = top.first;
        found = true;
        break;
      }
      if (kids_.count(top.second) != 0) {
        w->second.parked = ++park_seq_;  // back when its last child leaves
        parked_.emplace(park_seq_, top.second);
        pop(heap);
      } else {
        skipped_.push_back(top);
        pop(heap);
      }
    }
    for (auto& item : skipped_) {
      heap.push_back(std::move(item));
      std::push_heap(heap.begin(), heap.end(), Later());
    }
    return found;
  }

  bool fallback(const KeyPred& pred, BlockKey* out) const {
    for (const auto& [seq, key] : parked_) {
      if (pred(key)) {
        *out = key;
        return true;
      }
    }
    return false;
  }

 private:
  struct Entry {
    int queue;
    Prio prio;
    OptKey parent;
    std::uint64_t parked;  // 0: in its queue, else its park order
  };
  using Item = std::pair<Prio, BlockKey>;
  struct Later {  // std::push_heap keeps the greatest first: invert for a min-heap
    bool operator()(const Item& a, const Item& b) const {
      if (a.first < b.first) return false;
      if (b.first < a.first) return true;
      return b.second < a.second;
    }
  };

  static void pop(std::vector<Item>& heap) {
    std::pop_heap(heap.begin(), heap.end(), Later());
    heap.pop_back();
  }

  void unpark(const BlockKey& key, Entry& e) {
    parked_.erase(e.parked);
    e.parked = 0;
    push(key, e.queue, e.prio);
  }

  void push(const BlockKey& key, int queue, const Prio& prio) {
    auto& heap = heaps_[static_cast<std::size_t>(queue)];
    heap.emplace_back(prio, key);
    std::push_heap(heap.begin(), heap.end(), Later());
    if (heap.size() > 64 + 4 * where_.size()) {  // mostly stale: rebuild from the live entries
      heap.clear();
      for (const auto& kv : where_) {
        if (kv.second.queue == queue && kv.second.parked == 0) heap.emplace_back(kv.second.prio, kv.first);
      }
      std::make_heap(heap.begin(), heap.end(), Later());
    }
  }

  const HeatMirror& heat_;
  std::vector<std::vector<Item>> heaps_;
  std::vector<Item> skipped_;
  KeyMap<Entry> where_;
  KeyMap<int> kids_;  // parent -> its resident children here
  std::map<std::uint64_t, BlockKey> parked_;
  std::uint64_t park_seq_ = 0;
};

// An insertion-ordered map of key -> bytes (Python's OrderedDict as the
// ghosts use it): a queue of (order, key) with lazy invalidation.
class GhostList {
 public:
  bool contains(const BlockKey& key) const { return at_.count(key) != 0; }
  bool empty() const { return at_.empty(); }
  // Removes `key`, returning its bytes.
  std::int64_t pop(const BlockKey& key) {
    auto it = at_.find(key);
    std::int64_t size = it->second.second;
    at_.erase(it);
    return size;
  }
  void put(const BlockKey& key, std::int64_t size) {
    auto it = at_.find(key);
    if (it != at_.end()) {  // keeps its place, as an OrderedDict does
      it->second.second = size;
      return;
    }
    order_.emplace_back(next_, key);
    at_.emplace(key, std::make_pair(next_++, size));
    if (order_.size() > 64 + 2 * at_.size()) compact();
  }
  std::int64_t pop_oldest() {
    for (;;) {
      auto& [seq, key] = order_.front();
      auto it = at_.find(key);
      if (it != at_.end() && it->second.first == seq) {
        std::int64_t size = it->second.second;
        at_.erase(it);
        order_.pop_front();
        return size;
      }
      order_.pop_front();  // stale
    }
  }

 private:
  void compact() {
    std::deque<std::pair<std::uint64_t, BlockKey>> live;
    for (auto& entry : order_) {
      auto it = at_.find(entry.second);
      if (it != at_.end() && it->second.first == entry.first) live.push_back(entry);
    }
    order_.swap(live);
  }

  std::deque<std::pair<std::uint64_t, BlockKey>> order_;
  KeyMap<std::pair<std::uint64_t, std::int64_t>> at_;  // key -> (order, bytes)
  std::uint64_t next_ = 0;
};

// ---- classic.py ------------------------------------------------------------
class LruPolicy : public PolicyCore {
 public:
  LruPolicy(const HeatMirror& heat, bool reorder) : queue_(heat, 1), reorder_(reorder) {}
  void on_insert(const BlockKey& key, std::int64_t) override { queue_.add(key, 0, ++seq_); }
  void on_hit(const BlockKey& key) override {
    if (reorder_ && queue_.contains(key)) queue_.update(key, 0, ++seq_);
  }
  void on_remove(const BlockKey& key) override { queue_.remove(key); }
  bool victim(const KeyPred& evictable, BlockKey* out) override {
    return queue_.head(0, evictable, out) || queue_.fallback(evictable, out);
  }

 private:
  LeafQueues<std::int64_t> queue_;
  bool reorder_;  // false: FIFO
  std::int64_t seq_ = 0;
};

class LfuPolicy : public PolicyCore {
 public:
  explicit LfuPolicy(const HeatMirror& heat) : queue_(heat, 1) {}
  void on_insert(const BlockKey& key, std::int64_t) override {
    ++seq_;
    hits_[key] = 0;
    queue_.add(key, 0, {age_, seq_});
  }
  void on_hit(const BlockKey& key) override {
    auto it = hits_.find(key);
    if (it == hits_.end()) return;
    std::int64_t n = it->second;
    it->second = n + 1;
    ++seq_;
    queue_.update(key, 0, {age_ + static_cast<double>(n) + 1.0, seq_});
  }
  void on_remove(const BlockKey& key) override {
    queue_.remove(key);
    hits_.erase(key);
  }
  bool victim(const KeyPred& evictable, BlockKey* out) override {
    std::pair<double, std::int64_t> prio;
    if (!queue_.head(0, evictable, out, &prio)) return queue_.fallback(evictable, out);
    age_ = prio.first;
    return true;
  }

 private:
  LeafQueues<std::pair<double, std::int64_t>> queue_;
  double age_ = 0.0;
  std::int64_t seq_ = 0;
  KeyMap<std::int64_t> hits_;
};

// ---- arc.py ------------------------------------------------------------------
class ArcPolicy : public PolicyCore {
 public:
  ArcPolicy(const HeatMirror& heat, std::int64_t capacity) : heat_(heat), c_(capacity), lists_(heat, 2) {}

  void on_insert(const BlockKey& key, std::int64_t size) override {
    int lst = kT1;
    if (b1_.contains(key)) {
      double ratio = std::max(1.0, static_cast<double>(bb_[1]) / static_cast<double>(std::max<std::int64_t>(1, bb_[0])));
      p_ = std::min(static_cast<double>(c_), p_ + ratio * static_cast<double>(size));
      bb_[0] -= b1_.pop(key);
      lst = kT2;
    } else if (b2_.contains(key)) {
      double ratio = std::max(1.0, static_cast<double>(bb_[0]) / static_cast<double>(std::max<std::int64_t>(1, bb_[1])));
      p_ = std::max(0.0, p_ - ratio * static_cast<double>(size));
      bb_[1] -= b2_.pop(key);
      lst = kT2;
    }
    ++seq_;
    meta_[key] = Meta{size, heat_.now()};
    tb_[lst] += size;
    lists_.add(key, lst, seq_);
    trim_ghosts();
  }

  void on_hit(const BlockKey& key) override {
    int lst = lists_.queue_of(key);
    if (lst < 0) return;
    auto m = meta_.find(key);
    if (lst == kT1 && m != meta_.end() && m->second.born == heat_.now()) {
      place(key, kT1);  // the storing access itself
    } else {
      place(key, kT2);
    }
  }

  void on_remove(const BlockKey& key) override {
    int lst = lists_.queue_of(key);
    if (lst < 0) return;
    lists_.remove(key);
    auto m = meta_.find(key);
    std::int64_t size = m->second.size;
    meta_.erase(m);
    tb_[lst] -= size;
    (lst == kT1 ? b1_ : b2_).put(key, size);
    bb_[lst] += size;
    trim_ghosts();
  }

  bool victim(const KeyPred& evictable, BlockKey* out) override {
    int first = kT1, second = kT2;
    if (tb_[kT1] == 0 || (tb_[kT2] != 0 && static_cast<double>(tb_[kT1]) <= p_)) std::swap(first, second);
    return lists_.head(first, evictable, out) || lists_.head(second, evictable, out) ||
           lists_.fallback(evictable, out);
  }

 private:
  static constexpr int kT1 = 0, kT2 = 1;

  void place(const BlockKey& key, int lst) {
    ++seq_;
    int old = lists_.queue_of(key);
    if (old >= 0 && old != lst) {
      std::int64_t size = meta_.at(key).size;
      tb_[old] -= size;
      tb_[lst] += size;
    }
    lists_.update(key, lst, seq_);
  }

  void trim_ghosts() {
    while (!b1_.empty() && tb_[0] + bb_[0] > c_) bb_[0] -= b1_.pop_oldest();
    while (!b2_.empty() && tb_[0] + tb_[1] + bb_[0] + bb_[1] > 2 * c_) bb_[1] -= b2_.pop_oldest();
  }

  const HeatMirror& heat_;
  std::int64_t c_;
  double p_ = 0.0;
  LeafQueues<std::int64_t> lists_;
  std::int64_t seq_ = 0;
  struct Meta {  // a resident block: bytes, clock of its insertion
    std::int64_t size;
    std::int64_t born;
  };
  KeyMap<Meta> meta_;
  std::int64_t tb_[2] = {0, 0};
  GhostList b1_, b2_;
  std::int64_t bb_[2] = {0, 0};
};

// ---- s3fifo.py ---------------------------------------------------------------
class S3FifoPolicy : public PolicyCore {
 public:
  S3FifoPolicy(const HeatMirror& heat, std::int64_t capacity)
      : heat_(heat),
        small_cap_(0.1 * static_cast<double>(capacity)),
        ghost_cap_(static_cast<double>(capacity) - small_cap_),
        queues_(heat, 2) {}

  void on_insert(const BlockKey& key, std::int64_t size) override {
    if (g_.contains(key)) {
      g_bytes_ -= g_.pop(key);
      enqueue(key, kM);
    } else {
      enqueue(key, kS);
      s_bytes_ += size;
      ++s_count_;
    }
    meta_[key] = Meta{size, 0, heat_.now()};
  }

  void on_hit(const BlockKey& key) override {
    auto m = meta_.find(key);
    if (m == meta_.end() || m->second.born == heat_.now() || m->second.freq >= kMaxFreq) return;
    if (m->second.freq++ == 0) queues_.wake(key);  // now due to move on even if it cannot go
  }

  void on_remove(const BlockKey& key) override {
    int q = queues_.queue_of(key);
    if (q < 0) return;
    queues_.remove(key);
    auto m = meta_.find(key);
    std::int64_t size = m->second.size;
    meta_.erase(m);
    if (q == kS) {
      s_bytes_ -= size;
      --s_count_;
      g_.put(key, size);
      g_bytes_ += size;
      while (static_cast<double>(g_bytes_) > ghost_cap_ && !g_.empty()) g_bytes_ -= g_.pop_oldest();
    }
  }

  bool victim(const KeyPred& evictable, BlockKey* out) override {
    KeyPred candidate = [this, &evictable](const BlockKey& key) {  // due for a decision: to move on, or to go
      return meta_.at(key).freq > 0 || evictable(key);
    };
    BlockKey key;
    for (int round = 0; round < kMaxFreq + 2; ++round) {
      if (static_cast<double>(s_bytes_) >= small_cap_ || static_cast<std::int64_t>(meta_.size()) == s_count_) {
        while (queues_.head(kS, candidate, &key)) {
          Meta& m = meta_.at(key);
          if (m.freq == 0) {
            *out = key;
            return true;
          }
          enqueue(key, kM);  // accessed again while in S: on to M
          s_bytes_ -= m.size;
          --s_count_;
          m.freq = 0;
        }
      }
      while (queues_.head(kM, candidate, &key)) {
        Meta& m = meta_.at(key);
        if (m.freq == 0) {
          *out = key;
          return true;
        }
        --m.freq;
        enqueue(key, kM);  // second chance
      }
      if (queues_.head(kS, evictable, out)) return true;
    }
    return queues_.fallback(evictable, out);
  }

 private:
  static constexpr int kS = 0, kM = 1;
  static constexpr std::int64_t kMaxFreq = 3;

  void enqueue(const BlockKey& key, int q) {
    ++seq_;
    if (queues_.contains(key)) {
      queues_.update(key, q, seq_);
    } else {
      queues_.add(key, q, seq_);
    }
  }

  const HeatMirror& heat_;
  double small_cap_;
  double ghost_cap_;
  LeafQueues<std::int64_t> queues_;
  std::int64_t seq_ = 0;
  struct Meta {  // a resident block: bytes, accesses (capped), clock of its insertion
    std::int64_t size;
    std::int64_t freq;
    std::int64_t born;
  };
  KeyMap<Meta> meta_;
  std::int64_t s_bytes_ = 0;
  std::int64_t s_count_ = 0;
  GhostList g_;
  std::int64_t g_bytes_ = 0;
};

std::unique_ptr<PolicyCore> make_policy(PolicyKind kind, const HeatMirror& heat, std::int64_t capacity) {
  switch (kind) {
    case PolicyKind::kLru:
      return std::make_unique<LruPolicy>(heat, true);
    case PolicyKind::kFifo:
      return std::make_unique<LruPolicy>(heat, false);
    case PolicyKind::kLfu:
      return std::make_unique<LfuPolicy>(heat);
    case PolicyKind::kArc:
      return std::make_unique<ArcPolicy>(heat, capacity);
    case PolicyKind::kS3Fifo:
      return std::make_unique<S3FifoPolicy>(heat, capacity);
  }
  throw std::invalid_argument("unknown policy kind");
}

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

bool policy_kind_of(const std::string& name, PolicyKind* out) {
  static const std::pair<const char*, PolicyKind> kinds[] = {
      {"lru", PolicyKind::kLru}, {"fifo", PolicyKind::kFifo}, {"lfu", PolicyKind::kLfu},
      {"arc", PolicyKind::kArc}, {"s3fifo", PolicyKind::kS3Fifo}};
  for (const auto& [n, k] : kinds) {
    if (name == n) {
      *out = k;
      return true;
    }
  }
  return false;
}

// ---- PlacementCore -------------------------------------------------------------

PlacementCore::PlacementCore(const std::vector<TierSetup>& tiers, PolicyKind policy, std::size_t history_blocks,
                             int landing)
    : landing_(landing), heat_(history_blocks) {
  if (tiers.empty()) throw std::invalid_argument("placement needs at least one tier");
  if (tiers.size() > static_cast<std::size_t>(kMaxTiers)) {
    throw std::invalid_argument("placement takes at most " + std::to_string(kMaxTiers) + " tiers");
  }
  if (landing < 0 || landing >= static_cast<int>(tiers.size())) {
    throw std::invalid_argument("landing tier index " + std::to_string(landing) + " outside 0.." +
                                std::to_string(tiers.size() - 1));
  }
  if (history_blocks < 1) throw std::invalid_argument("history_blocks must be >= 1");
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
    tier.policy = make_policy(policy, heat_, tier.capacity);
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

void PlacementCore::record_request(const std::vector<BlockKey>& keys, const BlockKey* parent) {
  heat_.tick();
  for (std::size_t i = keys.size(); i-- > 1;) heat_.touch(keys[i], &keys[i - 1]);
  if (!keys.empty()) heat_.touch(keys[0], parent);
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
      found = tier.policy->victim([&](const BlockKey& k) { return named.count(k) != 0 && evictable(t, k); }, &victim);
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
  if (node.parent) {
    auto p = nodes_.find(*node.parent);
    if (p != nodes_.end() && (p->second.mask & tier.bit)) ++p->second.kids[t];
  }
  tier.policy->on_insert(key, size);
}

void PlacementCore::leave(const BlockKey& key, int t) {
  Tier& tier = tiers_[static_cast<std::size_t>(t)];
  Node& node = nodes_.at(key);
  tier.used -= node.size;
  --tier.count;
  node.mask &= ~tier.bit;
  node.kids[t] = 0;
  if (node.parent) {
    auto p = nodes_.find(*node.parent);
    if (p != nodes_.end() && (p->second.mask & tier.bit)) --p->second.kids[t];
  }
  tier.policy->on_remove(key);
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
    bool found = tier.policy->victim(evictable_here, &victim);
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
  while (!stack.empty()) {  // depth first, as ucm/placement.py walks them
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
