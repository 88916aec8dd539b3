// Tests of the sequence (max-plus) peak model and of planning under it (peak_model.h, step.h): window profiles of
// a timeline, exact calibration, the terms that set the peak, and plans that fit the model's prediction.
#include <algorithm>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "planner_test_util.h"
#include "tapesac/planner/peak_model.h"
#include "tapesac/planner/step.h"

namespace tapesac::planner {
namespace {

using testing::kMiB;

// Two calls: forwards [10, 20) and [20, 30), the tail [30, 40), replays of call 1 at 40 and of call 0 at 60.
std::vector<TimedBytes> two_call_timeline() {
  return {{5, 100}, {12, 300}, {18, 150}, {22, 400}, {28, 200}, {35, 260}, {41, 500}, {50, 420},
          {61, 610}, {70, 90}};
}

TEST(StepProfile, WindowPeaksFromTheTimeline) {
  const StepProfile p = profile_step(two_call_timeline(), {10, 20}, {20, 30}, {60, 40}, /*offset=*/1000);
  ASSERT_TRUE(p.valid);
  EXPECT_EQ(p.pre_peak, 1100);
  EXPECT_EQ(p.forward_peaks, (std::vector<int64_t>{1300, 1400}));
  EXPECT_EQ(p.tail_peak, 1260);
  EXPECT_EQ(p.backward_peaks, (std::vector<int64_t>{1610, 1500}));  // call 0's window is the last
}

TEST(StepProfile, InvalidWithoutEveryReplayOrWithOverlaps) {
  const auto tl = two_call_timeline();
  EXPECT_FALSE(profile_step(tl, {10, 20}, {20, 30}, {40, -1}, 0).valid);       // call 1 did not replay
  EXPECT_FALSE(profile_step(tl, {10, 15}, {20, 30}, {40, 60}, 0).valid);       // forwards overlap
  EXPECT_FALSE(profile_step(tl, {10, 20}, {20, 30}, {25, 60}, 0).valid);       // a replay inside the forward
  EXPECT_FALSE(profile_step({}, {10, 20}, {20, 30}, {40, 60}, 0).valid);
}

TEST(StepProfile, WindowWithoutPointsInheritsTheBytesAtItsStart) {
  const StepProfile p = profile_step({{5, 10}, {15, 50}, {25, 40}, {45, 70}}, {10}, {20}, {30}, 0);
  ASSERT_TRUE(p.valid);
  EXPECT_EQ(p.tail_peak, 40);
  EXPECT_EQ(p.backward_peaks, (std::vector<int64_t>{70}));
}

TEST(SequencePeakModel, CalibrationReproducesTheMeasuredPeakAndMovesWithKeptBytes) {
  const StepProfile p = profile_step(two_call_timeline(), {10, 20}, {20, 30}, {60, 40}, 1000);
  const std::vector<int64_t> kept{10, 20}, ws{50, 60};
  const SequencePeakModel m = SequencePeakModel::calibrate(p, kept, ws);
  ASSERT_TRUE(m.valid);
  EXPECT_EQ(m.predict(kept, ws), 1610);  // the measured step peak
  // Keeping 300 more in call 1 (and replaying 60 less) raises its own backward window and the tail, not call 0's
  // forward or backward window.
  EXPECT_EQ(m.forward_c[0], 1300);
  EXPECT_EQ(m.predict({10, 320}, {50, 0}), 1500 + 300 - 60);
  // Keeping more in call 0 raises every later window, including call 0's backward (the last one).
  EXPECT_EQ(m.predict({210, 20}, {0, 60}), 1610 + 200 - 50);
  EXPECT_THROW(m.predict({1}, {1}), Error);
  EXPECT_FALSE(SequencePeakModel::calibrate(StepProfile{}, kept, ws).valid);
}

// Note [Keep-everything ceiling]: two calls that dropped 40 and 70 bytes, forwards ending at 20 and 30, last replays
// at 60 (call 0) and 40 (call 1); replay bytes alive at 41, 50 and 61.
TEST(KeepAllCeiling, AddsWhatThePlanDroppedUntilEachCallsLastReplay) {
  std::vector<TimedBytes> t = two_call_timeline();
  t[6].replay_bytes = 300;  // {41, 500}: call 1's replay, 300 of it its transients and rebuilt values
  t[7].replay_bytes = 20;   // {50, 420}
  t[8].replay_bytes = 500;  // {61, 610}: call 0's replay
  const std::vector<int64_t> fwd_end{20, 30}, release{60, 40}, dropped{40, 70};
  // 12: before any forward ended (300). 22, 28: call 0's 40 pending (440, 240). 35: both pending (260 + 110).
  // 41: call 1 released: 500 - 300 + min(300, 70) + 40 = 310. 50: 420 - 20 + min(20, 70) + 40 = 460. 61: both
  // released: 610 - 500 + min(500, 110) = 220.
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 1000), 1000 + 460);
  // A step that dropped (and so replayed) nothing: its measured peak.
  EXPECT_EQ(keep_all_ceiling(two_call_timeline(), fwd_end, release, {0, 0}, 1000), 1610);
  // A call that never replayed counts its dropped bytes to the end.
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, {60, -1}, dropped, 0), 420 - 20 + 0 + 40 + 70);
  EXPECT_EQ(keep_all_ceiling({}, fwd_end, release, dropped, 0), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, {60}, dropped, 0), std::numeric_limits<int64_t>::max());
}

// Note [Dropped bytes still alive]: dropped values the step held anyway (autocast's cast cache until the end of its
// region) are in bytes(t) and in the call's dropped bytes: counted once.
TEST(KeepAllCeiling, CountsDroppedValuesStillAliveOnce) {
  std::vector<TimedBytes> t = two_call_timeline();
  t[6].replay_bytes = 300;  // as in AddsWhatThePlanDroppedUntilEachCallsLastReplay: 460 at 50, 440 at 22
  t[7].replay_bytes = 20;
  t[8].replay_bytes = 500;
  const std::vector<int64_t> fwd_end{20, 30}, release{60, 40}, dropped{40, 70};
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0), 460);
  t[3].dropped_alive = 30;  // of call 0's 40, 30 were still alive at 22 (and at 50)
  t[7].dropped_alive = 30;
  // 22: 400 - 30 + 40; 35: 260 + 110; 50: 420 - 20 + 20 - 30 + 40.
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0), 430);
}

// Dropped values the step held anyway, by call (CallAlive): counted once only while their call's dropped bytes are
// pending. After the call's last replay began they are in bytes(t) alone (a value alive at its unpack is served,
// not rebuilt): subtracting them then would leave them out (random program 2141).
TEST(KeepAllCeiling, CountsACallsDroppedValuesStillAliveOnlyWhileThatCallIsPending) {
  std::vector<TimedBytes> t = two_call_timeline();
  t[6].replay_bytes = 300;
  t[7].replay_bytes = 20;
  t[8].replay_bytes = 500;
  const std::vector<int64_t> fwd_end{20, 30}, release{60, 40}, dropped{40, 70};
  // 30 of call 1's 70 alive from 31 to 55. Pending at 35 (260 - 30 + 110); at 41 and 50 call 1 is released:
  // 310 and 460 (as without them), so 50's 460 is the ceiling.
  const std::vector<CallAlive> call1{{31, 1, 30}, {55, 1, -30}};
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {}, &call1), 460);
  // The same bytes as the points' dropped_alive (no call): subtracted at 35, 41 and 50, so 22's 440 is the top.
  for (size_t i : {5, 6, 7}) t[i].dropped_alive = 30;
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0), 440);
  // Given by call, the points' dropped_alive is not read; a change of no known call is subtracted throughout.
  const std::vector<CallAlive> unknown{{31, -1, 30}, {55, -1, -30}};
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {}, &call1), 460);
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {}, &unknown), 440);
  // Call 0's 30 alive from 21 to 55: pending there until 60, subtracted at 22 (410), 35 (340), 50 (430).
  const std::vector<CallAlive> call0{{55, 0, -30}, {21, 0, 30}};  // in any order
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {}, &call0), 430);
}

// Copies that undo writes for replays (replay/preserve.h) are held from their save to the step's end; keeping
// everything saves none: left out from the save on, never before it.
TEST(KeepAllCeiling, LeavesOutTheCopiesMadeForReplaysFromTheirSave) {
  const std::vector<TimedBytes> t = two_call_timeline();
  const std::vector<int64_t> fwd_end{20, 30}, release{60, 40}, dropped{40, 70};
  // Without them: 540 at 41 (500 + 40 pending), 460 at 50, 610 at 61, the largest.
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0), 610);
  // Saved at 45: 360 at 50 and 510 at 61, so 41's 540 is the ceiling.
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {{45, 100}}), 540);
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {{5, 100}}), 510);  // alive at every point
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {{70, 100}}), 610);  // after the last point
  // Two saves: 30 from 5 on, 100 from 55 on: 510 at 41, 480 at 61.
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {}, {{5, 30}, {55, 100}}), 510);
}

// A block input held only for the replays (autocast cast it first; the forward saved the cast) is not held by
// keeping everything: from the call's forward end to the step's end.
TEST(KeepAllCeiling, LeavesOutWhatACallHeldOnlyForItsReplays) {
  const std::vector<TimedBytes> t = two_call_timeline();
  const std::vector<int64_t> fwd_end{20, 30}, release{60, 40}, dropped{40, 70};
  // At 22: 400 + 40 pending - call 0's 16 held. At 35: 260 + 110 - 16 - 8. At 41 (call 1 released, still held):
  // 500 + 40 - 24. At 50: 420 + 40 - 24. At 61: 610 - 24, the largest; without `held`, 610 too (both released).
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {16, 8}), 586);
  // Call 0 held 100 for its replays: 440 at 41, 510 at 61.
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {100, 0}), 510);
  EXPECT_EQ(keep_all_ceiling(t, fwd_end, release, dropped, 0, {16}), std::numeric_limits<int64_t>::max());
}

TEST(SequencePeakModel, ABaselineShiftMovesEveryPrediction) {
  const StepProfile p = profile_step(two_call_timeline(), {10, 20}, {20, 30}, {60, 40}, 1000);
  SequencePeakModel m = SequencePeakModel::calibrate(p, {10, 20}, {50, 60});
  ASSERT_TRUE(m.valid);
  const int64_t before = m.predict({210, 20}, {0, 60});
  m.baseline_shift = 4096;
  EXPECT_EQ(m.predict({10, 20}, {50, 60}), 1610 + 4096);
  EXPECT_EQ(m.predict({210, 20}, {0, 60}), before + 4096);
}

// Issue 18 item 5 (Note [Sequence model in unusual steps]): a graph retained across backwards keeps every call's
// kept bytes alive while the first backward runs; the last backward's windows are as in a plain step.
TEST(SequencePeakModel, ARetainedGraphCountsEveryCallsKeptBytesUntilTheLastBackward) {
  // The measured step dropped everything (kept 0): calibration is the same with and without `retained`.
  const StepProfile p = profile_step(two_call_timeline(), {10, 20}, {20, 30}, {60, 40}, 1000);
  const std::vector<int64_t> none{0, 0}, ws{50, 60};
  const SequencePeakModel plain = SequencePeakModel::calibrate(p, none, ws);
  StepExtras retained;
  retained.retained = true;
  const SequencePeakModel r = SequencePeakModel::calibrate(p, none, ws, retained);
  ASSERT_TRUE(r.valid);
  EXPECT_EQ(r.predict(none, ws), plain.predict(none, ws));
  // Keeping 500 in call 1 (the first backwarded): without a retained graph call 1 has freed it before call 0's
  // window (the largest); with one it is still alive there.
  EXPECT_EQ(plain.predict({0, 500}, {50, 0}), std::max<int64_t>(1610, 1500 + 500 - 60));
  EXPECT_EQ(r.predict({0, 500}, {50, 0}), 1610 + 500);
  // Measured last-backward windows: they count only the calls not yet backwarded.
  StepExtras with_last = retained;
  with_last.last_backward = profile_step(two_call_timeline(), {10, 20}, {20, 30}, {65, 45}, 1000);
  const SequencePeakModel rl = SequencePeakModel::calibrate(p, none, ws, with_last);
  ASSERT_EQ(rl.last_backward_c.size(), 2u);
  EXPECT_EQ(rl.predict({0, 500}, {50, 0}), 1610 + 500);  // the first backward's window of call 0 still counts it
  EXPECT_EQ(rl.last_backward_c[1], with_last.last_backward.backward_peaks[1] - 60);
}

// Issue 18 item 5 (Note [dropped values alive elsewhere]): bytes a dropped value held anyway (a module stored it)
// are in the measured windows; a plan that keeps it must not pay for them twice.
TEST(SequencePeakModel, DroppedValuesAliveAnywayAreNotCountedTwiceWhenKept) {
  // The working sets alive at the windows' peaks (41: call 1's 60, 61: call 0's 50), as the timeline shows them.
  std::vector<TimedBytes> t = two_call_timeline();
  t[6].replay_bytes = 60;
  t[8].replay_bytes = 50;
  const StepProfile p = profile_step(t, {10, 20}, {20, 30}, {60, 40}, 1000);
  const std::vector<int64_t> none{0, 0}, ws{50, 60}, all{100, 100}, nothing{0, 0};
  const SequencePeakModel plain = SequencePeakModel::calibrate(p, none, ws);
  StepExtras alive;
  alive.alive_forward = {100, 0};   // call 0's dropped values stayed alive through the forward
  alive.alive_backward = {100, 0};  // and into the backward
  const SequencePeakModel m = SequencePeakModel::calibrate(p, none, ws, alive);
  // Keeping what was alive anyway costs nothing: the measured step's peak (the planner keeps them in every plan).
  EXPECT_EQ(m.predict({100, 0}, ws), plain.predict(none, ws));
  EXPECT_EQ(plain.predict(all, nothing) - m.predict(all, nothing), 100);  // keeping everything: 100 less
}

// Note [Window of a call keeping more]: call 0's window peaks after its replay (at 55: 80 of the 100 it rebuilt
// still alive, its 60 bytes of transients gone, on top of 300 of gradients). A plan keeping most of those 100
// bytes and replaying the rest is not lower than that moment (the kept values live as the rebuilt ones did); the
// working-set term alone put it 60 lower. The plan that ran is predicted as measured.
TEST(SequencePeakModel, AWindowPeakingAfterItsReplayIsNotLoweredByTheTransientsAPlanAvoids) {
  // Forward [10, 20); call 0 replays at 40 (working set 160: 100 rebuilt, 60 transients).
  const std::vector<TimedBytes> tl{{5, 0, 0}, {15, 100, 0}, {25, 0, 0}, {41, 160, 160}, {45, 100, 100},
                                   {55, 380, 80}, {70, 380, 80}, {80, 0, 0}};
  const StepProfile p = profile_step(tl, {10}, {20}, {40}, 0);
  ASSERT_TRUE(p.valid);
  const SequencePeakModel m = SequencePeakModel::calibrate(p, {0}, {160});
  ASSERT_TRUE(m.valid);
  EXPECT_EQ(m.predict({0}, {160}), 380);
  // Keeping 90 of them and replaying the other 10: 300 of gradients + the 80 still alive then (the working-set
  // term alone: 380 - 160 + 90 + 10 = 320).
  EXPECT_EQ(m.predict({90}, {10}), 380);
  EXPECT_EQ(m.backward_c[0] + 90 + 10, 320);
  // Keeping 40 of them (replaying the other 60 with 40 of transients): still at most what the step had alive.
  EXPECT_EQ(m.predict({40}, {100}), 380);
  // Keeping everything (no replay) is left to the working-set term and the keep-everything ceiling.
  EXPECT_EQ(m.predict({100}, {0}), 320);
}

// Note [Working set larger than the measured one]: a lazy measuring step held at most 100 replay bytes at once (at
// 41), and its window peaked at 55 with 20 of them alive (rest 380). A plan rebuilding 250 at once may do so when
// the rest is at its largest: 380 + 250, not the window's peak less the measured working set plus the new one.
TEST(SequencePeakModel, AWorkingSetLargerThanTheMeasuredOneIsChargedOnTheLargestRest) {
  const std::vector<TimedBytes> tl{{5, 0, 0}, {15, 100, 0}, {25, 0, 0}, {41, 300, 100}, {55, 400, 20},
                                   {70, 200, 0}, {80, 0, 0}};
  const StepProfile p = profile_step(tl, {10}, {20}, {40}, 0);
  ASSERT_TRUE(p.valid);
  const SequencePeakModel m = SequencePeakModel::calibrate(p, {0}, {100});
  ASSERT_TRUE(m.valid);
  EXPECT_EQ(m.predict({0}, {100}), 400);   // the plan that ran: the measured peak
  // Replaying less at once: as before, the window's level at 55 (rest 380 and the 20 replay bytes it had alive).
  EXPECT_EQ(m.predict({0}, {80}), 400);
  EXPECT_EQ(m.predict({0}, {250}), 630);   // the largest rest (380) plus the whole new working set
  EXPECT_EQ(m.backward_c[0] + 250, 550);   // what the working-set term alone predicted
}

// The same window, its replays spread over it (the lazy measuring step of auto with planned schedules: StepExtras::
// spread). A plan replaying less at once, or keeping more, replays at other moments: any plan other than the one
// that ran is charged on the largest rest (random program 5: a one-segment replay of 1,152 bytes, where the lazy
// step's largest was 1,200, met a larger rest and ran 200 bytes over its prediction).
TEST(SequencePeakModel, AnyOtherPlanOfACallWhoseReplaysWereSpreadIsChargedOnTheLargestRest) {
  const std::vector<TimedBytes> tl{{5, 0, 0}, {15, 100, 0}, {25, 0, 0}, {41, 300, 100}, {55, 400, 20},
                                   {70, 200, 0}, {80, 0, 0}};
  const StepProfile p = profile_step(tl, {10}, {20}, {40}, 0);
  StepExtras spread;
  spread.spread = {1};
  const SequencePeakModel m = SequencePeakModel::calibrate(p, {0}, {100}, spread);
  ASSERT_TRUE(m.valid);
  EXPECT_EQ(m.predict({0}, {100}), 400);  // the plan that ran: the measured peak
  EXPECT_EQ(m.predict({0}, {80}), 460);   // 380 + 80: not 400 as for a replay at the measured moment
  EXPECT_EQ(m.predict({30}, {50}), 460);  // 380 + 30 kept + 50
  EXPECT_EQ(m.predict({0}, {250}), 630);
  // Without the flag (one segment ran), as in AWorkingSetLargerThanTheMeasuredOneIsChargedOnTheLargestRest.
  const SequencePeakModel one = SequencePeakModel::calibrate(p, {0}, {100});
  EXPECT_EQ(one.predict({0}, {80}), 400);
}

// Issue 18 item 5: inputs held only for the replay (a block input autocast casts first) are freed by a plan that
// keeps everything, and held by one that replays.
TEST(SequencePeakModel, InputsHeldForTheReplayAreFreedWhenNothingReplays) {
  const StepProfile p = profile_step(two_call_timeline(), {10, 20}, {20, 30}, {60, 40}, 1000);
  const std::vector<int64_t> none{0, 0}, ws{50, 60};
  const SequencePeakModel plain = SequencePeakModel::calibrate(p, none, ws);
  StepExtras held;
  held.held_for_replay = {40, 40};
  held.keep_all = {100, 100};
  const SequencePeakModel m = SequencePeakModel::calibrate(p, none, ws, held);
  EXPECT_EQ(m.predict(none, ws), 1610);  // the step that ran
  // Keeping everything frees both calls' inputs; the largest window (call 0's backward) counted call 0's.
  EXPECT_EQ(plain.predict({100, 100}, {0, 0}), 1660);
  EXPECT_EQ(m.predict({100, 100}, {0, 0}), 1620);
  // A plan keeping less than everything in call 0 still holds call 0's inputs there.
  EXPECT_EQ(m.predict({90, 100}, {10, 0}), plain.predict({90, 100}, {10, 0}));
}

// Note [Backward levels]: the levels that bound max over levels of rest + min(k, replay) for every k.
TEST(BackwardLevels, ReduceKeepsTheUndominatedLevelsAndNeverLowersTheMaximum) {
  const std::vector<RestLevel> raw{{10, 5}, {8, 20}, {9, 1}, {3, 30}, {8, 2}, {1, 1}};
  const std::vector<RestLevel> all = reduce_levels(raw);
  ASSERT_EQ(all.size(), 3u);  // (10, 5), (8, 20), (3, 30): the others are dominated
  for (int64_t k : {0, 1, 4, 12, 25, 40}) {
    int64_t want = 0, got = 0, merged = 0;
    for (const RestLevel& l : raw) want = std::max(want, l.rest + std::min(k, l.replay));
    for (const RestLevel& l : all) got = std::max(got, l.rest + std::min(k, l.replay));
    for (const RestLevel& l : reduce_levels(raw, 1)) merged = std::max(merged, l.rest + std::min(k, l.replay));
    EXPECT_EQ(got, want) << "k=" << k;
    EXPECT_GE(merged, want) << "k=" << k;
  }
}

// Issue 18 item 5, double backward: the window of the call backwarded last peaks after its replay, while a graph
// the first backward built holds part of every call's rebuilt values (60 of 100 each). The plan that ran is
// predicted exactly, and keeping everything at the window's rest plus what it keeps — not at the peak less the
// working set plus what it keeps (20 bytes over; measured 49,152 over on the test's stack).
TEST(BackwardLevels, ARetainedGraphSubtractsOnlyTheReplayBytesAliveAtThePeak) {
  // Forwards [10, 20) and [20, 30), the tail to 40, call 1 replays at 40, call 0 at 60, the second backward at 80.
  const std::vector<TimedBytes> tl{{5, 0, 0},      {15, 50, 0},     {25, 80, 0},     {35, 90, 0},
                                   {41, 190, 100}, {45, 230, 60},   {61, 330, 160},  {65, 380, 120},
                                   {70, 420, 120}, {81, 200, 0}};
  const StepProfile p = profile_step(tl, {10, 20}, {20, 30}, {60, 40}, 1000, /*end_ns=*/80);
  ASSERT_TRUE(p.valid);
  EXPECT_EQ(p.backward_peaks, (std::vector<int64_t>{1420, 1230}));
  StepExtras retained;
  retained.retained = true;
  const std::vector<int64_t> none{0, 0}, ws{100, 100};
  const SequencePeakModel m = SequencePeakModel::calibrate(p, none, ws, retained);
  ASSERT_TRUE(m.valid);
  EXPECT_EQ(m.predict(none, ws), 1420);
  EXPECT_EQ(m.predict({100, 100}, {0, 0}), 1300 + 200);  // rest at the peak (1420 - 120) + everything kept
  EXPECT_LT(m.predict({100, 100}, {0, 0}), 1420 - 100 + 200);  // what the working-set term predicted
  // Calibrated on a plan that kept 40 of call 1 (those the graph held: 20 of its rebuilt values remain alive):
  // the same predictions.
  const std::vector<TimedBytes> tl2{{5, 0, 0},     {15, 50, 0},    {25, 120, 0},   {35, 130, 0},
                                    {41, 190, 60}, {45, 230, 20},  {61, 330, 120}, {65, 380, 80},
                                    {70, 420, 80}, {81, 240, 0}};
  const StepProfile p2 = profile_step(tl2, {10, 20}, {20, 30}, {60, 40}, 1000, 80);
  ASSERT_TRUE(p2.valid);
  const SequencePeakModel m2 = SequencePeakModel::calibrate(p2, {0, 40}, {100, 60}, retained);
  EXPECT_EQ(m2.predict({0, 40}, {100, 60}), 1420);
  EXPECT_EQ(m2.predict({100, 100}, {0, 0}), 1500);
}

// Issue 18 item 5, retain_graph: one call whose values A (60 bytes, unpacked first) and B (40, unpacked later) the
// measured step both rebuilt at the window's start. A plan keeping A and dropping B replays B late, on top of the
// gradients the backward allocated meanwhile, while the retained graph keeps A alive: the working-set model put that
// plan at the measured peak (60 under); the levels put it at the late moment's rest plus A plus B.
TEST(BackwardLevels, ARetainedGraphChargesALateReplayOnTopOfTheGradients) {
  const std::vector<TimedBytes> tl{{5, 0, 0},      {15, 100, 0},   {25, 0, 0},     {41, 100, 100},
                                   {45, 150, 100}, {50, 90, 40},   {55, 160, 40},  {60, 120, 0}};
  const StepProfile p = profile_step(tl, {10}, {20}, {40}, 0);
  ASSERT_TRUE(p.valid);
  StepExtras retained;
  retained.retained = true;
  const SequencePeakModel m = SequencePeakModel::calibrate(p, {0}, {100}, retained);
  EXPECT_EQ(m.predict({0}, {100}), 160);
  EXPECT_EQ(m.predict({60}, {40}), 120 + 60 + 40);
  EXPECT_EQ(m.predict({100}, {0}), 120 + 100);
  const SequencePeakModel plain = SequencePeakModel::calibrate(p, {0}, {100});
  EXPECT_EQ(plain.predict({60}, {40}), 160);  // without a retained graph A dies at its last unpack
}

// Note [Backward levels] with Note [dropped values alive elsewhere]: in a retained graph's levels too, a dropped value
// alive anyway is not a replay byte; keeping it costs nothing.
TEST(BackwardLevels, DroppedValuesAliveAnywayAreNotCountedTwiceInARetainedGraph) {
  const StepProfile p = profile_step(two_call_timeline(), {10, 20}, {20, 30}, {60, 40}, 1000);
  const std::vector<int64_t> none{0, 0}, ws{50, 60};
  StepExtras retained;
  retained.retained = true;
  const SequencePeakModel r = SequencePeakModel::calibrate(p, none, ws, retained);
  StepExtras alive = retained;
  alive.alive_forward = {100, 0};
  alive.alive_backward = {100, 0};
  const SequencePeakModel m = SequencePeakModel::calibrate(p, none, ws, alive);
  ASSERT_EQ(m.backward_levels.size(), 2u);
  EXPECT_EQ(m.predict({100, 0}, ws), r.predict(none, ws));
  EXPECT_EQ(r.predict({100, 100}, {0, 0}) - m.predict({100, 100}, {0, 0}), 100);
}

StepInput step_of(int n_calls, uint64_t seed) {
  testing::RandomOptions o;
  o.n_ops = 25;
  o.n_candidates = 8;
  const std::vector<BlockProblem> problems{testing::random_problem(seed, o)};
  std::vector<const BlockProblem*> calls(static_cast<size_t>(n_calls), &problems[0]);
  return build_step_input(calls);
}

// A model with gradients growing through the backward: later windows (earlier calls) have larger constants.
SequencePeakModel growing_model(int n_calls) {
  SequencePeakModel m;
  m.valid = true;
  m.pre = 10 * kMiB;
  for (int k = 0; k < n_calls; ++k) {
    m.forward_c.push_back(12 * kMiB);
    m.backward_c.push_back((20 + 2 * (n_calls - k)) * kMiB);
  }
  m.tail_c = 11 * kMiB;
  return m;
}

TEST(PlanStepSequence, PlansFitTheModelAndCostFallsWithTheLimit) {
  const int n = 6;
  const StepInput in = step_of(n, 7);
  const SequencePeakModel m = growing_model(n);
  const StepPlan all = plan_step(in, m, std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(all.keeps_everything);
  EXPECT_EQ(all.replay_cost_ns, 0);
  double previous = std::numeric_limits<double>::infinity();
  std::vector<int64_t> kept, ws;
  for (int k = 0; k <= 10; ++k) {
    const int64_t limit = all.min_feasible_peak_bytes + (all.keep_all_peak_bytes - all.min_feasible_peak_bytes) * k / 10;
    const StepPlan p = plan_step(in, m, limit);
    plan_profile(p, &kept, &ws);
    EXPECT_EQ(p.predicted_peak_bytes, m.predict(kept, ws));
    EXPECT_LE(p.predicted_peak_bytes, limit);
    EXPECT_LE(p.replay_cost_ns, previous + 1e-6);
    previous = p.replay_cost_ns;
  }
  EXPECT_THROW(plan_step(in, m, all.min_feasible_peak_bytes - 1), InfeasibleLimitError);
  // At the keep-everything prediction: keep everything; a byte below, not (no tolerance: the runtime bounds keeping
  // everything by the measured timeline instead, Note [Keep-everything ceiling]).
  EXPECT_TRUE(plan_step(in, m, all.keep_all_peak_bytes).keeps_everything);
  EXPECT_FALSE(plan_step(in, m, all.keep_all_peak_bytes - 1).keeps_everything);
}

// Note [Keeping everything by the ceiling] (runtime/src/auto_planner.cpp): with keeping everything ruled out (the
// runtime's ceiling says it does not fit), a limit at or above the model's keep-everything prediction gets the best
// plan that drops, still within the limit; one below the least-memory plan still throws.
TEST(PlanStepSequence, KeepingEverythingRuledOutGivesAPlanThatDrops) {
  const int n = 4;
  const StepInput in = step_of(n, 5);
  const SequencePeakModel m = growing_model(n);
  const StepPlan all = plan_step(in, m, std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(all.keeps_everything);
  for (const int64_t limit : {all.keep_all_peak_bytes, all.keep_all_peak_bytes + kMiB}) {
    const StepPlan p = plan_step(in, m, limit, /*keep_all=*/false);
    EXPECT_FALSE(p.keeps_everything) << limit;
    EXPECT_LE(p.predicted_peak_bytes, limit);
    EXPECT_GT(p.replay_cost_ns, 0) << "a plan that drops replays";
    EXPECT_EQ(p.keep_all_peak_bytes, all.keep_all_peak_bytes);  // still reported
    int64_t kept = 0;
    for (const CallPlan& c : p.calls) kept += c.kept_bytes;
    EXPECT_LT(kept, all.sum_kept_bytes);
  }
  EXPECT_THROW(plan_step(in, m, all.min_feasible_peak_bytes - 1, /*keep_all=*/false), InfeasibleLimitError);
}

TEST(PlanStepSequence, LaterCallsKeepMore) {
  // The backward frees the last call first: with equal problems, a plan never keeps more in an earlier call.
  const int n = 8;
  const StepInput in = step_of(n, 11);
  const SequencePeakModel m = growing_model(n);
  const StepPlan all = plan_step(in, m, std::numeric_limits<int64_t>::max());
  const StepPlan p = plan_step(in, m, (all.min_feasible_peak_bytes + all.keep_all_peak_bytes) / 2);
  for (size_t j = 1; j < p.calls.size(); ++j) EXPECT_LE(p.calls[j - 1].kept_bytes, p.calls[j].kept_bytes);
}

}  // namespace
}  // namespace tapesac::planner
