// ReplanPolicy: when policy "auto" plans again after a step, on what peak the planner calibrates, and how much of
// the limit it keeps spare.
//
// Note [Replan policy]. A plan is made after the first step (which ran "full" while measuring), and again after a
// step in which
//   * a block call found no plan for its tape ("new tape": new shapes or routing), or
//   * the measured peak exceeded the limit ("measured peak over the limit"), or
//   * the plan was made under the additive peak model, does not keep everything, and its measured peak came in
//     more than ReplanOptions::recalibration_slack of the limit below its prediction: the model (calibrated on the
//     "full" measuring step) errs on the high side on the models we test (README: the prediction vs measurement
//     table), so it is re-calibrated halfway towards that measurement, at most ReplanOptions::recalibrations
//     times. Going all the way (or re-calibrating again) could overshoot the limit with the next plan: the error
//     varies between plans. The sequence model is calibrated on a complete measured profile and needs no such
//     correction.
// Margins: what the peak model missed on a plan that ran (measured - predicted, the largest so far) is kept below
// the limit by every later plan — less what the step's baseline grew since the step the plan was made after (its
// gradients and optimizer state were not there to measure; the AutoPlanner shifts its models by that growth, so
// counting it as the model's error too would charge it twice: a limit the step could meet was refused for 147,712
// bytes of gradients kept from the previous step); after a re-calibration the model is no longer conservative by construction, so at
// least ReplanOptions::recalibrated_margin of the limit is kept spare.
//
// Pure logic on figures (no Session): not thread-safe; the Runtime calls it between steps.
#pragma once

#include <cstdint>
#include <string>

#include "tapesac/runtime/plan_info.h"

namespace tapesac::runtime {

struct ReplanOptions {
  /// Re-calibrations of the additive model allowed per limit (Note [Replan policy]).
  int recalibrations = 1;
  /// A plan whose measured peak is more than this fraction of the limit below its prediction is re-calibrated.
  double recalibration_slack = 0.01;
  /// After a re-calibration, at least this fraction of the limit is kept spare.
  double recalibrated_margin = 0.01;
};

/// What one finished step tells the policy.
struct StepOutcome {
  int64_t limit = 0;                ///< the memory_limit (bytes, > 0)
  int64_t measured_peak_bytes = 0;  ///< the step's measured peak
  bool unplanned_calls = false;     ///< some block call found no plan for its tape
  /// How much the step's baseline (bytes in use when it began) exceeds that of the step the plan that ran was made
  /// after: gradients kept from the previous step, optimizer state. Not the peak model's error (Note [Replan policy]).
  int64_t baseline_growth_bytes = 0;
};

/// The policy's answer for one step.
struct ReplanDecision {
  bool replan = false;
  std::string reason;          ///< "first step", "new tape", "measured peak over the limit" or the re-calibration
  int64_t calibrate_on = 0;    ///< the peak the planner calibrates the additive model on
  int64_t margin_bytes = 0;    ///< kept below the limit: the planner plans under limit - margin_bytes
};

/// The replan policy of one limit (Note [Replan policy]); reset() starts over under a new limit.
class ReplanPolicy {
 public:
  explicit ReplanPolicy(ReplanOptions options = {}) : options_(options) {}

  /// After a step: whether to plan again and how. `last` is the plan that ran (null: none yet). Folds the step's
  /// model error into the margin and counts a re-calibration when it decides one.
  ReplanDecision decide(const PlanInfo* last, const StepOutcome& step);
  /// Forgets the model error and the re-calibrations (a new limit).
  void reset();

  /// The largest amount by which a measured peak exceeded its plan's prediction (0 when none did).
  int64_t model_error_bytes() const { return model_error_; }
  /// Re-calibrations made under the current limit.
  int recalibrations() const { return recalibrations_; }
  const ReplanOptions& options() const { return options_; }

 private:
  bool recalibrate(const PlanInfo& last, const StepOutcome& step) const;

  ReplanOptions options_;
  int64_t model_error_ = 0;
  int recalibrations_ = 0;
};

}  // namespace tapesac::runtime
