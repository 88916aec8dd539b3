// ReplanPolicy (replan_policy.h, Note [Replan policy]).
#include "tapesac/runtime/replan_policy.h"

#include <algorithm>

namespace tapesac::runtime {

bool ReplanPolicy::recalibrate(const PlanInfo& last, const StepOutcome& step) const {
  const int64_t below = last.predicted_peak_bytes - step.measured_peak_bytes;
  return last.model == "additive" && !last.keeps_everything &&
         static_cast<double>(below) > options_.recalibration_slack * static_cast<double>(step.limit) &&
         recalibrations_ < options_.recalibrations;
}

ReplanDecision ReplanPolicy::decide(const PlanInfo* last, const StepOutcome& step) {
  const int64_t measured = step.measured_peak_bytes;
  // What the peak model missed on the plan that ran: later plans keep that much below the limit. Not after a step
  // some of whose calls had no plan (new tapes: another shape, another routing): that step did not run the plan, and
  // its peak less the plan's prediction is the new shape's size, not the model's error. Counted, it held back the
  // difference between two shapes' peaks for good (590,624 bytes after one step of 4x the sequence, in a run no step
  // of which went over the limit: an adversarial test), replaying more on every later step.
  if (last != nullptr && !step.unplanned_calls) {
    model_error_ = std::max(model_error_, measured - step.baseline_growth_bytes - last->predicted_peak_bytes);
  }
  const bool over = measured > step.limit;
  const bool slack = last != nullptr && recalibrate(*last, step);
  ReplanDecision d;
  if (last != nullptr && !step.unplanned_calls && !over && !slack) return d;
  d.replan = true;
  d.calibrate_on = measured;
  if (last == nullptr) {
    d.reason = "first step";
  } else if (step.unplanned_calls) {
    d.reason = "new tape";
  } else if (over) {
    d.reason = "measured peak over the limit";
  } else {
    d.reason = "re-calibrated halfway to the plan's measured peak";
    const int64_t predicted = last->predicted_peak_bytes;
    d.calibrate_on = predicted - (predicted - measured) / 2;
    ++recalibrations_;
  }
  const int64_t spare =
      recalibrations_ > 0 ? static_cast<int64_t>(options_.recalibrated_margin * static_cast<double>(step.limit)) : 0;
  d.margin_bytes = std::max(model_error_, spare);
  return d;
}

void ReplanPolicy::reset() {
  model_error_ = 0;
  recalibrations_ = 0;
}

}  // namespace tapesac::runtime
