// The step-peak model: predicted peak = baseline + sum over block calls of kept bytes + the largest replay
// working set of one block call. `baseline` is everything the planner does not choose (parameters, gradients,
// optimizer state, activations outside blocks, the forward's transient); it is calibrated from one measured step.
#pragma once

#include <cstdint>
#include <vector>

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

namespace tapesac::planner {

/// One point of a measured step's memory timeline: bytes in use (relative or absolute, consistently) at time t.
struct TimedBytes {
  int64_t t_ns = 0;
  int64_t bytes = 0;
};

/// Where a measured step's memory peaks, per window of the step. Forward window k runs from the start of call k's
/// forward to the start of the next call's (the last one to the end of its forward); the tail from there to the
/// first replay (the rest of the forward, the loss, the backward of what follows the blocks); backward window i from
/// the start of call i's first replay to the start of the next replay, or to the end of the step. `pre_peak` is
/// before the first block.
struct StepProfile {
  bool valid = false;
  int64_t pre_peak = 0;
  std::vector<int64_t> forward_peaks;   // per block call, in forward order
  int64_t tail_peak = 0;
  std::vector<int64_t> backward_peaks;  // per block call, in forward order
};

/// The profile of a timeline given each call's forward span and first replay start (forward order; a replay start
/// < 0 means the call did not replay, which makes the profile invalid). `offset` is added to every figure (the
/// step's baseline).
StepProfile profile_step(const std::vector<TimedBytes>& timeline, const std::vector<int64_t>& forward_begin_ns,
                         const std::vector<int64_t>& forward_end_ns, const std::vector<int64_t>& replay_start_ns,
                         int64_t offset);

/// The sequence (max-plus) peak model. During call k's forward, the calls before it hold what they keep and k holds
/// all it saves (it decides at the end of its forward): fwd_k = f_k + sum_{j<k} kept_j. After the last forward,
/// every call's kept bytes are alive: tail = t + sum_j kept_j. While call i's backward runs, the calls before it
/// (and i) still hold what they keep, the calls after it have freed theirs (and their gradients exist), and i's
/// replay working set is alive: bwd_i = b_i + sum_{j<=i} kept_j + ws_i. The step peak is the largest of these and
/// the pre-block peak. The constants come from one measured step (calibrate): they hold what the plan does not
/// change — parameters, gradients so far, optimizer state, the activations outside the blocks, transients.
struct SequencePeakModel {
  bool valid = false;
  int64_t pre = 0;
  std::vector<int64_t> forward_c;   // per call, forward order
  int64_t tail_c = 0;
  std::vector<int64_t> backward_c;  // per call, forward order

  /// The predicted step peak for per-call kept bytes and replay working sets (forward order).
  int64_t predict(const std::vector<int64_t>& kept, const std::vector<int64_t>& ws) const;
  /// The model that predicts `profile` exactly for the plan that ran (its per-call kept bytes and working sets).
  static SequencePeakModel calibrate(const StepProfile& profile, const std::vector<int64_t>& kept_ref,
                                     const std::vector<int64_t>& ws_ref);
};

}  // namespace tapesac::planner
