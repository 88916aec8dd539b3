// Tests of the top-up (planner/top_up.h, Note [Top-up]) on hand-made problems: which dropped values a plan that ran
// keeps more within the room its step left, and the schedule it then replays with.
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "planner_test_util.h"
#include "tapesac/common/errors.h"
#include "tapesac/planner/top_up.h"

namespace tapesac::planner {
namespace {

using common::ScheduleHold;
using common::ScheduleShape;
using testing::kMiB;
using testing::ProblemBuilder;

TEST(PlannerTopUp, WithoutValueDropsTheValueItsHoldsAndASegmentLeftEmpty) {
  ScheduleShape s;
  s.order = {1, 2, 3, 4};
  s.segment_begin = {0, 1, 3};  // [1] [2 3] [4]
  s.holds = {ScheduleHold{5, 0, 2}, ScheduleHold{1, 0, 2}, ScheduleHold{6, 1, 2}};
  const ScheduleShape a = without_value(s, 1);  // its segment goes: later ones shift down
  EXPECT_EQ(a.order, (std::vector<int32_t>{2, 3, 4}));
  EXPECT_EQ(a.segment_begin, (std::vector<int32_t>{0, 2}));
  ASSERT_EQ(a.holds.size(), 2u);
  EXPECT_EQ(a.holds[0].value, 5);
  EXPECT_EQ(a.holds[0].from, 0);
  EXPECT_EQ(a.holds[0].until, 1);
  EXPECT_EQ(a.holds[1].value, 6);  // from the old segment 1, now 0, until the old 2, now 1
  EXPECT_EQ(a.holds[1].from, 0);
  EXPECT_EQ(a.holds[1].until, 1);
  const ScheduleShape b = without_value(s, 3);  // its segment keeps 2
  EXPECT_EQ(b.order, (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(b.segment_begin, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(b.holds.size(), 3u);  // 3 had none
  const ScheduleShape c = without_value(s, 9);
  EXPECT_EQ(c.order, s.order);
  EXPECT_EQ(c.segment_begin, s.segment_begin);
  EXPECT_EQ(c.holds.size(), s.holds.size());
  // A hold for a segment that disappears and started after it: gone.
  ScheduleShape d;
  d.order = {1, 2, 3};
  d.segment_begin = {0, 1, 2};
  d.holds = {ScheduleHold{7, 1, 2}};
  EXPECT_TRUE(without_value(d, 3).holds.empty());  // segment 2 goes: held from 1 until 1
}

// x -> a = big(x) 4 MiB, c = slow(x) 1 MiB, d = quick(x) 1 MiB; all saved and dropped, replayed in one segment.
struct Three {
  ProblemBuilder pb;
  int32_t x, a, c, d;
  Three() {
    x = pb.ext();
    a = pb.op("big", 1000, {x}, 4 * kMiB);
    c = pb.op("slow", 500, {x}, kMiB);
    d = pb.op("quick", 10, {x}, kMiB);
    pb.save(a);
    pb.save(c);
    pb.save(d);
  }
  TopUpCall call() const {
    TopUpCall t;
    t.problem = &pb.problem;
    t.keep = {0, 0, 0};
    t.shape.order = {d, c, a};
    return t;
  }
};

TEST(PlannerTopUp, KeepsWhatSavesTheMostPerByteWithinTheRoom) {
  const Three t;
  TopUp one = top_up({t.call()}, kMiB);
  ASSERT_EQ(one.changes.size(), 1u);
  EXPECT_EQ(one.changes[0].values, (std::vector<int32_t>{t.c}));  // 500 ns per MiB, beats d and a does not fit
  EXPECT_EQ(one.changes[0].keep, (KeepMask{0, 1, 0}));
  EXPECT_EQ(one.added_bytes, kMiB);
  EXPECT_DOUBLE_EQ(one.saved_ns, 500);
  EXPECT_EQ(one.changes[0].schedule.order, (std::vector<int32_t>{t.d, t.a}));
  // 5 MiB: c, then a (250 ns per MiB); d no longer fits.
  TopUp five = top_up({t.call()}, 5 * kMiB);
  ASSERT_EQ(five.changes.size(), 1u);
  EXPECT_EQ(five.changes[0].values, (std::vector<int32_t>{t.c, t.a}));
  EXPECT_EQ(five.added_bytes, 5 * kMiB);
  EXPECT_DOUBLE_EQ(five.saved_ns, 1500);
  // Nothing fits under 1 MiB; a negative room changes nothing.
  EXPECT_TRUE(top_up({t.call()}, kMiB - 1).changes.empty());
  EXPECT_TRUE(top_up({t.call()}, -1).changes.empty());
}

// TopUpOptions::max_cells bounds the simulation work: with no budget nothing is evaluated and nothing changes (no
// error), and a budget of one evaluation's work still lets the first check run but no option.
TEST(PlannerTopUp, TheSimulationBudgetStopsTheSearchWithoutError) {
  const Three t;
  TopUpOptions none;
  none.max_cells = 0;
  EXPECT_TRUE(top_up({t.call()}, 5 * kMiB, none).changes.empty());
  TopUpOptions ample;
  ample.max_cells = int64_t{1} << 40;
  EXPECT_EQ(top_up({t.call()}, 5 * kMiB, ample).changes.size(), 1u);  // as with the default budget
}

TEST(PlannerTopUp, AcrossCallsTheBestValueOfAnyCallFirst) {
  const Three t;
  TopUpCall kept_c = t.call();
  kept_c.keep = {0, 1, 0};  // the first call keeps c already
  kept_c.shape.order = {t.d, t.a};
  const TopUp up = top_up({kept_c, t.call()}, kMiB);
  ASSERT_EQ(up.changes.size(), 1u);
  EXPECT_EQ(up.changes[0].call, 1u);  // the second call's c (500 ns per MiB) beats the first's d (10)
  EXPECT_EQ(up.changes[0].values, (std::vector<int32_t>{t.c}));
}

TEST(PlannerTopUp, AValueWhoseStorageStaysResidentIsFree) {
  ProblemBuilder pb;
  const int32_t x = pb.ext();
  const int32_t a = pb.op("big", 1000, {x}, 4 * kMiB);
  const int32_t v = pb.alias("view", 5, a);  // shares a's storage
  pb.save(a);
  pb.save(v);
  TopUpCall c;
  c.problem = &pb.problem;
  c.keep = {1, 0};  // a kept: v's storage is resident
  c.shape.order = {v};
  const TopUp up = top_up({c}, 0);
  ASSERT_EQ(up.changes.size(), 1u);
  EXPECT_EQ(up.changes[0].values, (std::vector<int32_t>{v}));
  EXPECT_EQ(up.added_bytes, 0);
  EXPECT_DOUBLE_EQ(up.saved_ns, 5);
  EXPECT_TRUE(up.changes[0].schedule.order.empty());
}

TEST(PlannerTopUp, AViewOfAnExternalStorageIsNotKept) {
  ProblemBuilder pb;
  const int32_t x = pb.ext();
  const int32_t v = pb.alias("view", 5, x);
  pb.save(v);
  TopUpCall c;
  c.problem = &pb.problem;
  c.keep = {0};
  c.shape.order = {v};
  EXPECT_TRUE(top_up({c}, 64 * kMiB).changes.empty());
}

TEST(PlannerTopUp, TheFirstValueOfASegmentWithOthersIsNeverKept) {
  // Segments [c d] [a]: keeping c would start the first segment at d's unpack, later (Note [Top-up]).
  const Three t;
  TopUpCall call = t.call();
  call.shape.order = {t.c, t.d, t.a};
  call.shape.segment_begin = {0, 2};
  call.unpack.values = {t.c, t.d, t.a};
  const TopUp up = top_up({call}, kMiB);
  ASSERT_EQ(up.changes.size(), 1u);
  EXPECT_EQ(up.changes[0].values, (std::vector<int32_t>{t.d}));  // c is the better value, but begins its segment
  // With room for a: a's segment disappears, and in the one segment left c may go (its start moves to d's unpack,
  // with nothing held for it).
  const TopUp more = top_up({call}, 5 * kMiB);
  ASSERT_EQ(more.changes.size(), 1u);
  EXPECT_EQ(more.changes[0].values, (std::vector<int32_t>{t.a, t.c}));
  EXPECT_EQ(more.changes[0].schedule.segments(), 1);
  EXPECT_EQ(more.changes[0].schedule.order, (std::vector<int32_t>{t.d}));
}

TEST(PlannerTopUp, ACallWhoseScheduleTheModelDoesNotReproduceIsLeftAlone) {
  const Three t;
  TopUpCall holds = t.call();
  holds.shape.segment_begin = {0, 1, 2};
  holds.unpack.values = {t.d, t.c, t.a};
  holds.shape.holds = {ScheduleHold{t.x, 0, 2}};  // an external value is never held
  EXPECT_TRUE(top_up({holds}, 64 * kMiB).changes.empty());
  TopUpCall missing = t.call();
  missing.shape.order = {t.d, t.c};  // a is dropped but not in the order
  EXPECT_TRUE(top_up({missing}, 64 * kMiB).changes.empty());
  TopUpCall bad = t.call();
  bad.keep = {0, 0};
  EXPECT_THROW(top_up({bad}, kMiB), Error);
}

}  // namespace
}  // namespace tapesac::planner
