// The twin of ucm/placement/policies/tinylfu.py: W-TinyLFU, an LRU window in front of a
// segmented LRU main area (probation, protected) with a count-min sketch
// deciding the window -> main contest, and the window's share climbing the
// hill as Caffeine does. Every step as there, in the same order: the same
// sketch slots (the key's first 16 bytes, splitmix64 with four seeds), the
// same halving, the same double arithmetic for the shares.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ucm/leaf_queues.hpp"
#include "ucm/policy_core.hpp"

namespace ucm {
namespace {

constexpr int kRows = 4;
constexpr std::uint8_t kCounterMax = 15;
constexpr std::int64_t kSampleFactor = 10;
constexpr std::uint64_t kSeeds[kRows] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                                         0xD6E8FEB86659FD93ULL};

constexpr double kWindowFraction = 0.01;
constexpr double kClimbStep = 0.0625;
constexpr double kClimbDecay = 0.98;
constexpr double kProtectedFraction = 0.8;

// _mix: the splitmix64 finaliser.
inline std::uint64_t mix(std::uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// FrequencySketch: count-min with conservative update and halving.
class FrequencySketch {
 public:
  explicit FrequencySketch(std::int64_t blocks) {
    std::uint64_t width = 1;
    while (width < static_cast<std::uint64_t>(std::max<std::int64_t>(16, blocks))) width <<= 1;
    mask_ = width - 1;
    width_ = static_cast<std::size_t>(width);
    table_.assign(width_ * kRows, 0);
    sample = kSampleFactor * std::max<std::int64_t>(1, blocks);
  }

  // x: the key's first 8 bytes (LE) XOR its next 8 (FrequencySketch._slots).
  int estimate(std::uint64_t x) const {
    std::size_t slots[kRows];
    fill(x, slots);
    std::uint8_t low = table_[slots[0]];
    for (int r = 1; r < kRows; ++r) low = std::min(low, table_[slots[r]]);
    return low;
  }

  void add(std::uint64_t x) {
    std::size_t slots[kRows];
    fill(x, slots);
    std::uint8_t low = table_[slots[0]];
    for (int r = 1; r < kRows; ++r) low = std::min(low, table_[slots[r]]);
    if (low < kCounterMax) {
      for (int r = 0; r < kRows; ++r) {  // conservative update
        if (table_[slots[r]] == low) table_[slots[r]] = static_cast<std::uint8_t>(low + 1);
      }
    }
    if (++added_ >= sample) {
      for (auto& c : table_) c = static_cast<std::uint8_t>(c >> 1);
      added_ /= 2;
    }
  }

  std::int64_t sample;

 private:
  void fill(std::uint64_t x, std::size_t* slots) const {
    for (int r = 0; r < kRows; ++r) {
      slots[r] = static_cast<std::size_t>(r) * width_ + static_cast<std::size_t>(mix(x ^ kSeeds[r]) & mask_);
    }
  }

  std::uint64_t mask_;
  std::size_t width_;
  std::vector<std::uint8_t> table_;  // row-major, kRows x width
  std::int64_t added_ = 0;
};

class TinyLfuPolicy : public PolicyCore {
 public:
  explicit TinyLfuPolicy(const PolicyContext& ctx)
      : heat_(ctx.heat), codec_(ctx.codec), capacity_(ctx.capacity_bytes), queues_(ctx.heat, 3) {}

  bool admit(const BlockKey& key, AdmissionKind why) override {
    if (sketch_ && why != AdmissionKind::kDemote) {  // a demotion is no access
      sketch_->add(word(key));
      count(false);
    }
    return true;
  }

  void on_insert(const BlockKey& key, std::int64_t size) override {
    if (!sketch_) sketch_ = std::make_unique<FrequencySketch>(std::max<std::int64_t>(1, capacity_ / size));
    if (queues_.contains(key)) on_remove(key);
    block_ = size;
    queues_.add(key, kWindow, ++seq_);
    meta_[key] = Meta{size, heat_.now()};
    bytes_[kWindow] += size;
  }

  void on_hit(const BlockKey& key) override {
    int seg = queues_.queue_of(key);
    if (seg < 0) return;
    bool fresh = meta_.at(key).born == heat_.now();  // the access that stored it
    if (!fresh && sketch_) {
      sketch_->add(word(key));
      count(true);
    }
    if (seg == kProbation && !fresh) {
      move(key, kProtected);
      double main = static_cast<double>(capacity_) - window_target();
      BlockKey head;
      while (static_cast<double>(bytes_[kProtected]) > kProtectedFraction * main) {
        if (!queues_.head(kProtected, always_, &head)) break;
        move(head, kProbation);
      }
    } else {
      move(key, seg);
    }
  }

  void on_remove(const BlockKey& key) override {
    int seg = queues_.queue_of(key);
    if (seg < 0) return;
    queues_.remove(key);
    auto m = meta_.find(key);
    bytes_[seg] -= m->second.size;
    meta_.erase(m);
  }

  bool victim(const KeyPred& evictable, BlockKey* out) override {
    const double main_cap = static_cast<double>(capacity_) - window_target();
    BlockKey cand, other;
    while (static_cast<double>(bytes_[kWindow]) > window_target()) {
      if (!queues_.head(kWindow, evictable, &cand)) break;
      if (static_cast<double>(bytes_[kProbation] + bytes_[kProtected] + meta_.at(cand).size) <= main_cap) {
        to_main(cand);  // the main area has room: no contest
        continue;
      }
      if (!main_victim(evictable, &other) || estimate(cand) <= estimate(other)) {
        *out = cand;
        return true;
      }
      to_main(cand);
      *out = other;
      return true;
    }
    if (main_victim(evictable, out)) return true;
    if (queues_.head(kWindow, evictable, out)) return true;
    return queues_.fallback(evictable, out);
  }

 private:
  static constexpr int kWindow = 0, kProbation = 1, kProtected = 2;

  // The sketch's word of a key: int.from_bytes(key, "little"), its low 64
  // bits XOR the next 64 (the first 16 bytes, zero-padded).
  std::uint64_t word(const BlockKey& key) const {
    if ((key.tag & BlockKey::kInterned) == 0) return key.lo ^ key.hi;  // packed by memcpy, zero-padded
    const std::string bytes = codec_.decode(key);
    char buf[16] = {0};
    std::memcpy(buf, bytes.data(), std::min<std::size_t>(16, bytes.size()));
    std::uint64_t lo, hi;
    std::memcpy(&lo, buf, 8);
    std::memcpy(&hi, buf + 8, 8);
    return lo ^ hi;
  }

  int estimate(const BlockKey& key) const { return sketch_ ? sketch_->estimate(word(key)) : 0; }

  void count(bool hit) {
    period_hits_ += hit ? 1 : 0;
    ++period_accesses_;
    if (!sketch_ || period_accesses_ < sketch_->sample) return;
    const double ratio = static_cast<double>(period_hits_) / static_cast<double>(period_accesses_);
    if (has_last_ratio_ && ratio < last_ratio_) step_ = -step_;
    last_ratio_ = ratio;
    has_last_ratio_ = true;
    window_share_ = std::min(1.0 - kWindowFraction, std::max(kWindowFraction, window_share_ + step_));
    step_ *= kClimbDecay;
    period_hits_ = period_accesses_ = 0;
  }

  void move(const BlockKey& key, int seg) {
    int old = queues_.queue_of(key);
    std::int64_t size = meta_.at(key).size;
    bytes_[old] -= size;
    bytes_[seg] += size;
    queues_.update(key, seg, ++seq_);
  }

  // max(block, share * capacity): Python compares the int and the float exactly,
  // as doubles do for byte counts below 2^53.
  double window_target() const {
    return std::max(static_cast<double>(block_), window_share_ * static_cast<double>(capacity_));
  }

  // Moves a window block to probation with its ancestors still in the window,
  // the oldest first: the child stays the most recent.
  // The walk stops at a block it met already (the tracker's parents may form a cycle).
  void to_main(const BlockKey& key) {
    chain_.clear();
    met_.clear();
    chain_.push_back(key);
    met_.insert(key);
    const BlockKey* parent = heat_.parent(key);
    while (parent != nullptr && met_.count(*parent) == 0 && queues_.queue_of(*parent) == kWindow) {
      chain_.push_back(*parent);
      met_.insert(*parent);
      parent = heat_.parent(*parent);
    }
    for (auto it = chain_.rbegin(); it != chain_.rend(); ++it) move(*it, kProbation);
  }

  bool main_victim(const KeyPred& evictable, BlockKey* out) {
    return queues_.head(kProbation, evictable, out) || queues_.head(kProtected, evictable, out);
  }

  const HeatMirror& heat_;
  const KeyCodec& codec_;
  std::int64_t capacity_;
  LeafQueues<std::int64_t> queues_;  // window, probation, protected; priority: order of the last report (LRU)
  std::int64_t seq_ = 0;
  struct Meta {  // a resident block: bytes, clock of its insertion
    std::int64_t size;
    std::int64_t born;
  };
  KeyMap<Meta> meta_;
  std::int64_t bytes_[3] = {0, 0, 0};  // per segment
  std::int64_t block_ = 0;             // bytes of the last block stored
  std::unique_ptr<FrequencySketch> sketch_;
  double window_share_ = kWindowFraction;
  double step_ = kClimbStep;
  std::int64_t period_hits_ = 0, period_accesses_ = 0;
  double last_ratio_ = 0.0;
  bool has_last_ratio_ = false;
  std::vector<BlockKey> chain_;
  KeySet met_;  // the blocks `to_main` walked through
  const KeyPred always_ = [](const BlockKey&) { return true; };
};

}  // namespace

std::unique_ptr<PolicyCore> make_tinylfu_policy(const PolicyContext& ctx) {
  return std::make_unique<TinyLfuPolicy>(ctx);
}

}  // namespace ucm
