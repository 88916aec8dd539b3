// The preservation chooser (runtime/preservation_chooser.h, Note [Preservation choice]) on figures: the trials of
// preserve="auto", pick_preservation, the per-storage choices, their bound, and a new limit.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/common/errors.h"
#include "tapesac/runtime/preservation_chooser.h"

namespace tapesac::runtime {
namespace {

using C = PreserveChoice;

// Storage identities (the chooser only compares them).
const int kBanks[4] = {};
const void* bank(int i) { return &kBanks[i]; }

PreservationStep wrote(std::vector<const void*> written, int64_t peak, double cost_ms) {
  PreservationStep s;
  s.written = std::move(written);
  s.peak_bytes = peak;
  s.cost_ms = cost_ms;
  return s;
}

PreservationChooser chooser(PreservePolicy policy, size_t max_choices = 1024) {
  PreservationChooserOptions o;
  o.policy = policy;
  o.max_choices = max_choices;
  return PreservationChooser(o);
}

TEST(PickPreservation, FromMeasuredTrials) {
  const std::vector<PreservationTrial> trials = {{C::kRegions, 1000, 5.0}, {C::kSnapshots, 1100, 2.0},
                                                 {C::kKeep, 1300, 1.0}};
  EXPECT_EQ(pick_preservation(trials, 0), C::kRegions);      // no limit: the lowest measured peak
  EXPECT_EQ(pick_preservation(trials, 2000), C::kKeep);      // all fit: the cheapest
  EXPECT_EQ(pick_preservation(trials, 1200), C::kSnapshots); // the cheapest that fits
  EXPECT_EQ(pick_preservation(trials, 500), C::kRegions);    // none fits: the lowest peak
  EXPECT_THROW(pick_preservation({}, 0), Error);
}

TEST(PickPreservation, TiesGoToTheLowerPeakOrTheCheaperThenTheFirst) {
  const std::vector<PreservationTrial> trials = {{C::kRegions, 1000, 3.0}, {C::kSnapshots, 900, 3.0},
                                                 {C::kKeep, 900, 3.0}};
  EXPECT_EQ(pick_preservation(trials, 2000), C::kSnapshots);  // equal cost: the lower peak, then the first
  EXPECT_EQ(pick_preservation(trials, 0), C::kSnapshots);
  EXPECT_EQ(parse_preserve_choice("keep"), C::kKeep);
  EXPECT_STREQ(preserve_choice_name(C::kSnapshots), "snapshots");
  EXPECT_THROW(parse_preserve_choice("sometimes"), Error);
  EXPECT_EQ(parse_preserve_policy("auto"), PreservePolicy::kAuto);
  EXPECT_THROW(parse_preserve_policy("sometimes"), Error);
}

// Note [Trials under a limit]: a mode whose bound is over the limit (or unknown) is not tried; it is recorded as
// untried and never picked. Without a limit the bounds do not matter.
TEST(PreservationChooser, UnderALimitSkipsTheModesNotBoundedWithinIt) {
  PreservationChooser c = chooser(PreservePolicy::kAuto);
  PreservationBounds b;
  b.snapshots_peak = 3600;  // over the 3,500 limit
  b.keep_peak = 3400;
  EXPECT_TRUE(c.after_step(wrote({bank(0)}, 3000, 4.0), 3500, b));  // ran regions
  EXPECT_EQ(c.choices().at(bank(0)), C::kKeep);                       // snapshots skipped: keep is next
  ASSERT_EQ(c.trials().size(), 2u);
  EXPECT_EQ(c.trials()[1].mode, C::kSnapshots);
  EXPECT_FALSE(c.trials()[1].measured);
  EXPECT_EQ(c.trials()[1].peak_bytes, 3600);
  EXPECT_FALSE(c.after_step(wrote({}, 3300, 1.0), 3500, b));  // the keep trial: the choices stay keep
  EXPECT_EQ(c.chosen(), C::kKeep);                             // fits and is the cheapest measured
  EXPECT_TRUE(c.trials()[2].measured);
  // The limit then rises: the untried mode stays out of the choice (its 3,600 was a bound, not a measurement).
  EXPECT_TRUE(c.set_limit(10000));
  EXPECT_EQ(c.chosen(), C::kKeep);
  EXPECT_TRUE(c.set_limit(0));
  EXPECT_EQ(c.chosen(), C::kRegions);  // no limit: the lowest measured peak

  // Neither bound known under a limit: regions, straight away.
  PreservationChooser d = chooser(PreservePolicy::kAuto);
  EXPECT_TRUE(d.after_step(wrote({bank(1)}, 3000, 4.0), 3500));
  EXPECT_EQ(d.chosen(), C::kRegions);
  ASSERT_EQ(d.trials().size(), 3u);
  EXPECT_FALSE(d.trials()[1].measured);
  EXPECT_FALSE(d.trials()[2].measured);
  EXPECT_EQ(d.trials()[2].peak_bytes, -1);
  EXPECT_EQ(d.choices().at(bank(1)), C::kRegions);
  EXPECT_FALSE(d.exploring());

  // Without a limit the (unknown) bounds are not read: all three are tried.
  PreservationChooser e = chooser(PreservePolicy::kAuto);
  EXPECT_TRUE(e.after_step(wrote({bank(2)}, 3000, 4.0), 0));
  EXPECT_EQ(e.choices().at(bank(2)), C::kSnapshots);
}

// Note [Trials under a limit]: snapshots hold each storage whole instead of its saved regions; keep at most every
// dropped value, capped by the keep-everything ceiling.
TEST(PreservationBounds, FromTheStepsFigures) {
  replay::PreservedStorage a, b;
  a.nbytes = 400;
  a.held_bytes = 100;
  b.nbytes = 64;
  b.held_bytes = 128;  // regions saved more than the storage (several writes): no extra
  const PreservationBounds x = PreservationBounds::after({a, b}, 1000, 500, INT64_MAX);
  EXPECT_EQ(x.snapshots_peak, 1300);
  EXPECT_EQ(x.keep_peak, 1500);
  EXPECT_EQ(x.of(C::kRegions), 0);
  EXPECT_EQ(PreservationBounds::after({a}, 1000, 500, 1200).keep_peak, 1200);
}

TEST(PickPreservation, NeverPicksAnUntriedMode) {
  const std::vector<PreservationTrial> trials = {{C::kRegions, 1000, 5.0}, {C::kSnapshots, 500, 1.0, false}};
  EXPECT_EQ(pick_preservation(trials, 0), C::kRegions);
  EXPECT_EQ(pick_preservation(trials, 2000), C::kRegions);
  EXPECT_THROW(pick_preservation({{C::kKeep, 10, 1.0, false}}, 0), Error);
}

TEST(PreservationChooser, AutoTriesRegionsSnapshotsAndKeepThenKeepsTheBest) {
  PreservationChooser c = chooser(PreservePolicy::kAuto);
  EXPECT_FALSE(c.after_step(wrote({}, 5000, 1.0), 0));  // nothing written yet: no trial
  EXPECT_TRUE(c.trials().empty());
  EXPECT_FALSE(c.exploring());

  EXPECT_TRUE(c.after_step(wrote({bank(0)}, 3000, 4.0), 0));  // ran regions (the session's mode)
  EXPECT_EQ(c.choices().at(bank(0)), C::kSnapshots);           // the next step tries snapshots
  EXPECT_TRUE(c.exploring());
  EXPECT_TRUE(c.after_step(wrote({bank(0)}, 2500, 3.0), 0));
  EXPECT_EQ(c.choices().at(bank(0)), C::kKeep);
  EXPECT_TRUE(c.exploring());
  // keep: the bank is no longer read by replays, so it is not written any more; the choice persists.
  EXPECT_TRUE(c.after_step(wrote({}, 2800, 1.0), 0));
  ASSERT_EQ(c.trials().size(), 3u);
  EXPECT_EQ(c.trials()[0].mode, C::kRegions);
  EXPECT_EQ(c.trials()[1].mode, C::kSnapshots);
  EXPECT_EQ(c.trials()[2].mode, C::kKeep);
  EXPECT_EQ(c.trials()[1].peak_bytes, 2500);
  EXPECT_EQ(c.chosen(), C::kSnapshots);  // the lowest measured peak
  EXPECT_EQ(c.choices().at(bank(0)), C::kSnapshots);
  EXPECT_FALSE(c.exploring());
  // A storage found later gets the chosen mode; no more trials.
  EXPECT_TRUE(c.after_step(wrote({bank(1)}, 9000, 9.0), 0));
  EXPECT_EQ(c.choices().at(bank(1)), C::kSnapshots);
  EXPECT_EQ(c.trials().size(), 3u);
  EXPECT_FALSE(c.after_step(wrote({bank(1)}, 9000, 9.0), 0));  // unchanged
}

TEST(PreservationChooser, AutoUnderALimitPicksTheCheapestThatFitsAndChoosesAgainForANewLimit) {
  PreservationChooser c = chooser(PreservePolicy::kAuto);
  PreservationBounds within;  // both modes bounded within the limit: both are tried (Note [Trials under a limit])
  within.snapshots_peak = 1200;
  within.keep_peak = 1200;
  c.after_step(wrote({bank(0)}, 1000, 5.0), 1200, within);
  c.after_step(wrote({bank(0)}, 1100, 2.0), 1200, within);
  c.after_step(wrote({}, 1300, 1.0), 1200, within);  // keep measured 1,300 over its bound: not chosen
  EXPECT_EQ(c.chosen(), C::kSnapshots);
  EXPECT_TRUE(c.set_limit(2000));
  EXPECT_EQ(c.chosen(), C::kKeep);
  EXPECT_EQ(c.choices().at(bank(0)), C::kKeep);
  EXPECT_TRUE(c.set_limit(500));
  EXPECT_EQ(c.choices().at(bank(0)), C::kRegions);
  EXPECT_TRUE(c.set_limit(0));
  EXPECT_EQ(c.chosen(), C::kRegions);
  // Before the trials are done there is nothing to choose again.
  PreservationChooser early = chooser(PreservePolicy::kAuto);
  early.after_step(wrote({bank(0)}, 1000, 5.0), 0);
  EXPECT_FALSE(early.set_limit(2000));
  EXPECT_FALSE(early.chosen().has_value());
}

TEST(PreservationChooser, KeepKeepsTheDependentsOfEveryWrittenStorage) {
  PreservationChooser c = chooser(PreservePolicy::kKeep);
  EXPECT_FALSE(c.exploring());
  EXPECT_TRUE(c.after_step(wrote({bank(0), bank(1)}, 1000, 1.0), 0));
  EXPECT_EQ(c.choices().size(), 2u);
  EXPECT_EQ(c.choices().at(bank(1)), C::kKeep);
  EXPECT_TRUE(c.trials().empty());
  EXPECT_FALSE(c.after_step(wrote({}, 1000, 1.0), 0));
  EXPECT_EQ(c.choices().size(), 2u);  // choices persist
  EXPECT_FALSE(c.set_limit(100));
}

TEST(PreservationChooser, FixedModesAndOffChooseNothing) {
  for (PreservePolicy p : {PreservePolicy::kOff, PreservePolicy::kRegions, PreservePolicy::kSnapshots}) {
    PreservationChooser c = chooser(p);
    EXPECT_FALSE(c.after_step(wrote({bank(0)}, 1000, 1.0), 0));
    EXPECT_TRUE(c.choices().empty());
    EXPECT_TRUE(c.trials().empty());
    EXPECT_FALSE(c.exploring());
  }
}

TEST(PreservationChooser, RemembersAtMostMaxChoicesStorages) {
  PreservationChooser c = chooser(PreservePolicy::kKeep, 2);
  c.after_step(wrote({bank(0), bank(1)}, 1000, 1.0), 0);
  EXPECT_EQ(c.choices().size(), 2u);
  EXPECT_TRUE(c.after_step(wrote({bank(2)}, 1000, 1.0), 0));  // 3 > 2: only this step's storages stay
  ASSERT_EQ(c.choices().size(), 1u);
  EXPECT_EQ(c.choices().count(bank(2)), 1u);
}

TEST(PreservationStep, CostIsReplayTimePlusSavingAndRebuilding) {
  std::vector<replay::PreservedStorage> preserved(2);
  preserved[0].key = bank(0);
  preserved[0].save_ns = 1'000'000;
  preserved[0].restore_ns = 500'000;
  preserved[1].key = bank(1);
  preserved[1].save_ns = 250'000;
  const PreservationStep s = PreservationStep::of(preserved, 2'000'000, 4096);
  EXPECT_EQ(s.written, (std::vector<const void*>{bank(0), bank(1)}));
  EXPECT_EQ(s.peak_bytes, 4096);
  EXPECT_DOUBLE_EQ(s.cost_ms, 3.75);
}

}  // namespace
}  // namespace tapesac::runtime
