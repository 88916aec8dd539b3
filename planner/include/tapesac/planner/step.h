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
/// first call with that signature, with the replay schedules of its unpack order (`orders`: per call, may be empty
/// or hold nulls: no schedules; add_schedules()). Throws tapesac::Error (kConfig) when two calls share a signature
/// but not the problem's shape (op, value and candidate counts), or when a problem is invalid.
StepInput build_step_input(const std::vector<const BlockProblem*>& calls, const FrontierOptions& options = {},
                           const std::vector<const UnpackOrder*>& orders = {});

/// The StepInput of fixed keep masks (policies "full", op sets, callables: the policy keeps, only the schedules are
/// planned): per signature one frontier of one point, `masks[j]` of the first call with it, with its schedules.
/// Same errors as build_step_input, and kConfig when a mask does not fit its problem.
StepInput fixed_step_input(const std::vector<const BlockProblem*>& calls, const std::vector<KeepMask>& masks,
                           const std::vector<const UnpackOrder*>& orders);

struct CallPlan {
  int32_t frontier = 0;  // index into StepInput::frontiers
  int32_t point = 0;     // index into that frontier's points
  /// Index into that point's schedules (-1: none, the single replay).
  int32_t schedule = -1;
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
/// not fit. replay_cost_lower_bound_ns is the additive problem's bound at the chosen budget. Every call then gets the
/// cheapest of its point's schedules that keeps the prediction under the limit. A limit at or above the
/// keep-everything prediction keeps everything (the runtime bounds that prediction by the measured timeline: Note
/// [Keep-everything ceiling] in peak_model.h). `keep_all` false: keeping everything is not a candidate (the runtime's
/// ceiling says it does not fit), every plan returned drops something.
StepPlan plan_step(const StepInput& input, const SequencePeakModel& model, int64_t limit_bytes, bool keep_all = true);

/// Every call at its frontier's least-memory point (the first: forced_keep() plus the candidates that cost no bytes)
/// with the single replay: the masks policy "full" runs with, as auto's measuring step did. Its figures but the
/// predicted peak (0: the caller knows it from the measuring step) are filled in. Throws tapesac::Error (kConfig)
/// for a call referencing a missing or empty frontier.
StepPlan least_memory_plan(const StepInput& input);


/// Per-call kept bytes and working sets of a plan, in call order (what SequencePeakModel::predict takes).
void plan_profile(const StepPlan& plan, std::vector<int64_t>* kept, std::vector<int64_t>* ws);

/// The schedule a plan gives call `j` (null: none, the single replay).
const ScheduleChoice* call_schedule(const StepInput& input, const StepPlan& plan, size_t j);

/// Fixed keep masks (fixed_step_input: one point per frontier): the schedule of every call. With limit_bytes > 0,
/// per call the cheapest schedule that keeps the predicted step peak <= limit_bytes; InfeasibleLimitError naming the
/// least predicted peak when even the least-memory schedules do not fit. With limit_bytes <= 0, per call the
/// cheapest schedule that keeps the prediction within `slack` (a fraction) of the least peak any choice of schedules
/// reaches ("full" keeps about the least memory without paying any price for the last bytes; see Note [Fixed masks]
/// in step.cpp). The StepPlan's min_feasible_peak_bytes is that least peak; keep_all_peak_bytes the peak of the
/// single replays.
/// With limit_bytes <= 0 and `time_budget` >= 0 the slack is not used: the schedules of the least predicted peak
/// whose predicted replay time is at most (1 + time_budget) x that of the single replays (Note [Replay time budget]
/// in step.cpp; 0: only schedules that cost no more than one replay per call).
StepPlan plan_schedules(const StepInput& input, const SequencePeakModel& model, int64_t limit_bytes,
                        double slack = 0, double time_budget = -1);
StepPlan plan_schedules(const StepInput& input, const PeakModel& model, int64_t limit_bytes, double slack = 0,
                        double time_budget = -1);

}  // namespace tapesac::planner
