// The classic native policies (twins of ucm/placement/policies/classic.py, arc.py,
// s3fifo.py) and the table of every native policy by name (the others in
// cpp/src/policy_<name>.cpp).
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ucm/leaf_queues.hpp"
#include "ucm/policy_core.hpp"

namespace ucm {
namespace {

// ---- classic.py ------------------------------------------------------------
class LruPolicy : public PolicyCore {
 public:
  LruPolicy(const HeatMirror& heat, bool reorder) : queue_(heat, 1), reorder_(reorder) {}
  void on_insert(const BlockKey& key, std::int64_t) override { queue_.add(key, 0, ++seq_); }
  void on_hit(const BlockKey& key) override {
    if (reorder_ && queue_.contains(key)) queue_.update(key, 0, ++seq_);
  }
  void on_copied_up(const BlockKey& key) override { on_hit(key); }  // lru: a use of this copy (FIFO: none)
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

struct PolicyRow {
  const char* name;
  PolicyMaker make;
};

// Every native policy: its name in the `ucm.policies` entry points, its maker.
const PolicyRow kPolicies[] = {
    {"lru", make_lru_policy},   {"fifo", make_fifo_policy},     {"lfu", make_lfu_policy},
    {"arc", make_arc_policy},   {"s3fifo", make_s3fifo_policy}, {"tinylfu", make_tinylfu_policy},
    {"heat", make_heat_policy}, {"opt", make_opt_policy},
};

}  // namespace

std::unique_ptr<PolicyCore> make_lru_policy(const PolicyContext& ctx) {
  return std::make_unique<LruPolicy>(ctx.heat, true);
}
std::unique_ptr<PolicyCore> make_fifo_policy(const PolicyContext& ctx) {
  return std::make_unique<LruPolicy>(ctx.heat, false);
}
std::unique_ptr<PolicyCore> make_lfu_policy(const PolicyContext& ctx) { return std::make_unique<LfuPolicy>(ctx.heat); }
std::unique_ptr<PolicyCore> make_arc_policy(const PolicyContext& ctx) {
  return std::make_unique<ArcPolicy>(ctx.heat, ctx.capacity_bytes);
}
std::unique_ptr<PolicyCore> make_s3fifo_policy(const PolicyContext& ctx) {
  return std::make_unique<S3FifoPolicy>(ctx.heat, ctx.capacity_bytes);
}

PolicyMaker policy_maker(const std::string& name) {
  for (const auto& row : kPolicies) {
    if (name == row.name) return row.make;
  }
  return nullptr;
}

std::vector<std::string> native_policy_names() {
  std::vector<std::string> out;
  for (const auto& row : kPolicies) out.emplace_back(row.name);
  return out;
}

}  // namespace ucm
