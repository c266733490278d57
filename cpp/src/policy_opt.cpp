// OPT, Belady's offline optimum: the twin of ucm/policy/opt.py (trace
// replay only; it reads each block's next use from the HeatMirror, which
// record_request fills from the oracle).
//
// As there: two binary heaps with lazy invalidation, `far_` (farthest next
// use first, then newest insertion) and `due_` (soonest finite next use
// first), an entry live while it matches the block's insertion sequence and
// recorded next use, both rebuilt from the live entries when `far_` grows
// past 4 x residents + 64. Entries order totally by (next use, sequence)
// (a sequence is one insertion of one key; equal pairs are copies of one
// entry), so the heaps pop in the order Python's heapq pops its tuples
// whatever their layout, and they hold the same entries: the same blocks
// are refreshed, the same victims chosen, the rebuilds fall on the same
// calls. Next uses stay doubles (INF: unknown or never again).
#include <algorithm>
#include <cstdint>
#include <memory>
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
    used_ -= it->second.size;
    res_.erase(it);
  }

  bool victim(const KeyPred& evictable, BlockKey* out) override {
    sync();
    skipped_.clear();
    bool found = false;
    while (!far_.empty()) {
      const Entry e = pop(far_, far_first);
      if (!valid(e)) continue;
      if (evictable(e.key)) {
        *out = e.key;
        found = true;
        push_entry(far_, e, far_first);  // stays valid until on_remove
        break;
      }
      skipped_.push_back(e);
    }
    for (const Entry& e : skipped_) push_entry(far_, e, far_first);
    return found;
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
  };
  using Heap = std::vector<Entry>;
  // std heap comparators ("a after b"): `far_` pops the largest (next use,
  // sequence), as heapq pops the smallest (-next use, -sequence, key);
  // `due_` the smallest (next use, sequence).
  static bool far_first(const Entry& a, const Entry& b) { return a.nu < b.nu || (a.nu == b.nu && a.seq < b.seq); }
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

  bool valid(const Entry& e) const {
    auto it = res_.find(e.key);
    return it != res_.end() && it->second.seq == e.seq && it->second.next == e.nu;
  }

  // OptPolicy._push; true if it rebuilt the heaps. `retired` (while _sync
  // walks `due_`): where the replaced due heap goes, as Python's _sync goes
  // on popping the list it started with after a rebuild swapped in another.
  bool push(const BlockKey& key, double nu, Heap* retired = nullptr) {
    Resident& r = res_.at(key);
    r.next = nu;
    push_entry(far_, Entry{nu, r.seq, key}, far_first);
    if (nu != HeatMirror::kInf) push_entry(due_, Entry{nu, r.seq, key}, due_first);
    if (far_.size() <= 4 * res_.size() + 64) return false;
    far_.clear();
    Heap due;
    for (const auto& kv : res_) {
      const Entry e{kv.second.next, kv.second.seq, kv.first};
      far_.push_back(e);
      if (e.nu != HeatMirror::kInf) due.push_back(e);
    }
    std::make_heap(far_.begin(), far_.end(), far_first);
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
  double farthest() {
    sync();
    while (!far_.empty() && !valid(far_.front())) pop(far_, far_first);
    return far_.empty() ? -HeatMirror::kInf : far_.front().nu;
  }

  const HeatMirror& heat_;
  std::int64_t capacity_;
  bool lowest_;
  std::int64_t seq_ = 0;
  KeyMap<Resident> res_;
  Heap far_;
  Heap due_;
  Heap skipped_;  // victim's scratch
  std::int64_t used_ = 0;
  std::int64_t block_ = 0;  // bytes of the last block stored; admission estimates room with it
};

}  // namespace

std::unique_ptr<PolicyCore> make_opt_policy(const PolicyContext& ctx) {
  return std::make_unique<OptPolicy>(ctx.heat, ctx.capacity_bytes, ctx.lowest);
}

}  // namespace ucm
