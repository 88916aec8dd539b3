// Tests of the planner's replay schedules (planner/schedule.h, Note [Schedule model]) on hand-made problems: the
// replay order follows the observed unpack order, one segment costs no recompute, finer segments without holds
// keep less alive and recompute shared producers, and schedule_choices() lists a cost/working-set frontier whose
// cheapest point costs what one segment costs.
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

}  // namespace
}  // namespace tapesac::planner
