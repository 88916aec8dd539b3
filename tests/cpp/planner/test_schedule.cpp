// Tests of the planner's replay schedules (planner/schedule.h, Note [Schedule model]) on hand-made problems: the
// replay order follows the observed unpack order, one segment costs no recompute, finer segments without holds
// keep less alive and recompute shared producers, and schedule_choices() lists a cost/working-set frontier whose
// cheapest point costs what one segment costs; the search stays bounded on blocks of thousands of ops.
#include <chrono>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "planner_test_util.h"
#include "tapesac/planner/schedule.h"

namespace tapesac::planner {
namespace {

using testing::kMiB;
using testing::ProblemBuilder;

// x -> a = expensive(x) (4 MiB) -> c = f(a), b = g(a) (1 MiB each); a, c and b are saved and dropped; backward
// first unpacks c (and is done with it), then b, then a.
struct Fork {
  ProblemBuilder pb;
  int32_t x, a, c, b;
  UnpackOrder unpack;
  KeepMask drop_all;
  Fork() {
    x = pb.ext();
    a = pb.op("expensive", 1000, {x}, 4 * kMiB);
    c = pb.op("f", 10, {a}, kMiB);
    b = pb.op("g", 10, {a}, kMiB);
    pb.save(a);
    pb.save(c);
    pb.save(b);
    unpack.values = {c, b, a};
    unpack.dies_before = {1, 3, 3};
    drop_all = {0, 0, 0};
  }
};

TEST(PlannerSchedule, ReplayOrderFollowsTheUnpackOrder) {
  Fork f;
  EXPECT_EQ(replay_order(f.pb.problem, f.drop_all, f.unpack), (std::vector<int32_t>{f.c, f.b, f.a}));
  // Keeping `a`: only c and b are replayed, in unpack order.
  EXPECT_EQ(replay_order(f.pb.problem, KeepMask{1, 0, 0}, f.unpack), (std::vector<int32_t>{f.c, f.b}));
}

TEST(PlannerSchedule, FinerSegmentsWithoutHoldsKeepLessAliveAndRecompute) {
  Fork f;
  const std::vector<int32_t> order = replay_order(f.pb.problem, f.drop_all, f.unpack);
  const ScheduleChoice one = evaluate_schedule(f.pb.problem, f.drop_all, f.unpack, order, {}, {});
  EXPECT_EQ(one.segments(), 1);
  EXPECT_DOUBLE_EQ(one.replay_cost_ns, 1020);  // every op once
  const ScheduleChoice lazy = evaluate_schedule(f.pb.problem, f.drop_all, f.unpack, order, {0, 1, 2}, {});
  EXPECT_EQ(lazy.segments(), 3);
  EXPECT_GT(lazy.replay_cost_ns, one.replay_cost_ns);  // `expensive` runs again for b and for a
  EXPECT_LT(lazy.working_set_bytes, one.working_set_bytes);
  EXPECT_EQ(lazy.held_bytes, 0);
}

TEST(PlannerSchedule, ChoicesStartAtOneSegmentAndTradeTimeForBytes) {
  Fork f;
  const std::vector<ScheduleChoice> choices = schedule_choices(f.pb.problem, f.drop_all, f.unpack);
  const ScheduleChoice one = evaluate_schedule(f.pb.problem, f.drop_all, f.unpack,
                                               replay_order(f.pb.problem, f.drop_all, f.unpack), {}, {});
  ASSERT_FALSE(choices.empty());
  // The cheapest choice runs every op once, and (holding `a` for the later segments) keeps less alive than one
  // segment, which it therefore replaces.
  EXPECT_DOUBLE_EQ(choices.front().replay_cost_ns, one.replay_cost_ns);
  EXPECT_LT(choices.front().working_set_bytes, one.working_set_bytes);
  EXPECT_GT(choices.front().segments(), 1);
  for (size_t k = 1; k < choices.size(); ++k) {
    EXPECT_GE(choices[k].replay_cost_ns, choices[k - 1].replay_cost_ns);
    EXPECT_LT(choices[k].working_set_bytes, choices[k - 1].working_set_bytes);
  }
}


// An unrolled recurrence of `steps` cells (two saved values each: the gate and the state), backward unpacking them
// last cell first: the shape of an nn.GRU block on CPU, which drops about a thousand values.
struct Recurrence {
  ProblemBuilder pb;
  UnpackOrder unpack;
  KeepMask drop_all;
  explicit Recurrence(int steps) {
    const int32_t x = pb.ext();
    int32_t h = pb.ext();
    std::vector<int32_t> saved;
    for (int t = 0; t < steps; ++t) {
      const int32_t g = pb.op("gate", 20, {x, h}, 4096);
      h = pb.op("state", 10, {g, h}, 2048);
      pb.save(g);
      pb.save(h);
      saved.push_back(g);
      saved.push_back(h);
    }
    for (size_t i = saved.size(); i-- > 0;) {
      unpack.values.push_back(saved[i]);
      unpack.dies_before.push_back(static_cast<int32_t>(saved.size() - i));
    }
    drop_all.assign(saved.size(), 0);
  }
};

TEST(PlannerSchedule, TheSearchIsBoundedOnABlockOfThousandsOfOps) {
  // Note [Bounded schedule search]: before it, this problem's search ran 800 simulations of 1,200 segments each
  // (21 s on the development machine, measured with both bounds lifted); an adversarial test's GRU blocks took
  // 6.5-26 s to plan.
  Recurrence r(600);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<ScheduleChoice> choices = schedule_choices(r.pb.problem, r.drop_all, r.unpack);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(choices.empty());
  const ScheduleOptions defaults;
  for (const ScheduleChoice& c : choices) EXPECT_LE(c.segments(), defaults.max_segments);
  EXPECT_GT(choices.back().segments(), 1);  // the search still found finer schedules
  EXPECT_LT(seconds, 5.0) << "0.16 s on the development machine; generous for sanitizers and shared CI";
}

TEST(PlannerSchedule, SegmentCapGroupsConsecutiveValuesAndKeepsTheCheapestChoice) {
  Recurrence r(40);
  ScheduleOptions options;
  options.max_segments = 8;
  const std::vector<ScheduleChoice> choices = schedule_choices(r.pb.problem, r.drop_all, r.unpack, options);
  const ScheduleChoice one = evaluate_schedule(r.pb.problem, r.drop_all, r.unpack,
                                               replay_order(r.pb.problem, r.drop_all, r.unpack), {}, {});
  ASSERT_FALSE(choices.empty());
  EXPECT_DOUBLE_EQ(choices.front().replay_cost_ns, one.replay_cost_ns);
  for (const ScheduleChoice& c : choices) {
    EXPECT_LE(c.segments(), 8);
    for (size_t k = 1; k < c.segment_begin.size(); ++k) EXPECT_LT(c.segment_begin[k - 1], c.segment_begin[k]);
  }
  // A tiny work budget still evaluates (at least 4 simulations) and returns a valid frontier.
  options.max_cells = 1;
  const std::vector<ScheduleChoice> cheap = schedule_choices(r.pb.problem, r.drop_all, r.unpack, options);
  ASSERT_FALSE(cheap.empty());
  EXPECT_DOUBLE_EQ(cheap.front().replay_cost_ns, one.replay_cost_ns);
}

}  // namespace
}  // namespace tapesac::planner
