// Tests of the replay schedule's segmenting (replay/schedule.h, Note [Replay schedule]) on hand-made tapes
// (tape_builder.h): the guessed unpack order, segments, what hold_everything() holds, what a segment's replay must
// also return (plan_segment's extras), and which values may be held at all.
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/common/errors.h"
#include "tapesac/replay/prune.h"
#include "tapesac/replay/schedule.h"
#include "tape_builder.h"

namespace tapesac::replay {
namespace {

using Values = std::vector<ValueId>;

// Per ValueId, the state each target is read at (hold_everything's `state`).
std::vector<int32_t> states(const TapeBuilder& b, const Values& targets) {
  std::vector<int32_t> s(b.tape.values().size(), -1);
  for (ValueId v : targets) s[static_cast<size_t>(v)] = b.now(v).state;
  return s;
}

TEST(Schedule, GuessedOrderPlacesEachValueByItsLastSaveLatestFirst) {
  // Saved in pack order a, b, a, (kept), c: backward needs c first, then a (saved last at position 2), then b.
  EXPECT_EQ(guessed_order({3, 5, 3, -1, 7}), (Values{7, 3, 5}));
  EXPECT_TRUE(guessed_order({}).empty());
}

TEST(Schedule, SegmentsOfOneSegmentAndPerValueSchedules) {
  const ReplaySchedule one = one_segment({4, 2, 9});
  EXPECT_EQ(one.segments(), 1);
  EXPECT_EQ(one.segment(0), (Values{4, 2, 9}));
  EXPECT_TRUE(one.segment(1).empty());
  const ReplaySchedule fine = per_value_segments({4, 2, 9});
  EXPECT_EQ(fine.segments(), 3);
  EXPECT_EQ(fine.segment(1), (Values{2}));
  const std::vector<int32_t> index = segment_index(fine, 10);
  EXPECT_EQ(index[4], 0);
  EXPECT_EQ(index[2], 1);
  EXPECT_EQ(index[9], 2);
  EXPECT_EQ(index[0], -1);
  EXPECT_EQ(ReplaySchedule{}.segments(), 0);
  ReplaySchedule two = one_segment({1, 2, 3, 4});
  two.segment_begin = {0, 3};
  EXPECT_EQ(two.segments(), 2);
  EXPECT_EQ(two.segment(0), (Values{1, 2, 3}));
  EXPECT_EQ(two.segment(1), (Values{4}));
}

TEST(Schedule, ParseForcedScheduleRejectsUnknownShapes) {
  EXPECT_EQ(parse_forced_schedule("lazy"), ForcedSchedule::kLazy);
  EXPECT_EQ(parse_forced_schedule("hold_all"), ForcedSchedule::kHoldAll);
  EXPECT_EQ(parse_forced_schedule("one_segment"), ForcedSchedule::kOneSegment);
  EXPECT_THROW(parse_forced_schedule("eager"), Error);
}

TEST(Schedule, OnlyAnInternalValueAtItsStoragesFinalStateIsHoldable) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::relu", {x});
  const ValueId a2 = b.inplace("aten::mul_", a, {x});  // a's storage is written later: a is not at its final state
  const ValueId v = b.view("aten::view", a2);
  EXPECT_FALSE(holdable(b.tape, x));  // external
  EXPECT_FALSE(holdable(b.tape, a));
  EXPECT_TRUE(holdable(b.tape, a2));
  EXPECT_TRUE(holdable(b.tape, v));
  EXPECT_FALSE(holdable(b.tape, -1));
}

// x -> a = relu(x) -> c = tanh(a), b = exp(a); backward needs c first, then b.
struct Fork {
  TapeBuilder b;
  ValueId x, a, c, bv;
  Fork() {
    x = b.ext();
    a = b.op("aten::relu", {x});
    c = b.op("aten::tanh", {a});
    bv = b.op("aten::exp", {a});
  }
};

TEST(Schedule, HoldEverythingHoldsTheSharedIntermediateForTheLaterSegment) {
  Fork f;
  const ReplaySchedule s = per_value_segments({f.c, f.bv});
  const std::vector<uint8_t> avail = f.b.keep({});
  const std::vector<ScheduleHold> holds = hold_everything(f.b.tape, s, states(f.b, {f.c, f.bv}), avail);
  ASSERT_EQ(holds.size(), 1u);
  EXPECT_EQ(holds[0].value, f.a);
  EXPECT_EQ(holds[0].from, 0);
  EXPECT_EQ(holds[0].until, 1);

  // Segment 0's replay returns `a` besides its target; segment 1, with `a` held (available), runs only exp.
  ReplaySchedule held = s;
  held.holds = holds;
  std::vector<int32_t> from;
  const std::vector<int32_t> until = hold_index(held, f.b.tape.values().size(), &from);
  const SegmentReplay first = plan_segment(f.b.tape, {f.b.now(f.c)}, avail, from, until, 0);
  ASSERT_TRUE(first.plan.ok) << first.plan.reason;
  EXPECT_EQ(first.extras, (Values{f.a}));
  EXPECT_EQ(first.plan.ops.size(), 2u);
  std::vector<uint8_t> with_a = avail;
  with_a[static_cast<size_t>(f.a)] = 1;
  const SegmentReplay second = plan_segment(f.b.tape, {f.b.now(f.bv)}, with_a, from, until, 1);
  ASSERT_TRUE(second.plan.ok);
  EXPECT_TRUE(second.extras.empty());
  EXPECT_EQ(second.plan.ops, (std::vector<OpIndex>{f.b.producer(f.bv)}));
}

TEST(Schedule, WithoutHoldsTheLaterSegmentRecomputesTheSharedIntermediate) {
  Fork f;
  const std::vector<uint8_t> avail = f.b.keep({});
  const std::vector<int32_t> none(f.b.tape.values().size(), -1), zero(f.b.tape.values().size(), 0);
  const SegmentReplay first = plan_segment(f.b.tape, {f.b.now(f.c)}, avail, zero, none, 0);
  EXPECT_TRUE(first.extras.empty());
  const SegmentReplay second = plan_segment(f.b.tape, {f.b.now(f.bv)}, avail, zero, none, 1);
  EXPECT_EQ(second.plan.ops, (std::vector<OpIndex>{f.b.producer(f.a), f.b.producer(f.bv)}));
}

TEST(Schedule, AHoldFromALaterSegmentIsNotReturnedEarlier) {
  Fork f;
  ReplaySchedule s = per_value_segments({f.c, f.bv});
  s.holds = {ScheduleHold{f.a, 1, 2}};  // only a replay of segment 1 (or later) keeps `a`
  std::vector<int32_t> from;
  const std::vector<int32_t> until = hold_index(s, f.b.tape.values().size(), &from);
  EXPECT_EQ(until[static_cast<size_t>(f.a)], 2);
  EXPECT_EQ(from[static_cast<size_t>(f.a)], 1);
  const SegmentReplay first = plan_segment(f.b.tape, {f.b.now(f.c)}, f.b.keep({}), from, until, 0);
  EXPECT_TRUE(first.extras.empty());
  const SegmentReplay second = plan_segment(f.b.tape, {f.b.now(f.bv)}, f.b.keep({}), from, until, 1);
  EXPECT_EQ(second.extras, (Values{f.a}));
}

TEST(Schedule, AValueWrittenInPlaceLaterIsNeverHeld) {
  // a = relu(x); c = tanh(a); a2 = a.mul_(x); b = exp(a2): segment 1 needs a2, whose closure rewrites a's storage,
  // so `a` (not at its final state) cannot be handed from segment 0 to segment 1.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::relu", {x});
  const ValueId c = b.op("aten::tanh", {a});
  const ValueId a2 = b.inplace("aten::mul_", a, {x});
  const ValueId e = b.op("aten::exp", {a2});
  const ReplaySchedule s = per_value_segments({c, e});
  const std::vector<ScheduleHold> holds = hold_everything(b.tape, s, states(b, {c, e}), b.keep({}));
  for (const ScheduleHold& h : holds) EXPECT_NE(h.value, a);
  EXPECT_TRUE(holds.empty());
}

TEST(Schedule, AValueAnEarlierSegmentRebuiltIsHeldUntilItsOwnSegment) {
  // Backward needs b = exp(a) and then a itself: replaying b rebuilds a, which waits for segment 1.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::relu", {x});
  const ValueId e = b.op("aten::exp", {a});
  const ReplaySchedule s = per_value_segments({e, a});
  const std::vector<ScheduleHold> holds = hold_everything(b.tape, s, states(b, {e, a}), b.keep({}));
  ASSERT_EQ(holds.size(), 1u);
  EXPECT_EQ(holds[0].value, a);
  EXPECT_EQ(holds[0].until, 1);
}

}  // namespace
}  // namespace tapesac::replay
