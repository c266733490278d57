// The native mirror of ucm/placement/heat.py's HeatTracker (its records, not its scores).
#include "ucm/heat_mirror.hpp"

#include <algorithm>

namespace ucm {

void HeatMirror::tick() {
  ++now_;
  first_ = true;
  for (HeatListener* x : listeners_) x->on_tick(now_);
}

void HeatMirror::subscribe(HeatListener* listener) {
  if (std::find(listeners_.begin(), listeners_.end(), listener) == listeners_.end()) listeners_.push_back(listener);
}

int HeatMirror::slot(const BlockKey& key) const {
  auto it = slots_.find(key);
  return it == slots_.end() ? -1 : it->second.slot;
}

const BlockKey* HeatMirror::parent(const BlockKey& key) const {
  int s = slot(key);
  if (s < 0 || !parent_[static_cast<std::size_t>(s)]) return nullptr;
  return &*parent_[static_cast<std::size_t>(s)];
}

double HeatMirror::next_use(const BlockKey& key) const {
  int s = slot(key);
  return s < 0 ? kInf : next_[static_cast<std::size_t>(s)];
}

void HeatMirror::forget_oldest() {
  for (;;) {
    auto [order, old] = order_.front();
    order_.pop_front();
    auto r = slots_.find(old);
    if (r != slots_.end() && r->second.order == order) {
      const int s = r->second.slot;
      for (HeatListener* x : listeners_) x->on_forget(old, s, now_);
      slots_.erase(r);
      free_.push_back(s);
      return;
    }
  }
}

// HeatTracker._new: a fresh record, forgetting the least recent if full.
int HeatMirror::make_record(const BlockKey& key) {
  if (slots_.size() >= capacity_) forget_oldest();
  int s;
  if (!free_.empty()) {
    s = free_.back();
    free_.pop_back();
    const auto i = static_cast<std::size_t>(s);
    last_[i] = -1;
    count_[i] = 0;
    flags_[i] = 0;
    next_[i] = kInf;
    parent_[i].reset();
  } else {
    s = static_cast<int>(last_.size());
    last_.push_back(-1);
    count_.push_back(0);
    flags_.push_back(0);
    next_.push_back(kInf);
    parent_.emplace_back();
  }
  slots_.emplace(key, Entry{s, 0});
  return s;
}

void HeatMirror::touch(const BlockKey& key, const BlockKey* parent, double next_use) {
  auto it = slots_.find(key);
  int s = it == slots_.end() ? make_record(key) : it->second.slot;
  slots_.at(key).order = next_order_;  // the most recent (move_to_end)
  order_.emplace_back(next_order_++, key);
  if (order_.size() > 1024 + 2 * slots_.size()) {  // mostly stale: keep the live entries, in order
    std::deque<std::pair<std::uint64_t, BlockKey>> live;
    for (auto& entry : order_) {
      auto r = slots_.find(entry.second);
      if (r != slots_.end() && r->second.order == entry.first) live.push_back(entry);
    }
    order_.swap(live);
  }
  const bool first = first_;
  first_ = false;
  const int ps = parent != nullptr ? slot(*parent) : -1;
  const auto i = static_cast<std::size_t>(s);
  const bool ext = ps >= 0 && count_[static_cast<std::size_t>(ps)] > 0 && last_[static_cast<std::size_t>(ps)] < now_;
  std::uint8_t f = flags_[i];
  if (last_[i] < 0 && ps >= 0) {  // a new block: its parent's kind until its request reports
    f = static_cast<std::uint8_t>((f & ~kLongOut) | (flags_[static_cast<std::size_t>(ps)] & kLongOut));
    flags_[i] = f;
  }
  for (HeatListener* x : listeners_) x->on_access(key, s, now_, first, ext);
  last_[i] = now_;
  ++count_[i];
  if (parent != nullptr) parent_[i] = *parent;
  next_[i] = next_use;
  flags_[i] = static_cast<std::uint8_t>((f & kLongOut) | (first ? kTail : 0) | (ext ? kExt : 0));
}

std::vector<BlockKey> HeatMirror::finish(const std::vector<BlockKey>& keys, std::int64_t output_tokens) {
  const bool long_out = output_tokens >= kLongOutput;
  const std::uint8_t want = long_out ? kLongOut : 0;
  std::vector<BlockKey> changed;
  for (const auto& key : keys) {
    const int s = slot(key);
    if (s < 0) continue;
    const auto i = static_cast<std::size_t>(s);
    if ((flags_[i] & kLongOut) == want) continue;
    for (HeatListener* x : listeners_) x->on_reclass(key, s, now_, long_out);
    flags_[i] = static_cast<std::uint8_t>((flags_[i] & ~kLongOut) | want);
    changed.push_back(key);
  }
  return changed;
}

}  // namespace ucm
