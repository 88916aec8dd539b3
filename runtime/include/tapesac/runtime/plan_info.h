// What one plan is (policy "auto": keep masks and replay schedules; other policies: replay schedules only), as the Python front reports it (TapeSAC.plan / TapeSAC.plans): the planner's
// prediction (AutoPlanner::plan), the reserve and margin the replan policy added (Runtime), and why and when it was
// made. for_each_plan_field visits the fields in the order of the Python dict, so the bindings convert it with one
// loop and the keys are written once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tapesac::runtime {

/// One block call of a plan, in step order.
struct CallPlanInfo {
  std::string name;
  int64_t kept_bytes = 0;
  int64_t working_set_bytes = 0;
  double replay_cost_ns = 0;
  int64_t kept_candidates = 0;  ///< candidates the plan keeps
  int64_t candidates = 0;       ///< values the plan decides on
  int64_t segments = 1;         ///< segments of its replay schedule (planner/schedule.h)
  int64_t held_bytes = 0;       ///< the most bytes the schedule holds across segments
};

/// A plan of the whole step under one limit.
struct PlanInfo {
  int64_t limit = 0;                     ///< the memory_limit it was made for (before margin and reserve)
  int64_t predicted_peak_bytes = 0;      ///< the peak model's prediction, graph reserve included
  double replay_cost_ns = 0;             ///< predicted replay time of the step
  double replay_cost_lower_bound_ns = 0; ///< LP bound on any plan's replay time (planner/step.h)
  int64_t sum_kept_bytes = 0;
  int64_t max_working_set_bytes = 0;
  int64_t min_feasible_peak_bytes = 0;
  int64_t keep_all_peak_bytes = 0;
  bool keeps_everything = false;
  int64_t baseline_bytes = 0;            ///< the additive model's baseline (calibrated on the measured peak)
  std::string model;                     ///< "sequence" or "additive": the peak model the plan was made under;
                                         ///< "measured": a top-up (Note [Top-up]), predicted at the measured peak
                                         ///< of the step it follows plus the bytes it keeps more
  bool model_calibrated_now = false;     ///< the sequence model was calibrated on the step this plan follows
  std::vector<CallPlanInfo> calls;       ///< empty in the plan history (Runtime::plans)
  int64_t signatures = 0;                ///< distinct block tapes
  double planning_ms = 0;
  int64_t graph_reserve_bytes = 0;       ///< static memory left for graphs not captured yet (graph_reserve.h)
  int64_t margin_bytes = 0;              ///< kept below the limit for the peak model's error (replan_policy.h)
  std::string reason;                    ///< why it was made (ReplanDecision::reason)
  int64_t after_step = 0;                ///< the step it was made after (1 for the first)
  int64_t measured_peak_bytes = 0;       ///< that step's measured peak
};

/// Calls f(name, value) for every field of `p`, in the order of the Python dict (`calls` included).
template <class P, class F>
void for_each_plan_field(P& p, F&& f) {
  f("limit", p.limit);
  f("predicted_peak_bytes", p.predicted_peak_bytes);
  f("replay_cost_ns", p.replay_cost_ns);
  f("replay_cost_lower_bound_ns", p.replay_cost_lower_bound_ns);
  f("sum_kept_bytes", p.sum_kept_bytes);
  f("max_working_set_bytes", p.max_working_set_bytes);
  f("min_feasible_peak_bytes", p.min_feasible_peak_bytes);
  f("keep_all_peak_bytes", p.keep_all_peak_bytes);
  f("keeps_everything", p.keeps_everything);
  f("baseline_bytes", p.baseline_bytes);
  f("model", p.model);
  f("model_calibrated_now", p.model_calibrated_now);
  f("calls", p.calls);
  f("signatures", p.signatures);
  f("planning_ms", p.planning_ms);
  f("graph_reserve_bytes", p.graph_reserve_bytes);
  f("margin_bytes", p.margin_bytes);
  f("reason", p.reason);
  f("after_step", p.after_step);
  f("measured_peak_bytes", p.measured_peak_bytes);
}

/// Calls f(name, value) for every field of a block call's plan, in the order of the Python dict.
template <class C, class F>
void for_each_call_field(C& c, F&& f) {
  f("name", c.name);
  f("kept_bytes", c.kept_bytes);
  f("working_set_bytes", c.working_set_bytes);
  f("replay_cost_ns", c.replay_cost_ns);
  f("kept_candidates", c.kept_candidates);
  f("candidates", c.candidates);
  f("segments", c.segments);
  f("held_bytes", c.held_bytes);
}

/// One point of the step-level frontier (AutoPlanner::frontier): the best plan under `limit_bytes`.
struct FrontierPoint {
  int64_t limit_bytes = 0;
  int64_t predicted_peak_bytes = 0;
  double replay_cost_ns = 0;
  int64_t kept_bytes = 0;
};

}  // namespace tapesac::runtime
