// Runtime (runtime.h): the step prelude, re-planning and the preservation choice between steps.
#include "tapesac/runtime/runtime.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "tapesac/common/errors.h"
#include "tapesac/planner/step.h"
#include "tapesac/runtime/graph_reserve.h"

namespace tapesac::runtime {

Runtime::Runtime(replay::Session& session, RuntimeOptions options)
    : session_(session),
      limit_(options.memory_limit),
      replan_(options.replan),
      chooser_(options.preservation),
      keep_all_probe_(options.keep_all_probe) {
  TAPESAC_CHECK(limit_ >= 0, kConfig, "memory_limit must be >= 0 bytes (0: none), got ", limit_);
  session_.set_graph_memory_limit(limit_);
  if (options.plan) {
    TAPESAC_CHECK(limit_ > 0, kConfig,
                  "policy='auto' plans under a memory limit: pass memory_limit (bytes, e.g. '20GiB', or '90%' of the "
                  "device's memory), or use policy='full' / 'none' without one");
    AutoPlannerOptions o = options.planner;
    o.schedules = options.schedules;
    planner_ = std::make_unique<AutoPlanner>(session_, o);
    planned_schedules_ = options.schedules;
  } else if (options.schedules) {
    AutoPlannerOptions o = options.planner;
    o.schedules = true;
    o.fixed_masks = true;
    planner_ = std::make_unique<AutoPlanner>(session_, o);
    fixed_masks_ = true;
    planned_schedules_ = true;
  }
  apply_unplanned_schedule();
}

void Runtime::apply_unplanned_schedule() {
  // Planned schedules of the policies that keep what they choose: under a limit, a call without a plan yet (the
  // first step, a new tape) replays lazily, the least it can hold, so that the limit is met before a plan exists.
  // Policy "auto" with planned schedules too: its measuring step runs "full" lazily under a limit, at the floor
  // of the step peak, not at one segment's (checkpointing's) peak above the limit.
  if (planned_schedules_) {
    session_.set_unplanned_schedule(limit_ > 0 ? replay::ForcedSchedule::kLazy : replay::ForcedSchedule::kOneSegment);
  }
}

int64_t Runtime::before_step(const std::vector<at::Tensor>& params) {
  // Only plans under a limit depend on the baseline: no pass over the parameters otherwise.
  if (planner_ && limit_ > 0) {
    const int64_t baseline = session_.baseline_of(params);
    const replay::GraphCache* graphs = session_.graph_cache();
    const int64_t params_baseline = baseline - (graphs ? graphs->static_bytes() : 0);
    replan_for_baseline(baseline, params_baseline);
    step_params_baseline_ = params_baseline;
  }
  return before_step();
}

// Note [Baseline grown before the step]. A plan is made after a step, for a step like it. The next step's baseline
// (the parameters, their gradients, the graphs' static bytes) may have grown meanwhile: gradients the first backward
// created and nothing set to None (gradient accumulation, zero_grad(set_to_none=False)), a parameter added. The
// planner's models shift their predictions by that growth, but only from the step after the one that showed it;
// that step ran the plan made for the smaller baseline, over the limit by up to the growth (HF Qwen3, 3 layers,
// gradients kept between steps: 13% over at a limit 30% of the way from "full"'s peak to no checkpointing's, 9.5%
// at 70%; flagged). So before a step whose baseline grew, a plan predicted over the limit less its margin once
// shifted by the growth is replaced by one planned for that baseline, from the last step's calls and measurements
// shifted by the growth (a bound: gradients allocated during the backward were already counted at its peak in
// part). When nothing fits that bound, a plan keeping everything stays and any other is refused before the step
// (below). A baseline that shrank keeps the plan (it only gains room; the next replan uses it). Only the parameters'
// and gradients' growth counts here: a graph captured since holds static bytes the plan reserved room for
// (graph_reserve.h); they enter the baseline at once (test_graph_backend.py::test_planner_leaves_room_for_the_graphs).
void Runtime::replan_for_baseline(int64_t baseline, int64_t params_baseline) {
  if (!plan_ || lazy_fallback_ || probe_running_ || plan_params_baseline_ < 0) return;  // plan_: made after a step
  const int64_t growth = params_baseline - plan_params_baseline_;
  if (growth <= 0 || plan_->predicted_peak_bytes + growth <= limit_ - plan_->margin_bytes) return;
  ReplanDecision d;
  d.replan = true;
  d.margin_bytes = plan_->margin_bytes;
  d.reason = "the baseline grew by " + std::to_string(growth) + " bytes before step " + std::to_string(last_step_ + 1);
  // The last step's peak, shifted from its own baseline to the coming one.
  const int64_t measured = last_measured_ + (baseline - session_.last_memory().baseline);
  d.calibrate_on = measured;
  std::string reason = d.reason;
  ReservedPlan r;
  try {
    r = make_plan(d, measured, baseline, /*measuring=*/false, &reason);
  } catch (const Error& e) {
    // Nothing is predicted under the limit for the grown baseline, nor measured. A plan in use that keeps everything
    // replays nothing: the step runs it (flagged if over) and the plan after it, calibrated on that baseline, names
    // the least that fits, measured (test_user_holes.py::test_auto_does_not_count_kept_gradients_as_its_models_error).
    // A plan that replays would meet the limit in the middle of a backward: refused now, before the step, naming the
    // smallest peak predicted for the grown baseline (a bound, so a figure that fits).
    if (e.kind() != ErrorKind::kMemoryLimit) throw;
    if (plan_->keeps_everything) return;
    throw Error(ErrorKind::kMemoryLimit,
                std::string(e.what()) + " (Refused before step " + std::to_string(last_step_ + 1) + ": its baseline, "
                "the parameters and their gradients, grew by " + std::to_string(growth) + " bytes since the plan in use "
                "was made, e.g. gradients kept from the last step.)");
  }
  install_plan(std::move(r), d, reason, last_step_, measured, baseline, params_baseline);
}

int64_t Runtime::before_step() {
  int64_t enforced = limit_;
  if (planner_) {
    planner_->begin_step();
    if (!plan_ && !fixed_masks_) enforced = 0;  // auto's measuring step
  } else if (limit_ != 0 && chooser_.exploring()) {
    enforced = 0;  // a preservation trial
  }
  if (planner_ || limit_ != 0) session_.set_memory_limit(enforced);
  return enforced;
}

void Runtime::after_step(int64_t measured_peak_bytes, int64_t step) {
  last_measured_ = measured_peak_bytes;
  last_step_ = step;
  replan_if_needed(measured_peak_bytes, step);
  choose_preservation(measured_peak_bytes);
}

void Runtime::replan_if_needed(int64_t measured, int64_t step) {
  if (!planner_ || session_.last_summary().block_calls == 0) return;
  session_.set_memory_limit(limit_);
  // A step whose blocks' saved tensors no backward read (a forward-only step, grad enabled) says nothing about the
  // backward's memory: no plan is made from it (auto keeps measuring) and the plan in use stays.
  if (session_.last_summary().totals.unpacks == 0) return;
  // Note [A fallback that ran over]. A measured fallback predicts the step from the peak its measuring step measured
  // (shifted by the baseline's growth), which holds while the rest of the step does: a model grown outside the blocks
  // (a wider head, longer sequences in the loss) ran 69% over the limit every later step, flagged, neither tightening
  // nor raising (found by an adversarial test). A fallback that ran over measured the masks it falls back to: it is
  // the measuring step now, and planning from it either finds a plan or names the limit infeasible.
  if (limit_ > 0 && measured > limit_ && (lazy_fallback_ || fallback_plan_) && full_step_) {
    full_step_ = MeasuredStep{measured, session_.last_memory().baseline, step, planner_->call_signatures()};
    lazy_fallback_ = false;
    fallback_plan_ = false;
  }
  if (lazy_fallback_) return;  // lazy replays without plans for the rest of the limit (Note [Measured fallback])
  const auto& blocks = session_.last_stats();
  const bool measuring = std::none_of(blocks.begin(), blocks.end(), [](const replay::BlockStats& b) { return b.planned; });
  if (measuring) {
    // Every call ran without a plan: with the masks of policy "full" (auto), or with the unplanned schedule (fixed
    // masks: lazy under a limit). Note [Measured fallback].
    full_step_ = MeasuredStep{measured, session_.last_memory().baseline, step, planner_->call_signatures()};
  }
  // With fixed masks a call that drops nothing has no schedule to follow.
  const bool unplanned = std::any_of(blocks.begin(), blocks.end(), [&](const replay::BlockStats& b) {
    return !b.planned && (!fixed_masks_ || b.dropped_tensors > 0);
  });
  // Without a limit (schedules for the least peak) no step is over it.
  const int64_t baseline = session_.last_memory().baseline;
  const StepOutcome outcome{limit_ > 0 ? limit_ : INT64_MAX, measured, unplanned,
                            plan_ ? baseline - plan_baseline_ : 0};
  ReplanDecision d = replan_.decide(plan(), outcome);
  if (probe_running_) {  // Note [Keep-everything probe]: the probe measured keeping everything; plan on it
    probe_running_ = false;
    if (!d.replan) {
      d.replan = true;
      d.calibrate_on = measured;
      d.margin_bytes = replan_.model_error_bytes();
    }
    d.reason = d.reason.empty() ? "after the keep-everything probe" : "after the keep-everything probe (" + d.reason + ")";
  }
  if (!d.replan) {
    top_up(measured, step, baseline);
    return;
  }
  if (limit_ > 0 && measured > limit_ && plan_ && plan_->keeps_everything && !fixed_masks_) {
    // Kept everything (the ceiling, or the additive model, put it within the limit) and ran over the limit: the
    // next plan lies below that prediction (shifted by the baseline's growth, as the planner's models are).
    const int64_t predicted = plan_->predicted_peak_bytes + outcome.baseline_growth_bytes;
    d.margin_bytes = std::max(d.margin_bytes, limit_ - predicted + 1);
  }
  std::string reason = d.reason;
  fallback_made_ = false;
  ReservedPlan r;
  try {
    r = make_plan(d, measured, baseline, measuring, &reason);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kMemoryLimit || !measure_instead(e, d, measuring, step, measured)) throw;
    return;
  }
  install_plan(std::move(r), d, reason, step, measured, baseline, step_params_baseline_);
  fallback_plan_ = fallback_made_;
}

bool Runtime::measure_instead(const Error& refusal, const ReplanDecision& d, bool measuring, int64_t step,
                              int64_t measured) {
  // Note [Unmeasured tapes are measured before a refusal]: with one-segment replays the floor of auto is measured
  // per set of tapes (measured_full_peak); for tapes no step measured (a data-dependent branch, new MoE routing)
  // only the planner's model says the limit is infeasible, and it overestimates: a limit every step met was
  // refused at the step where a branch flipped, naming a floor 11% above that step's measured peak (an adversarial
  // test). Such a step is not refused: the next one measures the least-memory masks, and the limit is judged on
  // that measurement.
  const bool unmeasured = !measuring && !fixed_masks_ && !planned_schedules_ && full_step_.has_value() &&
                          planner_->call_signatures() != full_step_->signatures;
  if (plan_ || unmeasured) {
    // Note [Refused with a plan installed]: a loop that catches the MemoryLimitError steps on, and the plan that
    // ran stayed installed, so each later step ran it again: after the keep-everything probe every step kept
    // everything, 4.3% over the limit where the least-memory step was 1 byte over (an adversarial test). The next
    // step runs without a plan, as a measuring step (the least the masks keep), refused again if still over.
    plan_.reset();
    session_.set_plans({});
  }
  if (!unmeasured) return false;
  PlanInfo note;
  note.limit = limit_;
  note.after_step = step;
  note.measured_peak_bytes = measured;
  note.reason = "measuring next (" + d.reason + "): no plan is predicted under the limit for tapes no step measured "
                "(" + refusal.what() + "); the next step measures the least-memory masks before the limit is judged";
  remember(std::move(note));
  return true;
}

// Note [Top-up] (planner/top_up.h) in the runtime: after a step that ran the plan in use on every call, within the
// limit less the margin, the room left (less a safety of 1% of the limit) is filled by keeping more of what the plan
// drops, bounded by the measured peak plus the bytes kept more, which becomes the plan's prediction. Not with fixed
// masks (the policy decides what is kept), approximate replays (a kept value would be exact where the plan
// approximates), graphs (a changed mask is a new capture, with its own static memory) or a preservation trial
// running; a plan made again later (new tape, over the limit, grown baseline) starts from the planner's models.
void Runtime::top_up(int64_t measured, int64_t step, int64_t baseline) {
  if (!planner_ || fixed_masks_ || limit_ <= 0 || !plan_ || plan_->keeps_everything || lazy_fallback_ ||
      probe_running_ || session_.approx() != nullptr || session_.graph_cache() != nullptr || chooser_.exploring()) {
    return;
  }
  const int64_t safety = limit_ / 100;
  const int64_t room = limit_ - plan_->margin_bytes - safety - measured;
  if (room <= 0) return;
  // Note [A top-up that found nothing]: the search is repeated after every step that leaves room; when it kept nothing
  // more for this plan, it is not run again until the room grows by 1% of the limit (on blocks of thousands of ops
  // each fruitless search took 0.8-1.9 s, on every step: an adversarial test).
  if (topup_failed_generation_ == plan_generation_ && room <= topup_failed_room_ + safety) return;
  PlanInfo next = *plan_;
  const std::optional<int64_t> added = planner_->top_up(room, &next);
  if (!added) {
    topup_failed_generation_ = plan_generation_;
    topup_failed_room_ = room;
    return;
  }
  next.predicted_peak_bytes = measured + *added;
  next.model = "measured";
  next.model_calibrated_now = false;
  next.reason = "top-up after step " + std::to_string(step) + ": measured " + std::to_string(measured) +
                " bytes, keeping " + std::to_string(*added) + " bytes more within the limit less the margin and " +
                std::to_string(safety) + " bytes";
  next.after_step = step;
  next.measured_peak_bytes = measured;
  adopt(std::move(next), baseline, step_params_baseline_);
}

ReservedPlan Runtime::make_plan(const ReplanDecision& d, int64_t measured, int64_t baseline, bool measuring,
                                std::string* reason) {
  ReservedPlan r;
  // How much the step planned for differs from the last one (Note [Baseline grown before the step]; 0 after a step).
  const int64_t shift = baseline - session_.last_memory().baseline;
  if (limit_ <= 0) {
    r.plan = planner_->plan(0, d.calibrate_on, 0, INT64_MAX, shift);
    return r;
  }
  replay::GraphCache* graphs = session_.graph_cache();
  const int64_t full_peak = measured_full_peak(baseline);
  try {
    r = plan_with_graph_reserve(limit_ - d.margin_bytes, graphs ? graphs->pending_bytes() : 0, [&](int64_t limit) {
      return planner_->plan(limit, d.calibrate_on, d.margin_bytes, full_peak, shift);
    });
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kMemoryLimit) throw;
    // A measured plan within the limit first; the probe (which may run over) only when there is none.
    if (full_peak <= limit_) {
      r = measured_fallback(full_peak, d.reason, reason);
    } else if (!(measuring && probe_keep_all(measured, d, &r, reason))) {
      throw;
    }
  }
  return r;
}

void Runtime::install_plan(ReservedPlan r, const ReplanDecision& d, const std::string& reason, int64_t step,
                           int64_t measured, int64_t baseline, int64_t params_baseline) {
  replay::GraphCache* graphs = session_.graph_cache();
  if (r.capture && graphs) graphs->set_capture_enabled(*r.capture);
  PlanInfo& info = r.plan;
  info.graph_reserve_bytes = r.reserve_bytes;
  info.predicted_peak_bytes += r.reserve_bytes;
  info.limit = limit_;
  info.margin_bytes = d.margin_bytes;
  info.reason = reason;
  info.after_step = step;
  info.measured_peak_bytes = measured;
  adopt(std::move(info), baseline, params_baseline);
}

void Runtime::adopt(PlanInfo info, int64_t baseline, int64_t params_baseline) {
  fallback_plan_ = false;  // replan_if_needed marks a measured fallback after adopting it
  ++plan_generation_;
  plan_ = std::move(info);
  plan_baseline_ = baseline;
  plan_params_baseline_ = params_baseline;
  PlanInfo kept = *plan_;
  kept.calls.clear();
  remember(std::move(kept));
}

void Runtime::remember(PlanInfo info) {
  if (plans_.size() >= kPlansKept) plans_.erase(plans_.begin());
  plans_.push_back(std::move(info));
}

bool Runtime::probe_keep_all(int64_t measured, const ReplanDecision& d, ReservedPlan* r, std::string* reason) {
  if (fixed_masks_ || probed_ || keep_all_probe_ <= 0 || limit_ <= 0) return false;
  const int64_t ceiling = planner_->keep_all_ceiling(measured);
  const auto tolerance = static_cast<int64_t>(keep_all_probe_ * static_cast<double>(limit_));
  if (ceiling == INT64_MAX || ceiling > limit_ + tolerance) return false;
  probed_ = true;
  probe_running_ = true;
  ReservedPlan probe;
  probe.plan = planner_->plan(INT64_MAX, d.calibrate_on, d.margin_bytes);
  probe.plan.predicted_peak_bytes = ceiling;
  *r = std::move(probe);
  *reason = "keep-everything probe (" + d.reason + "): no plan is predicted under the limit and keeping everything "
            "at most " + std::to_string(ceiling) + " bytes, within " + std::to_string(tolerance) +
            " bytes above it; the next step measures keeping everything";
  return true;
}

ReservedPlan Runtime::measured_fallback(int64_t full_peak, const std::string& why, std::string* reason) {
  const std::string measured_then = " of step " + std::to_string(full_step_->step) + " measured " +
                                    std::to_string(full_step_->peak_bytes) + " bytes";
  ReservedPlan r;
  fallback_made_ = true;
  if (planned_schedules_) {
    // Every call replays as the measured step did, for the rest of this limit: its masks (fixed, or "full"'s for
    // auto, whose calls drop everything without a plan) with the unplanned schedule (lazy under a limit).
    session_.set_plans({});
    lazy_fallback_ = true;
    r.plan.predicted_peak_bytes = full_peak;
    r.plan.min_feasible_peak_bytes = full_peak;
    *reason = "fallback (" + why + "): no schedules are predicted under the limit less the margin; the calls replay "
              "lazily, as those" + measured_then;
  } else {
    r.plan = planner_->plan_least_memory(full_peak);
    *reason = "fallback (" + why + "): no plan is predicted under the limit less the margin; the masks" +
              measured_then;
  }
  return r;
}

int64_t Runtime::measured_full_peak(int64_t baseline) const {
  if (!full_step_) return INT64_MAX;
  // The least-memory masks of auto with one-segment replays depend on the tapes; the unplanned schedule (lazy, with
  // the masks of "full" or the fixed ones) does not: a new routing of an MoE layer replays lazily as the measured
  // step did.
  if (!planned_schedules_ && planner_->call_signatures() != full_step_->signatures) return INT64_MAX;
  return full_step_->peak_bytes + (baseline - full_step_->baseline_bytes);
}

void Runtime::choose_preservation(int64_t measured_peak_bytes) {
  const std::vector<replay::PreservedStorage>& preserved = session_.last_preserved();
  const PreservationStep step =
      PreservationStep::of(preserved, session_.last_summary().totals.replay_ns, measured_peak_bytes);
  PreservationBounds bounds;  // Note [Trials under a limit]
  // Only for a trial: the ceiling reads the planning input (prepare), ~13 ms per step of the bench's small Qwen3 when
  // computed after every step of a model that writes nothing the replays read (the chooser never picks then).
  const bool trial = !step.written.empty() || chooser_.exploring();
  if (trial && limit_ > 0 && chooser_.options().policy == PreservePolicy::kAuto && !chooser_.chosen()) {
    const int64_t ceiling = planner_ ? planner_->keep_all_ceiling(measured_peak_bytes) : INT64_MAX;
    bounds = PreservationBounds::after(preserved, measured_peak_bytes, session_.last_summary().totals.dropped_bytes,
                                       ceiling);
  }
  if (chooser_.after_step(step, limit_, bounds)) chooser_.apply(session_);
}

void Runtime::set_memory_limit(int64_t bytes) {
  TAPESAC_CHECK(!planner_ || fixed_masks_ || bytes != 0, kConfig,
                "policy='auto' needs a memory_limit; to run without one create a TapeSAC with policy='full' or "
                "'none'");
  session_.set_memory_limit(bytes);
  session_.set_graph_memory_limit(bytes);
  limit_ = bytes;
  lazy_fallback_ = false;
  fallback_plan_ = false;
  probed_ = false;
  probe_running_ = false;
  apply_unplanned_schedule();
  if (chooser_.set_limit(bytes)) chooser_.apply(session_);
  if (planner_ && plan_) {
    // Re-plan after the next step, under the new limit: that step runs without plans (the masks of policy "full",
    // auto's measuring masks). The calls' plans were left installed, so a lowered limit's first step ran the old
    // plan, unenforced (113% over a feasible limit, flagged; found by an adversarial test).
    plan_.reset();
    replan_.reset();
    session_.set_plans({});
  }
}

std::vector<FrontierPoint> Runtime::frontier(int points) const {
  TAPESAC_CHECK(planner_ != nullptr, kGeneric, "tapesac: no plan yet; frontier() needs policy='auto' and one "
                "finished step");
  return planner_->frontier(points);
}

}  // namespace tapesac::runtime
