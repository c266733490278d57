// HeatMirror: the records of ucm.placement.heat.HeatTracker that the native policies
// read, kept exactly as the tracker keeps them from the same record_request
// and finish calls: per block the clock of its last access, its access
// count, its flags (TAIL, EXT, LONG_OUT), its last recorded parent and the
// oracle's next use, in record slots allocated as the tracker allocates them
// (a bounded history, least recently accessed forgotten first, a forgotten
// record's slot reused last-in first-out), so slot numbers agree too.
//
// Listeners (`subscribe`, not owned) receive the tracker's events in the
// tracker's order: on_access before a record is updated, on_tick after the
// clock advanced, on_forget before a record is dropped, on_reclass before
// a record's output kind changes (see ucm/placement/heat.py).
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <vector>

#include "ucm/block_key.hpp"

namespace ucm {

class HeatListener {
 public:
  virtual ~HeatListener() = default;
  virtual void on_access(const BlockKey& key, int slot, std::int64_t now, bool first, bool ext) = 0;
  virtual void on_tick(std::int64_t now) = 0;
  virtual void on_forget(const BlockKey& key, int slot, std::int64_t now) = 0;
  virtual void on_reclass(const BlockKey& key, int slot, std::int64_t now, bool long_out) = 0;
};

class HeatMirror {
 public:
  // ucm.placement.heat: the flag bits of a record and the long-output threshold.
  static constexpr std::uint8_t kTail = 1, kExt = 2, kLongOut = 4;
  static constexpr std::int64_t kLongOutput = 128;
  static constexpr double kInf = std::numeric_limits<double>::infinity();

  explicit HeatMirror(std::size_t history_blocks) : capacity_(history_blocks) {}
  // HeatTracker.tick: the clock advances; the next touch is a request's first (deepest).
  void tick();
  // HeatTracker.touch: one access at the current time.
  void touch(const BlockKey& key, const BlockKey* parent, double next_use = kInf);
  // HeatTracker.finish: the keys whose output kind changed, in order.
  std::vector<BlockKey> finish(const std::vector<BlockKey>& keys, std::int64_t output_tokens);

  std::int64_t now() const { return now_; }
  std::size_t size() const { return slots_.size(); }
  int slot(const BlockKey& key) const;  // -1: no record
  // By slot (valid until the record is forgotten).
  std::int64_t last(int s) const { return last_[static_cast<std::size_t>(s)]; }
  std::int64_t count(int s) const { return count_[static_cast<std::size_t>(s)]; }
  std::uint8_t flags(int s) const { return flags_[static_cast<std::size_t>(s)]; }
  // By key.
  const BlockKey* parent(const BlockKey& key) const;  // nullptr: none recorded
  double next_use(const BlockKey& key) const;         // kInf: unknown

  void subscribe(HeatListener* listener);
  // The listener of type T this mirror owns, made (T(*this)) and subscribed
  // at the first call: every policy of a core shares it.
  template <class T>
  T& shared() {
    if (T* t = listener<T>()) return *t;
    auto made = std::make_unique<T>(*this);
    T& out = *made;
    owned_.push_back(std::move(made));
    subscribe(&out);
    return out;
  }
  // The subscribed listener of type T, if any (policies of one core share one model this way).
  template <class T>
  T* listener() const {
    for (HeatListener* x : listeners_) {
      if (auto* t = dynamic_cast<T*>(x)) return t;
    }
    return nullptr;
  }

 private:
  struct Entry {
    int slot;
    std::uint64_t order;  // its position in `order_`
  };
  int make_record(const BlockKey& key);
  void forget_oldest();

  std::size_t capacity_;
  std::int64_t now_ = 0;
  bool first_ = false;
  std::uint64_t next_order_ = 0;
  KeyMap<Entry> slots_;
  // (order, key) by access, least recent first; an entry is live while its
  // order is the record's
  std::deque<std::pair<std::uint64_t, BlockKey>> order_;
  std::vector<int> free_;
  std::vector<std::int64_t> last_;
  std::vector<std::int64_t> count_;
  std::vector<std::uint8_t> flags_;
  std::vector<double> next_;
  std::vector<OptKey> parent_;
  std::vector<HeatListener*> listeners_;
  std::vector<std::unique_ptr<HeatListener>> owned_;
};

}  // namespace ucm
