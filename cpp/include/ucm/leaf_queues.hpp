// Queue building blocks of the native policies: LeafQueues (the twin of
// ucm/placement/policies/leafqueue.py) and GhostList (an OrderedDict of key -> bytes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "ucm/block_key.hpp"
#include "ucm/heat_mirror.hpp"
#include "ucm/policy_core.hpp"

namespace ucm {

// ---- LeafQueues (ucm/placement/policies/leafqueue.py) ----------------------------------
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
  // Whether queue q has entries, live or stale (an upper bound of its
  // blocks): LeafQueues.nonempty() yields q when this holds as it reaches q.
  bool has_entries(int queue) const { return !heaps_[static_cast<std::size_t>(queue)].empty(); }

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

}  // namespace ucm
