// OPT, Belady's offline optimum: the twin of ucm/placement/policies/opt.py (trace
// replay only; it reads each block's next use from the HeatMirror, which
// record_request fills from the oracle).
//
// As there: the entries of `_far` (farthest next use first, then newest
// insertion) and `_due` (soonest finite next use first) with lazy
// invalidation, an entry live while it matches the block's insertion
// sequence and recorded next use, both rebuilt from the live entries when
// `far_` grows past 4 x residents + 64. Entries order totally by (next use,
// sequence) (a sequence is one insertion of one key; equal pairs are copies
// of one entry), so heapq pops them in that order whatever the heap's
// layout: `due_` is a binary heap of the same entries; `far_` is an ordered
// multiset that `victim` walks instead of popping and pushing back the
// entries it passes (parents of resident children, pinned blocks), erasing
// the stale ones as the pops drop them. The live entries of a block with
// resident children in this tier (which the core's strict predicate
// refuses: PolicyCore::leaf_victim) are set aside in `parked_`, in the same
// order, until its last child leaves or the entries go stale (then they
// return to `far_`, where the walks drop them as the pops would), so that
// leaf_victim does not walk past a long chain of parents at every call;
// `victim` (the relaxed fallback, which may take a parent) walks `far_` and
// `parked_` merged in their one order, as Python pops its one heap. The
// union of the two is Python's `_far`. Both hold exactly Python's entries:
// the same blocks are refreshed, the same victims chosen, the rebuilds fall
// on the same calls. Next uses stay doubles (INF: unknown or never again).
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <set>
#include <vector>

#include "ucm/policy_core.hpp"

namespace ucm {
namespace {

class OptPolicy : public PolicyCore {
 public:
  OptPolicy(const HeatMirror& heat, std::int64_t capacity, bool lowest)
      : heat_(heat), capacity_(capacity), lowest_(lowest) {}

  bool admit(const BlockKey& key, AdmissionKind why) override {
    if (why == AdmissionKind::kNew && !lowest_) return true;
    if (res_.empty() || used_ + block_ <= capacity_) return true;
    return heat_.next_use(key) < farthest();
  }

  void on_insert(const BlockKey& key, std::int64_t size) override {
    ++seq_;
    Resident& r = res_[key];
    if (r.parked) unpark(key, r);
    r.kids = false;  // the core reports the children it enters with (on_children)
    r.seq = seq_;
    r.size = size;
    used_ += size;
    block_ = size;
    push(key, heat_.next_use(key));
  }

  void on_hit(const BlockKey& key) override {
    auto it = res_.find(key);
    if (it == res_.end()) return;
    const double nu = heat_.next_use(key);
    if (nu != it->second.next) push(key, nu);
  }

  void on_remove(const BlockKey& key) override {
    auto it = res_.find(key);
    if (it == res_.end()) return;
    if (it->second.parked) unpark(key, it->second);  // stale from now on
    used_ -= it->second.size;
    res_.erase(it);
  }

  void on_children(const BlockKey& key, bool any) override {
    auto it = res_.find(key);
    if (it == res_.end()) return;
    it->second.kids = any;
    if (!any && it->second.parked) unpark(key, it->second);  // a candidate again, in its place
  }

  // Python pops `_far` in order until an evictable live entry, dropping
  // the stale ones and pushing back the rest: here a walk in order that
  // erases the stale entries it passes (the same entries remain). The
  // parked entries are live ones the predicate refuses (they have resident
  // children here), so the first entry it accepts is Python's; a refused
  // parent met on the way is parked.
  bool leaf_victim(const KeyPred& evictable, BlockKey* out) override {
    sync();
    for (auto it = far_.begin(); it != far_.end();) {
      Resident* r = live(*it);
      if (r == nullptr) {
        it = far_.erase(it);
        continue;
      }
      if (r->kids) {  // refused until its last child here leaves
        auto next = std::next(it);
        parked_.insert(far_.extract(it));
        r->parked = true;
        it = next;
        continue;
      }
      if (evictable(it->key)) {
        *out = it->key;  // stays valid until on_remove
        return true;
      }
      ++it;
    }
    return false;
  }

  // The same walk over `far_` and `parked_` merged (a predicate that may
  // accept a parent), parking nothing.
  bool victim(const KeyPred& evictable, BlockKey* out) override {
    sync();
    const FarOrder before;
    auto it = far_.begin();
    auto pt = parked_.begin();
    for (;;) {
      if (pt != parked_.end() && (it == far_.end() || before(*pt, *it))) {
        if (evictable(pt->key)) {  // parked entries are live
          *out = pt->key;
          return true;
        }
        ++pt;
        continue;
      }
      if (it == far_.end()) return false;
      if (live(*it) == nullptr) {
        it = far_.erase(it);
        continue;
      }
      if (evictable(it->key)) {
        *out = it->key;
        return true;
      }
      ++it;
    }
  }

 private:
  struct Entry {
    double nu;  // next use as pushed
    std::int64_t seq;
    BlockKey key;
  };
  struct Resident {
    std::int64_t seq = 0;  // insertion sequence
    double next = HeatMirror::kInf;  // next use as pushed
    std::int64_t size = 0;
    bool kids = false;    // has resident children in this tier (on_children)
    bool parked = false;  // its live entries are in `parked_`
  };
  using Heap = std::vector<Entry>;
  // `far_` in heapq's pop order of (-next use, -sequence, key): the largest
  // (next use, sequence) first; equal entries are copies of one entry.
  struct FarOrder {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.nu > b.nu || (a.nu == b.nu && a.seq > b.seq);
    }
  };
  // std heap comparator ("a after b") of `due_`: the smallest (next use, sequence) first.
  static bool due_first(const Entry& a, const Entry& b) { return a.nu > b.nu || (a.nu == b.nu && a.seq > b.seq); }

  template <class Cmp>
  static void push_entry(Heap& h, const Entry& e, Cmp cmp) {
    h.push_back(e);
    std::push_heap(h.begin(), h.end(), cmp);
  }
  template <class Cmp>
  static Entry pop(Heap& h, Cmp cmp) {
    std::pop_heap(h.begin(), h.end(), cmp);
    Entry e = h.back();
    h.pop_back();
    return e;
  }

  bool valid(const Entry& e) { return live(e) != nullptr; }
  // The resident block of a live entry, or nullptr (stale).
  Resident* live(const Entry& e) {
    auto it = res_.find(e.key);
    return it != res_.end() && it->second.seq == e.seq && it->second.next == e.nu ? &it->second : nullptr;
  }

  // Puts the parked entries of `key` (those matching r's sequence and next
  // use: copies of one entry) back into `far_`, live or about to go stale.
  void unpark(const BlockKey& key, Resident& r) {
    auto range = parked_.equal_range(Entry{r.next, r.seq, key});
    for (auto p = range.first; p != range.second;) {
      auto next = std::next(p);
      far_.insert(parked_.extract(p));
      p = next;
    }
    r.parked = false;
  }

  // OptPolicy._push; true if it rebuilt the heaps. `retired` (while _sync
  // walks `due_`): where the replaced due heap goes, as Python's _sync goes
  // on popping the list it started with after a rebuild swapped in another.
  bool push(const BlockKey& key, double nu, Heap* retired = nullptr) {
    Resident& r = res_.at(key);
    if (r.parked) unpark(key, r);  // stale from now on
    r.next = nu;
    far_.insert(far_.end(), Entry{nu, r.seq, key});
    if (nu != HeatMirror::kInf) push_entry(due_, Entry{nu, r.seq, key}, due_first);
    if (far_.size() + parked_.size() <= 4 * res_.size() + 64) return false;
    far_.clear();
    parked_.clear();
    Heap due;
    for (auto& kv : res_) {
      kv.second.parked = false;
      const Entry e{kv.second.next, kv.second.seq, kv.first};
      far_.insert(e);
      if (e.nu != HeatMirror::kInf) due.push_back(e);
    }
    std::make_heap(due.begin(), due.end(), due_first);
    if (retired != nullptr) *retired = std::move(due_);
    due_ = std::move(due);
    return true;
  }

  // OptPolicy._sync: refreshes every resident block whose recorded next use is past.
  void sync() {
    const double now = static_cast<double>(heat_.now());
    Heap kept;  // the due heap this walk started with, once a rebuild replaced it
    Heap* due = &due_;
    while (!due->empty() && due->front().nu <= now) {
      const Entry e = pop(*due, due_first);
      if (!valid(e)) continue;  // stale entry
      const double fresh = heat_.next_use(e.key);
      if (fresh == e.nu) continue;
      const bool walking_member = due == &due_;
      if (push(e.key, fresh, walking_member ? &kept : nullptr) && walking_member) due = &kept;
    }
  }

  // OptPolicy._farthest: the next use of the resident block used farthest in the future.
  // Python pops the stale entries until the first live one, which may be parked.
  double farthest() {
    sync();
    const FarOrder before;
    while (!far_.empty() && (parked_.empty() || before(*far_.begin(), *parked_.begin())) && !valid(*far_.begin())) {
      far_.erase(far_.begin());
    }
    if (far_.empty() && parked_.empty()) return -HeatMirror::kInf;
    if (far_.empty()) return parked_.begin()->nu;
    if (parked_.empty()) return far_.begin()->nu;
    return std::max(far_.begin()->nu, parked_.begin()->nu);
  }

  const HeatMirror& heat_;
  std::int64_t capacity_;
  bool lowest_;
  std::int64_t seq_ = 0;
  KeyMap<Resident> res_;
  std::multiset<Entry, FarOrder> far_;  // Python's heap `_far`, walked in its pop order, less `parked_`
  std::multiset<Entry, FarOrder> parked_;  // the live entries of blocks with resident children here
  Heap due_;
  std::int64_t used_ = 0;
  std::int64_t block_ = 0;  // bytes of the last block stored; admission estimates room with it
};

}  // namespace

std::unique_ptr<PolicyCore> make_opt_policy(const PolicyContext& ctx) {
  return std::make_unique<OptPolicy>(ctx.heat, ctx.capacity_bytes, ctx.lowest);
}

}  // namespace ucm
