// C++ tests of the native placement core (ucm/placement.hpp) and the reuse
// model (ucm/reuse_model.hpp), built and run by `make test` (no framework).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "ucm/placement.hpp"
#include "ucm/reuse_model.hpp"

#include "check.hpp"

static ucm::BlockKey pkey(ucm::PlacementCore& p, int i) {
  char b[16] = {0};
  std::memcpy(b, &i, sizeof i);
  return p.codec().encode(b, 16);
}

static bool step_is(const ucm::PlanStep& s, ucm::StepOp op, const ucm::BlockKey& k, int src, int dst) {
  return s.op == op && s.key == k && s.src == src && s.dst == dst;
}

static void test_placement_plans() {
  ucm::PlacementCore p({{"dram", 2}, {"nvme", 4}}, "lru", 100, 0);
  const ucm::BlockKey a = pkey(p, 1), b = pkey(p, 2), c = pkey(p, 3);
  p.record_request({a, b, c}, nullptr);
  std::vector<bool> placed;
  ucm::PlanSteps plan;
  CHECK(p.insert_run({a, b, c}, nullptr, {1, 1, 1}, 0, placed, plan) == 3);
  CHECK((placed == std::vector<bool>{true, true, true}));
  // c's parent b is protected, a has a child in DRAM: a is demoted ahead of it.
  CHECK(plan.size() == 4);
  if (plan.size() == 4) {
    CHECK(step_is(plan[0], ucm::StepOp::kWrite, a, -1, 0));
    CHECK(step_is(plan[1], ucm::StepOp::kWrite, b, -1, 0));
    CHECK(step_is(plan[2], ucm::StepOp::kMove, a, 0, 1));
    CHECK(step_is(plan[3], ucm::StepOp::kWrite, c, -1, 0));
  }
  CHECK(p.where(c) == 0 && p.tiers_of(a) == std::vector<int>{1});
  CHECK(p.used_bytes(0) == 2 && p.used_bytes(1) == 1 && p.lookup({a, b, c, pkey(p, 9)}) == 3);
  CHECK(p.parent_of(c) != nullptr && *p.parent_of(c) == b && p.parent_of(a) == nullptr);
  CHECK(p.counters(1).demotions_in == 1 && p.counters(0).evictions == 1);
  // Promotion copies a back up (the copy below stays); room is made by
  // demoting c, the leaf (b has a child in DRAM).
  plan.clear();
  CHECK(p.promote(a, true, plan));
  CHECK(plan.size() == 2);
  if (plan.size() == 2) {
    CHECK(step_is(plan[0], ucm::StepOp::kMove, c, 0, 1));
    CHECK(step_is(plan[1], ucm::StepOp::kCopy, a, 1, 0));
  }
  CHECK(p.tiers_of(a) == (std::vector<int>{0, 1}));
  // Losing a drops its descendants, deepest first (the caller deletes their bytes).
  plan.clear();
  p.remove(a, -1, plan);
  CHECK(plan.size() == 2);
  if (plan.size() == 2) {
    CHECK(step_is(plan[0], ucm::StepOp::kDrop, c, 1, -1));
    CHECK(step_is(plan[1], ucm::StepOp::kDrop, b, 0, -1));
  }
  CHECK(!p.contains(a) && !p.contains(b) && !p.contains(c));
  CHECK(p.used_bytes(0) == 0 && p.used_bytes(1) == 0);
}

static void test_placement_pins_and_holds() {
  ucm::PlacementCore p({{"dram", 2}}, "fifo", 100, 0);
  const ucm::BlockKey a = pkey(p, 1), b = pkey(p, 2), c = pkey(p, 3), d = pkey(p, 4);
  ucm::PlanSteps plan;
  p.record_request({a}, nullptr);
  CHECK(p.insert(a, nullptr, 1, 0, false, plan));
  p.record_request({b}, nullptr);
  CHECK(p.insert(b, nullptr, 1, 0, false, plan));
  p.pin({a});  // the oldest, but promised to an engine
  plan.clear();
  p.record_request({c}, nullptr);
  CHECK(p.insert(c, nullptr, 1, 0, false, plan));
  CHECK(plan.size() == 2 && step_is(plan[0], ucm::StepOp::kDrop, b, 0, -1));
  p.hold({c});
  plan.clear();
  CHECK(!p.insert(d, nullptr, 1, 0, false, plan));  // nothing may go
  CHECK(plan.empty() && p.contains(a) && p.contains(c));
  CHECK(!p.may_evict(0, {c}, nullptr, false));
  p.unhold({c});
  p.unpin({a});
  CHECK(p.may_evict(0, {a}, nullptr, false) && !p.may_evict(0, {a}, &a, false));
  plan.clear();
  p.evict_keys(0, {a, c}, false, nullptr, false, plan);
  CHECK(plan.size() == 2 && p.blocks(0) == 0);
}

static void test_placement_heat_mirror() {
  ucm::HeatMirror heat(2);
  ucm::KeyCodec codec;
  const ucm::BlockKey a = codec.encode("a", 1), b = codec.encode("b", 1), x = codec.encode("x", 1);
  heat.tick();
  heat.touch(a, &x);
  heat.touch(b, &a);
  CHECK(heat.parent(a) != nullptr && *heat.parent(a) == x && heat.now() == 1);
  heat.touch(a, nullptr);  // keeps its parent, becomes the most recent
  heat.touch(x, nullptr);  // the history holds 2: b, the least recent, is forgotten
  CHECK(heat.parent(b) == nullptr && heat.parent(a) != nullptr);
  // Slots as the tracker allocates them: x takes b's forgotten slot; a's record counts both accesses.
  CHECK(heat.slot(b) == -1 && heat.slot(x) == 1 && heat.count(heat.slot(a)) == 2 && heat.last(heat.slot(a)) == 1);
  CHECK((heat.flags(heat.slot(a)) & ucm::HeatMirror::kTail) == 0);  // not the request's first touch
  heat.tick();
  heat.touch(x, nullptr);
  CHECK((heat.flags(heat.slot(x)) & ucm::HeatMirror::kTail) != 0);  // the first touch after a tick
  CHECK(heat.finish({a, b}, 500).size() == 1 && (heat.flags(heat.slot(a)) & ucm::HeatMirror::kLongOut) != 0);
  // Keys of any length round-trip; up to 16 bytes they are values.
  const std::string long_key(40, 'z');
  CHECK(codec.decode(codec.encode(long_key.data(), long_key.size())) == long_key);
  CHECK(codec.encode(long_key.data(), long_key.size()) == codec.encode(long_key.data(), long_key.size()));
  CHECK(codec.decode(codec.encode("", 0)).empty() && !(codec.encode("", 0) == codec.encode("\0", 1)));
}

// OPT evicts the block used farthest in the future and refuses, in a full
// lowest tier, a block used later than every resident one.
static void test_placement_opt() {
  ucm::PlacementCore p({{"dram", 2}}, "opt", 100, 0);
  const ucm::BlockKey a = pkey(p, 1), b = pkey(p, 2), c = pkey(p, 3), d = pkey(p, 4);
  const double inf = ucm::HeatMirror::kInf;
  ucm::PlanSteps plan;
  const std::vector<double> nu_a{3.0}, nu_b{inf}, nu_c{4.0}, nu_d{inf};
  p.record_request({a}, nullptr, &nu_a);
  CHECK(p.insert(a, nullptr, 1, 0, false, plan));
  p.record_request({b}, nullptr, &nu_b);
  CHECK(p.insert(b, nullptr, 1, 0, false, plan));
  plan.clear();
  p.record_request({c}, nullptr, &nu_c);
  CHECK(p.insert(c, nullptr, 1, 0, false, plan));  // used before b, never used again: b goes
  CHECK(plan.size() == 2 && step_is(plan[0], ucm::StepOp::kDrop, b, 0, -1));
  plan.clear();
  p.record_request({d}, nullptr, &nu_d);
  CHECK(!p.insert(d, nullptr, 1, 0, false, plan));  // never used again: refused
  CHECK(plan.empty() && p.contains(a) && p.contains(c) && !p.contains(d));
  CHECK(p.counters(0).evictions == 1);
}

// The heat policy's ReuseModel counts as ucm/placement/policies/reuse.py does
// (tests/unit/policy/test_heat_policy.py, the same case).
static void test_reuse_model() {
  ucm::HeatMirror heat(100);
  ucm::KeyCodec codec;
  ucm::ReuseModel& model = heat.shared<ucm::ReuseModel>();
  CHECK(&heat.shared<ucm::ReuseModel>() == &model);  // one per mirror
  const ucm::BlockKey a = codec.encode("aaaaaaaa", 8);
  heat.tick();  // t=1
  heat.touch(a, nullptr);  // the first (deepest) block of its request: a tail, used once
  for (int i = 0; i < 4; ++i) heat.tick();  // t=2..5
  heat.touch(a, nullptr);  // reused at age 4
  const int c = ucm::reuse::classify(1, true, false, false);
  const auto& ex = model.exposure();
  const std::size_t row = static_cast<std::size_t>(c * ucm::reuse::kAgeBuckets);
  CHECK(ex[row] == 1.0 && ex[row + 1] == 2.0 && ex[row + 2] == 1.0 && ex[row + 3] == 0.0);
  CHECK(model.events()[row + static_cast<std::size_t>(ucm::reuse::age_bucket(4))] == 1.0);
  CHECK(ucm::reuse::age_bucket(0) == 0 && ucm::reuse::age_bucket(1) == 0 && ucm::reuse::age_bucket(3) == 1 &&
        ucm::reuse::age_bucket(8) == 3 && ucm::reuse::age_bucket(std::int64_t{1} << 40) == 19);
  CHECK(model.version() == 5);
  // Reused blocks are valued above the once-used ones at a young age.
  ucm::reuse::Table table;
  ucm::reuse_density(model.hazard().data(), 64.0, table.data());
  const int twice = ucm::reuse::classify(2, false, false, false);
  CHECK(table[static_cast<std::size_t>(twice * ucm::reuse::kAgeBuckets)] > 0.0);
  for (int i = 0; i < ucm::reuse::kCells; ++i) {  // a cell alone is what the whole table holds there
    const int c = i / ucm::reuse::kAgeBuckets, j = i % ucm::reuse::kAgeBuckets;
    CHECK(ucm::reuse_density_at(model.hazard().data() + c * ucm::reuse::kAgeBuckets, 64.0, j) ==
          table[static_cast<std::size_t>(i)]);
  }
}

// Every policy keeps the invariants under a random workload over three tiers.
static void test_placement_invariants() {
  for (const std::string& kind : ucm::native_policy_names()) {
    ucm::PlacementCore p({{"hbm", 3}, {"dram", 5}, {"nvme", 9}}, kind, 50, 0);
    std::uint64_t x = 7;
    int fresh = 1000;
    std::vector<std::vector<ucm::BlockKey>> docs;
    for (int d = 0; d < 12; ++d) docs.push_back({pkey(p, d * 100)});
    for (int step = 0; step < 3000; ++step) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      auto& doc = docs[(x >> 33) % docs.size()];
      if ((x >> 20) % 3 == 0) doc.push_back(pkey(p, ++fresh));
      std::vector<ucm::BlockKey> keys(doc.begin(), doc.begin() + 1 + static_cast<long>((x >> 40) % doc.size()));
      p.record_request(keys, nullptr);
      const std::size_t hit = p.lookup(keys);
      std::vector<ucm::BlockKey> todo(keys.begin() + static_cast<long>(hit), keys.end());
      std::vector<bool> placed;
      ucm::PlanSteps plan;
      p.insert_run(todo, hit ? &keys[hit - 1] : nullptr, std::vector<std::int64_t>(todo.size(), 1 + (x >> 50) % 2),
                   0, placed, plan);
      p.touch(keys);
      for (int t = 0; t < 3; ++t) {
        CHECK(p.used_bytes(t) <= p.capacity_bytes(t));
        for (const auto& k : p.resident_keys(t)) {
          const ucm::BlockKey* parent = p.parent_of(k);
          CHECK(parent == nullptr || p.contains(*parent));
        }
      }
    }
    CHECK(p.counters(2).evictions > 0);
  }
}

int main() {
  test_placement_plans();
  test_placement_pins_and_holds();
  test_placement_heat_mirror();
  test_placement_opt();
  test_placement_invariants();
  test_reuse_model();
  return finish("native placement core");
}
