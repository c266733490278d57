// The native heat policy: the twin of ucm/placement/policies/heat.py (values from the
// ReuseModel of cpp/src/reuse_model.cpp, one queue per class in LeafQueues).
#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <utility>

#include "ucm/leaf_queues.hpp"
#include "ucm/policy_core.hpp"
#include "ucm/reuse_model.hpp"

namespace ucm {
namespace {

class HeatPolicy : public PolicyCore {
 public:
  explicit HeatPolicy(const PolicyContext& ctx)
      : heat_(ctx.heat),
        model_(ctx.heat.shared<ReuseModel>()),
        queues_(ctx.heat, reuse::kClasses),
        capacity_(ctx.capacity_bytes),
        lowest_(ctx.lowest) {}

  bool admit(const BlockKey& key, AdmissionKind why) override {
    if (sizes_.empty() || used_ + block_ <= capacity_) return true;
    if (why == AdmissionKind::kNew && !lowest_) return true;
    Low low;
    if (!lowest(always_, &low)) return true;
    return value(heat_.slot(key)) >= low.value;  // lowest() read the table
  }

  void on_insert(const BlockKey& key, std::int64_t size) override {
    if (queues_.contains(key)) on_remove(key);
    ++seq_;
    const int s = heat_.slot(key);
    if (s < 0) {
      queues_.add(key, 0, {-1, seq_});
    } else {
      queues_.add(key, reuse::class_of(heat_, s), {heat_.last(s), seq_});
    }
    sizes_[key] = size;
    used_ += size;
    block_ = size;
    ++inserts_;
    if (first_tick_ < 0) first_tick_ = heat_.now();
  }

  void on_hit(const BlockKey& key) override {
    if (queues_.contains(key)) requeue(key);
  }

  void on_reclass(const BlockKey& key) override {
    if (queues_.contains(key)) requeue(key);
  }

  void on_remove(const BlockKey& key) override {
    queues_.remove(key);
    auto it = sizes_.find(key);
    if (it != sizes_.end()) {
      used_ -= it->second;
      sizes_.erase(it);
    }
  }

  bool victim(const KeyPred& evictable, BlockKey* out) override {
    Low low;
    if (!lowest(evictable, &low)) return queues_.fallback(evictable, out);
    *out = low.key;
    return true;
  }

 private:
  using Prio = std::pair<std::int64_t, std::int64_t>;  // (clock of the last access as queued, report order)
  struct Low {
    double value;
    Prio prio;
    BlockKey key;
  };

  // _densities: the table over the residence at the first call after a tick,
  // from the model's hazards as cached then. Its cells are computed when
  // first read (reuse_density_at: the numbers the whole table would hold).
  void densities() {
    if (!have_table_ || model_.version() != table_version_) {
      hazard_ = model_.hazard();
      horizon_ = std::max(1.0, residence());
      table_version_ = model_.version();
      have_table_ = true;
      ++table_epoch_;
    }
  }

  double density(int c, int j) {
    const auto i = static_cast<std::size_t>(c * reuse::kAgeBuckets + j);
    if (cell_epoch_[i] != table_epoch_) {
      table_[i] = reuse_density_at(hazard_.data() + c * reuse::kAgeBuckets, horizon_, j);
      cell_epoch_[i] = table_epoch_;
    }
    return table_[i];
  }

  // _residence: mean ticks a block stays in this tier (Little's law). Python
  // divides the exact integer product, correctly rounded; the same here while
  // the product and the count stay below 2**53.
  double residence() const {
    if (inserts_ == 0) return 1.0;
    const std::int64_t ticks = heat_.now() - first_tick_ + 1;
    const std::int64_t blocks = static_cast<std::int64_t>(sizes_.size());
    return std::max(1.0, static_cast<double>(blocks * ticks) / static_cast<double>(inserts_));
  }

  // _value of the block in record slot s (-1: none), read after densities().
  double value(int s) {
    if (s < 0) return 0.0;
    return density(reuse::class_of(heat_, s), reuse::age_bucket(heat_.now() - heat_.last(s)));
  }

  void requeue(const BlockKey& key) { requeue(key, heat_.slot(key)); }
  void requeue(const BlockKey& key, int s) {
    ++seq_;
    if (s < 0) {
      queues_.update(key, 0, {-1, seq_});
    } else {
      queues_.update(key, reuse::class_of(heat_, s), {heat_.last(s), seq_});
    }
  }

  // _lowest: the evictable block of lowest value among the oldest of each class.
  bool lowest(const KeyPred& evictable, Low* best) {
    densities();
    bool found = false;
    BlockKey key;
    Prio prio;
    for (int q = 0; q < reuse::kClasses; ++q) {
      if (!queues_.has_entries(q)) continue;  // checked when the loop reaches it, as nonempty()
      while (queues_.head(q, evictable, &key, &prio)) {
        const int s = heat_.slot(key);
        if (s >= 0 && (heat_.last(s) != prio.first || reuse::class_of(heat_, s) != q)) {
          requeue(key, s);  // accessed since it was queued (or its class moved): look again
          continue;
        }
        const double v = value(s);
        if (!found || v < best->value || (v == best->value && prio < best->prio)) {
          *best = Low{v, prio, key};
          found = true;
        }
        break;
      }
    }
    return found;
  }

  HeatMirror& heat_;
  ReuseModel& model_;
  LeafQueues<Prio> queues_;
  std::int64_t capacity_;
  bool lowest_;
  std::int64_t seq_ = 0;
  KeyMap<std::int64_t> sizes_;
  std::int64_t used_ = 0;
  std::int64_t block_ = 0;    // bytes of the last block stored; admission estimates room with it
  std::int64_t inserts_ = 0;  // blocks stored since the first one
  std::int64_t first_tick_ = -1;
  bool have_table_ = false;
  std::uint64_t table_version_ = 0;
  reuse::Table hazard_{};  // the model's, as of the table's version
  double horizon_ = 1.0;
  reuse::Table table_{};
  std::array<std::uint64_t, reuse::kCells> cell_epoch_{};  // table_epoch_: table_[i] is computed
  std::uint64_t table_epoch_ = 0;
  const KeyPred always_ = [](const BlockKey&) { return true; };
};

}  // namespace

std::unique_ptr<PolicyCore> make_heat_policy(const PolicyContext& ctx) { return std::make_unique<HeatPolicy>(ctx); }

}  // namespace ucm
