// The native ReuseModel (ucm/placement/policies/reuse.py) and the one implementation of
// its hazard estimate and density table (bound as ucm._native.reuse_hazard
// and reuse_density, which the Python model uses too).
#include "ucm/reuse_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ucm {

using reuse::kAgeBuckets;
using reuse::kClasses;
using reuse::kPriorEvents;
using reuse::kUseKinds;

void reuse_hazard(const double* ev, const double* ex, double* out) {
  double total_ev = 0.0, total_ex = 0.0;
  for (int i = 0; i < reuse::kCells; ++i) {
    total_ev += ev[i];
    total_ex += ex[i];
  }
  if (total_ev <= 0.0 || total_ex <= 0.0) {
    std::fill(out, out + reuse::kCells, 0.0);
    return;
  }
  const double overall = total_ev / total_ex;
  // The age profile pooled over classes, then each class's multiplier on it.
  double base[kAgeBuckets];
  for (int a = 0; a < kAgeBuckets; ++a) {
    double e = 0.0, x = 0.0;
    for (int c = 0; c < kClasses; ++c) {
      e += ev[c * kAgeBuckets + a];
      x += ex[c * kAgeBuckets + a];
    }
    base[a] = (e + kPriorEvents) / (x + kPriorEvents / overall);
  }
  for (int c = 0; c < kClasses; ++c) {
    double e = 0.0, x = 0.0;
    for (int a = 0; a < kAgeBuckets; ++a) {
      e += ev[c * kAgeBuckets + a];
      x += ex[c * kAgeBuckets + a] * base[a];
    }
    const double mult = (e + kPriorEvents) / (x + kPriorEvents);
    for (int a = 0; a < kAgeBuckets; ++a) {
      const int i = c * kAgeBuckets + a;
      const double prior = mult * base[a];
      out[i] = (ev[i] + kPriorEvents) / (ex[i] + kPriorEvents / prior);
    }
  }
  // At each age, more accesses never predict a lower rate.
  auto raise = [out](int to, int from) {
    for (int a = 0; a < kAgeBuckets; ++a) {
      double& t = out[to * kAgeBuckets + a];
      const double f = out[from * kAgeBuckets + a];
      if (f > t) t = f;
    }
  };
  for (bool tail : {false, true}) {
    for (bool long_out : {false, true}) {
      const int twice = reuse::classify(2, tail, false, long_out), more = reuse::classify(3, tail, false, long_out);
      for (bool ext : {false, true}) raise(twice, reuse::classify(1, tail, ext, long_out));
      raise(more, twice);
    }
  }
}

double reuse_density_at(const double* l, double horizon, int j) {
  // Over the buckets i >= j crossed within the horizon (the others add
  // nothing): e = hazard x ticks spent in i, m = P(reuse within them) =
  // -expm1(-e), the survival to i's start the product of the (1 - m) before
  // it (exp(-e) where 1 - m would lose digits), the expected ticks occupied
  // in i survival x m / hazard (x ticks without hazard).
  const double start = static_cast<double>(reuse::bucket_start(j));
  const double end = start + horizon;
  double acc = 0.0, occupied = 0.0, surv = 1.0, m = 0.0;
  int cells = 0;
  for (int i = j; i < kAgeBuckets; ++i, ++cells) {
    const double lo = static_cast<double>(reuse::bucket_start(i));
    if (!(lo < end)) break;
    const double top = i + 1 < kAgeBuckets ? static_cast<double>(reuse::bucket_start(i + 1))
                                           : std::numeric_limits<double>::infinity();
    const double span = std::min(top, end) - lo;
    const double e = l[i] * span;
    acc += e;
    if (l[i] > 0.0) {
      m = -std::expm1(-e);
      occupied += surv * (m / l[i]);
      surv *= e < 0.5 ? 1.0 - m : std::exp(-e);
    } else {
      m = 0.0;
      occupied += surv * span;
    }
  }
  const double p_hit = cells == 1 ? m : -std::expm1(-acc);  // one bucket: P(reuse) is its m
  return occupied > 0.0 ? p_hit / occupied : 0.0;
}

void reuse_density(const double* lam, double horizon, double* out) {
  horizon = std::max(1.0, horizon);
  for (int c = 0; c < kClasses; ++c) {
    for (int j = 0; j < kAgeBuckets; ++j) out[c * kAgeBuckets + j] = reuse_density_at(lam + c * kAgeBuckets, horizon, j);
  }
}

// ---- ReuseModel --------------------------------------------------------------

void ReuseModel::on_access(const BlockKey&, int slot, std::int64_t now, bool first, bool ext) {
  const std::int64_t last = heat_.last(slot);
  std::int64_t n = heat_.count(slot);
  const std::uint8_t f = heat_.flags(slot);
  if (last >= 0) {  // ends the episode that began at the last access
    const int i = reuse::class_of(heat_, slot) * kAgeBuckets + reuse::age_bucket(now - last);
    events_[static_cast<std::size_t>(i)] += 1.0;
    alive_[static_cast<std::size_t>(i)] -= 1.0;
  }
  ++n;
  const int c = reuse::classify(n, first, ext, (f & HeatMirror::kLongOut) != 0);
  alive_[static_cast<std::size_t>(c * kAgeBuckets)] += 1.0;
  waiting_[1].emplace_back(now, slot);
}

void ReuseModel::on_reclass(const BlockKey&, int slot, std::int64_t now, bool long_out) {
  const std::int64_t last = heat_.last(slot);
  if (last >= 0 && ((heat_.flags(slot) & HeatMirror::kLongOut) != 0) != long_out) {
    const int b = reuse::age_bucket(now - last);
    const int c = reuse::class_of(heat_, slot);
    alive_[static_cast<std::size_t>(c * kAgeBuckets + b)] -= 1.0;
    alive_[static_cast<std::size_t>((c ^ (2 * kUseKinds)) * kAgeBuckets + b)] += 1.0;
  }
}

void ReuseModel::on_forget(const BlockKey&, int slot, std::int64_t now) {
  const std::int64_t last = heat_.last(slot);
  if (last < 0) return;
  alive_[static_cast<std::size_t>(reuse::class_of(heat_, slot) * kAgeBuckets + reuse::age_bucket(now - last))] -= 1.0;
  if (last == now) {  // its episode began this tick: the slot may be reused at once
    auto& q = waiting_[1];
    auto it = std::find(q.begin(), q.end(), std::make_pair(now, slot));  // the first match, as deque.remove
    if (it != q.end()) q.erase(it);
  }
}

void ReuseModel::on_tick(std::int64_t now) {
  for (int i = 1; i < kAgeBuckets; ++i) {
    auto& q = waiting_[static_cast<std::size_t>(i)];
    const std::int64_t edge = now - reuse::bucket_start(i);
    while (!q.empty() && q.front().first <= edge) {
      const auto ep = q.front();
      q.pop_front();
      if (heat_.last(ep.second) == ep.first) {  // not used since: now older than the bucket's start
        const int c = reuse::class_of(heat_, ep.second) * kAgeBuckets + i;
        alive_[static_cast<std::size_t>(c - 1)] -= 1.0;
        alive_[static_cast<std::size_t>(c)] += 1.0;
        if (i + 1 < kAgeBuckets) waiting_[static_cast<std::size_t>(i + 1)].push_back(ep);
      }
    }
  }
  for (int i = 0; i < reuse::kCells; ++i) exposure_[static_cast<std::size_t>(i)] += alive_[static_cast<std::size_t>(i)];
  ++version_;
}

const reuse::Table& ReuseModel::hazard() {
  if (!have_hazard_ || hazard_version_ != version_) {
    reuse_hazard(events_.data(), exposure_.data(), hazard_.data());
    hazard_version_ = version_;
    have_hazard_ = true;
  }
  return hazard_;
}

}  // namespace ucm
