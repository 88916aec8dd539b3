// The step-peak model: predicted peak = baseline + sum over block calls of kept bytes + the largest replay
// working set of one block call. `baseline` is everything the planner does not choose (parameters, gradients,
// optimizer state, activations outside blocks, the forward's transient); it is calibrated from one measured step.
#pragma once

#include <cstdint>

namespace tapesac::planner {

struct PeakModel {
  int64_t baseline_bytes = 0;

  /// Predicted step peak of a plan with `sum_kept_bytes` kept over all block calls and `max_working_set_bytes`.
  int64_t predict(int64_t sum_kept_bytes, int64_t max_working_set_bytes) const {
    return baseline_bytes + sum_kept_bytes + max_working_set_bytes;
  }

  /// The model whose prediction for the plan that ran (sum_kept_ref, max_ws_ref) equals the measured peak.
  static PeakModel calibrate(int64_t measured_peak_bytes, int64_t sum_kept_ref_bytes, int64_t max_ws_ref_bytes) {
    return PeakModel{measured_peak_bytes - sum_kept_ref_bytes - max_ws_ref_bytes};
  }
};

}  // namespace tapesac::planner
