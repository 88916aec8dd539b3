// Step-level selection under one memory limit: one frontier point per block call, minimal total replay cost,
// predicted step peak (peak_model.h) <= limit. Block calls with an equal signature share one frontier.
#pragma once

#include <cstdint>
#include <vector>

#include "tapesac/common/errors.h"
#include "tapesac/planner/frontier.h"
#include "tapesac/planner/peak_model.h"

namespace tapesac::planner {

struct StepInput {
  /// One frontier per distinct block signature.
  std::vector<BlockFrontier> frontiers;
  /// Per block call, in step order: the index of its frontier.
  std::vector<int32_t> calls;
};

/// Builds a StepInput from the problems of the step's block calls: one frontier per signature, computed from the
/// first call with that signature. Throws tapesac::Error (kConfig) when two calls share a signature but not the
/// problem's shape (op, value and candidate counts), or when a problem is invalid.
StepInput build_step_input(const std::vector<const BlockProblem*>& calls, const FrontierOptions& options = {});

struct CallPlan {
  int32_t frontier = 0;  // index into StepInput::frontiers
  int32_t point = 0;     // index into that frontier's points
  KeepMask keep;
  int64_t kept_bytes = 0;
  int64_t working_set_bytes = 0;
  double replay_cost_ns = 0;
};

struct StepPlan {
  std::vector<CallPlan> calls;
  int64_t predicted_peak_bytes = 0;
  double replay_cost_ns = 0;
  /// A lower bound on the replay cost of any choice of frontier points under the limit (LP relaxation); the gap
  /// to replay_cost_ns bounds the approximation (see Note [Step knapsack] in step.cpp).
  double replay_cost_lower_bound_ns = 0;
  int64_t sum_kept_bytes = 0;
  int64_t max_working_set_bytes = 0;
  /// Predicted peak of the minimum-memory choice and of keeping everything.
  int64_t min_feasible_peak_bytes = 0;
  int64_t keep_all_peak_bytes = 0;
  bool keeps_everything = false;
};

/// The limit is below the predicted peak of every choice. A tapesac::Error of kind kMemoryLimit.
class InfeasibleLimitError : public Error {
 public:
  InfeasibleLimitError(int64_t limit_bytes, int64_t smallest_feasible_bytes);
  int64_t limit_bytes() const { return limit_bytes_; }
  /// The predicted peak of the minimum-memory choice: the smallest limit plan_step accepts.
  int64_t smallest_feasible_bytes() const { return smallest_feasible_bytes_; }

 private:
  int64_t limit_bytes_;
  int64_t smallest_feasible_bytes_;
};

/// The plan of minimal total replay cost with model.predict(sum kept, max working set) <= limit_bytes. A limit at
/// or above the keep-everything peak keeps everything. Throws InfeasibleLimitError when no choice fits, and
/// tapesac::Error (kConfig) on a malformed input (call referencing a missing frontier, empty frontier).
StepPlan plan_step(const StepInput& input, const PeakModel& model, int64_t limit_bytes);

/// The same under the sequence peak model (peak_model.h): the plan of minimal replay cost found whose
/// model.predict(per-call kept, per-call working set) <= limit_bytes. The sequence model is not a function of the
/// kept total alone, so this searches the budget B of plan_step's additive model (kept + largest working set
/// <= B) for the largest B whose plan fits (see Note [Sequence search] in step.cpp); predicted, smallest feasible
/// and keep-everything peaks are the sequence model's. Throws InfeasibleLimitError when the least-memory plan does
/// not fit. replay_cost_lower_bound_ns is the additive problem's bound at the chosen budget. A limit within 0.01%
/// (at least 4 KiB) below the keep-everything prediction keeps everything (byte accounting tolerance).
StepPlan plan_step(const StepInput& input, const SequencePeakModel& model, int64_t limit_bytes);

/// Per-call kept bytes and working sets of a plan, in call order (what SequencePeakModel::predict takes).
void plan_profile(const StepPlan& plan, std::vector<int64_t>* kept, std::vector<int64_t>* ws);

}  // namespace tapesac::planner
