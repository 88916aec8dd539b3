// Runtime: what happens between the steps of one TapeSAC — the one object the Python front calls around a step.
//
// Contract.
//  * With RuntimeOptions::schedules (policies "full", op sets, callables) the planner plans only the replay schedules
//    (Note [Replay schedule] in replay/schedule.h): after the first step, after a step with a new tape, and after a
//    step whose measured peak exceeded the limit (the next plan keeps the model's error below the limit); the limit
//    is enforced from the first step on, and a call without a plan replays lazily under it (the least it can hold;
//    Session::set_unplanned_schedule). Without a limit the schedules lower the predicted peak within the replay time
//    budget (AutoPlannerOptions::schedule_time_budget) or to the least peak. Policy "auto" with schedules plans the
//    masks and the schedules; its measuring step (no plan yet) runs "full"'s masks lazily under a limit too, at the
//    floor of the step peak (before 2026-12-03 it replayed one segment per call, at checkpointing's peak: over every
//    limit below it, flagged, on small and medium Qwen3, Llama and Qwen3-MoE in perf/bench_limits.py).
//  * before_step() sets the limit the step's replays enforce: policy "auto"'s measuring step (no plan yet) runs
//    without it, so that an infeasible limit is reported by the planner with the smallest feasible one rather than
//    by the first replay that does not fit; likewise the steps on which preserve="auto" measures its trials.
//  * after_step(peak, step) reads the session's last step and, with policy "auto", plans again when the replan
//    policy says so (Note [Replan policy]) leaving room for pending graphs (Note [Graph reserve]); then it updates
//    the preservation choices (Note [Preservation choice]). Call it only after a step that finished; it throws
//    tapesac::Error (kMemoryLimit) for an infeasible limit.
//  * set_memory_limit() applies a new limit to the session and the graphs, lets preserve="auto" choose again and
//    drops the plan (the next step is planned again under the new limit, the plan history stays).
//  * Note [Measured fallback]. A step in which every block call ran without a plan ran the masks of policy "full"
//    (auto's measuring step): its peak is a measurement of planner::least_memory_plan. When a replan finds no plan
//    predicted under limit - margin (after a planned step ran over the limit, the margin holds back the model's
//    error), yet that measurement, shifted by the baseline's growth since, is within the limit and the calls have
//    the same tapes, the least-memory plan is installed instead of raising MemoryLimitError: a limit that "full"
//    met is never refused, and a refused one names at most that figure (the GRU stack of test_user_holes.py: keeping
//    everything was predicted 640 bytes low, ran 64 bytes over a limit of 40,904 — "full"'s measured peak — and the
//    replan refused, naming 45,577). With planned schedules (fixed masks: policies "full", op sets, callables; or
//    "auto" with schedule="planned") under a limit the step without plans replayed lazily: when no plan fits under
//    limit - margin and that step measured within the limit, the plans are cleared and every
//    call replays lazily for the rest of the limit (no more replans until set_memory_limit: small Qwen3-MoE, whose
//    routing changes every step, raised MemoryLimitError after step 2 before, and replanning after the fallback
//    ran every other step over).
//  * Note [Keep-everything probe]. The keep-everything ceiling is an upper bound read off auto's measuring step (which
//    dropped and replayed): on small blocks it can lie a few percent above what keeping everything really peaks at
//    (random program 1220: ceiling 20,536 bytes, "none" measured 20,248), and when the measuring step itself ran over
//    the limit (one-segment schedules: it runs "full" with one replay per call) a limit at the no-checkpoint peak was
//    refused. When no plan fits after the measuring step and the ceiling lies within RuntimeOptions::keep_all_probe of
//    the limit above it, the next step keeps everything as a measurement instead of raising: within the limit, the plan
//    made after it keeps everything (its ceiling is now that measured peak, with no slack below it); over it, the step
//    is flagged over_limit like any step over the limit, and the plan made after it drops, or the limit is refused
//    naming a figure a step measured. Once per limit. Only when nothing measured fits: a limit the measuring step met
//    falls back to its masks (Note [Measured fallback]) instead of probing (probes there ran 0.1-4% over on 6 of the
//    first 1,000 random programs, all at limits the fallback meets). A plan that fits and drops is not probed: the
//    probe could run over a limit that the plan meets (a double backward at 70% of the way from "full" to "none": 3.1%
//    over), so at a limit at the no-checkpoint peak auto may still drop where the ceiling overestimates (README, Limits
//    and guarantees).
//  * The session must outlive the Runtime. Not thread-safe: one step at a time, between steps.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "tapesac/replay/session.h"
#include "tapesac/runtime/auto_planner.h"
#include "tapesac/runtime/graph_reserve.h"
#include "tapesac/runtime/plan_info.h"
#include "tapesac/runtime/preservation_chooser.h"
#include "tapesac/runtime/replan_policy.h"

namespace tapesac::runtime {

struct RuntimeOptions {
  /// Policy "auto": plan under memory_limit (which must then be > 0).
  bool plan = false;
  /// Plan the replay schedules (Config.schedule="planned"; off: every block call replays its dropped values at its
  /// first unpack). With `plan`, the auto planner plans them with the keep masks; otherwise, for the policies that
  /// decide themselves what is kept ("full", op sets, callables), it plans only the replay schedules between
  /// steps (AutoPlannerOptions::fixed_masks) under memory_limit, or for the least peak without one.
  bool schedules = false;
  /// The step-peak limit in bytes (0: none).
  int64_t memory_limit = 0;
  AutoPlannerOptions planner;
  ReplanOptions replan;
  PreservationChooserOptions preservation;
  /// Policy "auto": how far above the limit (a fraction of it) the keep-everything ceiling may lie for a step to keep
  /// everything as a measurement (Note [Keep-everything probe]); 0: never.
  double keep_all_probe = 0.05;
};

/// The between-steps runtime of one Session (see the contract above).
class Runtime {
 public:
  /// Throws tapesac::Error (kConfig) for policy "auto" without a limit.
  Runtime(replay::Session& session, RuntimeOptions options);

  /// Before the session's begin_step(): forgets the planner's calls and sets the step's enforced limit (returned).
  int64_t before_step();
  /// The same for a step whose parameters are `params` (what begin_step() will get): first, under a limit, a plan
  /// predicted over it once shifted by how much the step's baseline grew since the plan was made is replaced by one
  /// planned for that baseline (Note [Baseline grown before the step]). Throws tapesac::Error (kMemoryLimit) when none
  /// fits and the plan in use replays (one that keeps everything stays).
  int64_t before_step(const std::vector<at::Tensor>& params);
  /// After a finished step whose measured peak was `measured_peak_bytes` (`step`: its number, 1 for the first):
  /// re-plans if needed and updates the preservation choices.
  void after_step(int64_t measured_peak_bytes, int64_t step);
  /// A new limit (bytes, 0: none). Throws tapesac::Error (kConfig) for 0 under policy "auto" and (from the
  /// session) for a negative one.
  void set_memory_limit(int64_t bytes);
  int64_t memory_limit() const { return limit_; }

  /// The plan in use (null before the first plan, after a new limit, or without a planner).
  const PlanInfo* plan() const { return plan_ ? &*plan_ : nullptr; }
  /// The last kPlansKept plans made, oldest first, without their per-call figures.
  const std::vector<PlanInfo>& plans() const { return plans_; }
  /// Plans kept in plans(): a run whose shapes alternate plans at every step (a smaller last batch per epoch,
  /// variable-length batches), and an unbounded history grew host memory by ~2.3 MiB per 1,000 steps.
  static constexpr size_t kPlansKept = 1000;
  /// The planner's frontier (AutoPlanner::frontier). Throws tapesac::Error (kGeneric) without a planner.
  std::vector<FrontierPoint> frontier(int points) const;
  /// The planner (null unless policy "auto" or RuntimeOptions::schedules).
  AutoPlanner* planner() const { return planner_.get(); }
  const ReplanPolicy& replan_policy() const { return replan_; }
  const PreservationChooser& preservation() const { return chooser_; }

 private:
  void replan_if_needed(int64_t measured_peak_bytes, int64_t step);
  /// Note [Baseline grown before the step]: re-plans for a step whose baseline is `baseline` bytes, of which
  /// `params_baseline` are the parameters and their gradients (the rest: captured graphs' statics, which the plans
  /// reserve for as graph memory).
  void replan_for_baseline(int64_t baseline, int64_t params_baseline);
  /// The plan for the observed calls under the limit less `d`'s margin (a reserve for pending graphs, the measured
  /// fallback, the probe when `measuring`); `measured`: the last step's peak shifted to `baseline` (the step planned
  /// for; the last step's own when equal). Says why in `reason`.
  ReservedPlan make_plan(const ReplanDecision& d, int64_t measured, int64_t baseline, bool measuring,
                         std::string* reason);
  /// Installs `r` as the plan in use, made after step `step` (peak `measured`) for a step of `baseline` bytes
  /// (`params_baseline` of them the parameters and their gradients; -1: not known).
  void install_plan(ReservedPlan r, const ReplanDecision& d, const std::string& reason, int64_t step,
                    int64_t measured, int64_t baseline, int64_t params_baseline);
  /// Makes `info` the plan in use, for a step of `baseline` bytes (`params_baseline` of them the parameters and their
  /// gradients; -1: not known), and adds it to the history.
  void adopt(PlanInfo info, int64_t baseline, int64_t params_baseline);
  // plans_ (the last kPlansKept) gains `info`.
  void remember(PlanInfo info);
  // make_plan refused the limit (`refusal`, kMemoryLimit): drops the installed plan, and returns true when the
  // refusal is declined because the tapes were never measured (Note [Unmeasured tapes are measured before a refusal]).
  bool measure_instead(const Error& refusal, const ReplanDecision& d, bool measuring, int64_t step, int64_t measured);
  /// The peak of the last step whose calls all ran without a plan, shifted to `baseline` (the last step's), when the
  /// last step's calls have the same tapes (Note [Measured fallback]); INT64_MAX otherwise.
  int64_t measured_full_peak(int64_t baseline) const;
  /// Note [Measured fallback]: installs what the last step without plans ran (its peak shifted: `full_peak`) and
  /// says why in `reason` (`why`: the replan policy's reason).
  ReservedPlan measured_fallback(int64_t full_peak, const std::string& why, std::string* reason);
  /// Note [Keep-everything probe]: whether the step after this measuring step (`measured` bytes), for which no plan
  /// fits, keeps everything as a measurement; installs that plan in `r` and says why in `reason` if so.
  bool probe_keep_all(int64_t measured, const ReplanDecision& d, ReservedPlan* r, std::string* reason);
  /// Note [Top-up]: after step `step` (peak `measured`, baseline `baseline`) ran the plan in use within the limit,
  /// keeps more of what it drops in the room left.
  void top_up(int64_t measured, int64_t step, int64_t baseline);
  void choose_preservation(int64_t measured_peak_bytes);
  /// With fixed masks: the shape of calls without a plan (lazy under a limit, else one segment).
  void apply_unplanned_schedule();

  replay::Session& session_;
  int64_t limit_;
  std::unique_ptr<AutoPlanner> planner_;
  bool fixed_masks_ = false;  // the planner plans schedules only (RuntimeOptions::schedules)
  bool planned_schedules_ = false;  // RuntimeOptions::schedules: the planner plans the replay schedules
  ReplanPolicy replan_;
  PreservationChooser chooser_;
  std::optional<PlanInfo> plan_;
  int64_t plan_baseline_ = 0;  // the baseline of the step plan_ was made for
  int64_t last_measured_ = 0;  // the last finished step's peak and number (after_step)
  int64_t last_step_ = 0;
  // The parameters' and gradients' bytes of the step plan_ was made for, and of the step begun last (-1: not known:
  // before_step() without parameters, or no limit to plan under).
  int64_t plan_params_baseline_ = -1;
  int64_t step_params_baseline_ = -1;
  // The last step whose calls all ran without a plan (Note [Measured fallback]).
  struct MeasuredStep {
    int64_t peak_bytes = 0;
    int64_t baseline_bytes = 0;
    int64_t step = 0;
    std::vector<uint64_t> signatures;
  };
  std::optional<MeasuredStep> full_step_;
  // The calls replay lazily without plans for the rest of the limit (Note [Measured fallback]).
  bool lazy_fallback_ = false;
  // The plan in use is a measured fallback (one-segment schedules: the least-memory masks); Note [A fallback that
  // ran over]. fallback_made_: make_plan chose one for the plan being made.
  bool fallback_plan_ = false;
  bool fallback_made_ = false;
  // Note [A top-up that found nothing]: plans adopted so far, and the plan and room of the last top-up that kept
  // nothing more (not tried again for that plan unless the room grows).
  int64_t plan_generation_ = 0;
  int64_t topup_failed_generation_ = -1;
  int64_t topup_failed_room_ = 0;
  double keep_all_probe_ = 0;    // RuntimeOptions::keep_all_probe
  bool probed_ = false;          // a keep-everything probe ran (or is running) under this limit
  bool probe_running_ = false;   // the plan in use is the probe's: the step after it is planned again
  std::vector<PlanInfo> plans_;
};

}  // namespace tapesac::runtime
