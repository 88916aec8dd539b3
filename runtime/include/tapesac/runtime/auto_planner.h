// AutoPlanner: policy "auto"'s link between a replay Session and the planner. It observes every block call's tape
// (its planning problem and measured op costs, in C++ on the forward thread), plans the next steps under one limit
// from the last step's problems and its measured peak, and installs the plan in the session (Session::set_plans).
//
// Contract.
//  * begin_step() forgets the previous step's calls; the calls observed since are what plan(), frontier() and
//    dump_problem() work on. Problems are cached per tape signature (bounded: AutoPlannerOptions::max_problems);
//    op costs are the per-op medians of the recent calls of a signature (planner::CostModel).
//  * The plan covers keep masks (policy "auto") or, with AutoPlannerOptions::fixed_masks, only the replay schedules
//    of the masks the policy chose; schedules come from the unpack orders the session observed per signature
//    (Session::unpack_orders; Note [Replay schedule] in replay/schedule.h), and a call's working set in the peak
//    models is its schedule's (planner/schedule.h).
//  * plan() calibrates two peak models on the step: the additive model (planner::PeakModel) on `measured_peak`,
//    and the sequence model (planner::SequencePeakModel) on the step's memory profile when every call replayed; the
//    sequence model is used when valid (and kept while the calls stay the same). An infeasible limit throws
//    tapesac::Error (kMemoryLimit) with infeasible_limit_message(); nothing is installed then.
//  * Keeping everything is predicted at the lower of the model's figure and the last step's keep-everything ceiling
//    (Note [Keep-everything ceiling] in planner/peak_model.h): a limit at or above the ceiling keeps everything, and
//    the smallest feasible peak an infeasible limit names is never above it. A sequence model kept from an earlier
//    step is shifted by the growth of the step's baseline since then (gradients kept from the previous step,
//    optimizer state).
//  * Dropped values found alive anyway after a forward (a module stored them; Note [dropped values alive elsewhere]
//    in replay/block_call.h) are kept by every later plan of their call (same name and tape signature; such a call
//    plans on a frontier of its own): keeping them costs nothing while they are alive, and the peak models would
//    otherwise credit dropping them with bytes it does not free.
//  * Not thread-safe: begin_step/plan/frontier between steps, observation during the step's forwards (one thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tapesac/planner/from_tape.h"
#include "tapesac/planner/peak_model.h"
#include "tapesac/planner/step.h"
#include "tapesac/replay/session.h"
#include "tapesac/runtime/plan_info.h"

namespace tapesac::runtime {

struct AutoPlannerOptions {
  /// Distinct tape signatures whose problems are cached (signatures change with shapes; the cache is cleared when
  /// it grows past this).
  size_t max_problems = 256;
  /// Measured cost vectors per signature whose per-op median is the op cost (planner::CostModel).
  size_t cost_window = 7;
  /// Plan under the sequence peak model when it could be calibrated (else always the additive model).
  bool sequence_model = true;
  /// The policy decides what is kept ("full", op sets, callables): every call keeps the mask it ran with and only
  /// the replay schedules are planned (planner::plan_schedules; a limit of 0 asks for the least peak).
  bool fixed_masks = false;
  /// Plan replay schedules from the unpack orders the session observed (planner/schedule.h); off: every call
  /// replays its dropped values at once (the default; Runtime sets it from RuntimeOptions::schedules).
  bool schedules = false;
  /// Fixed masks without a limit: the schedules may keep the predicted peak this fraction above the least one any
  /// schedules reach, at less replay time (planner::plan_schedules).
  double least_peak_slack = 0.02;
  /// Fixed masks without a limit, when >= 0 (it then replaces least_peak_slack): the schedules of the least predicted
  /// peak whose predicted replay time is at most this fraction above that of one replay per call (Note [Replay time
  /// budget] in planner/src/step.cpp).
  double schedule_time_budget = -1;
};

/// The message of an infeasible limit: the user's limit, the smallest feasible step peak and what it is made of, and
/// how to fix it ("Raise memory_limit to at least N bytes, ..."). `margin_bytes`: what the planner held back from the
/// user's limit for its prediction error (planned under limit - margin); the figure named includes it, unless
/// `measured_full_bytes` (the step peak the masks of policy "full" measured, shifted to the step's baseline; Note
/// [Measured fallback] in runtime.h) is lower: a limit at it runs. `one_segment`: the plans replay each block call's
/// dropped values at once (auto's default schedule); the message then says that schedule="planned" can go lower.
std::string infeasible_limit_message(int64_t limit_bytes, int64_t smallest_feasible_bytes, int64_t margin_bytes = 0,
                                     int64_t measured_full_bytes = INT64_MAX, bool one_segment = false);

/// Plans policy "auto" for one Session. Registers itself as the session's tape observer for its lifetime; the
/// session must outlive it.
class AutoPlanner {
 public:
  explicit AutoPlanner(replay::Session& session, AutoPlannerOptions options = {});
  ~AutoPlanner();
  AutoPlanner(const AutoPlanner&) = delete;
  AutoPlanner& operator=(const AutoPlanner&) = delete;

  /// Forgets the calls of the previous step (called when a step starts).
  void begin_step() { calls_.clear(); }

  /// Plans the observed calls under `limit` bytes (with fixed masks, 0: the least peak), calibrated on
  /// `measured_peak` bytes, and installs the plan in the session. Returns the planner's part of PlanInfo (reserve,
  /// margin, reason and step are the caller's). Throws tapesac::Error: kGeneric before any observed call,
  /// kMemoryLimit when no plan fits the limit. `margin_bytes`: the replan margin already taken off the user's limit
  /// (`limit` + margin is the user's), and `measured_full_bytes` (infeasible_limit_message), for the error message.
  /// `baseline_shift`: how much the baseline of the step planned for exceeds the last step's (Note [Baseline grown
  /// before the step] in runtime.cpp); `measured_peak` and `measured_full_bytes` are already shifted by it.
  PlanInfo plan(int64_t limit, int64_t measured_peak, int64_t margin_bytes = 0, int64_t measured_full_bytes = INT64_MAX,
                int64_t baseline_shift = 0);

  /// Installs planner::least_memory_plan of the observed calls (the masks and single replays auto's measuring
  /// step ran with) and returns its PlanInfo with `predicted_peak` as its prediction (a measured figure: Note
  /// [Measured fallback] in runtime.h). Throws tapesac::Error (kGeneric) before any observed call.
  PlanInfo plan_least_memory(int64_t predicted_peak);

  /// Note [Top-up] (planner/top_up.h): keeps more of what the plan in use drops, within `room_bytes`, when the last
  /// step's calls all ran that plan (`plan`: its PlanInfo, whose per-call and total figures are updated). Installs the
  /// changed plans in the session and returns the bytes kept more (the bound on what they add to the peak; 0 when
  /// only values whose storage stayed resident anyway were kept); nullopt: no change, nothing installed.
  std::optional<int64_t> top_up(int64_t room_bytes, PlanInfo* plan);

  /// The keep-everything ceiling of the calls observed since begin_step() (Note [Keep-everything ceiling] in
  /// planner/peak_model.h; after a step that kept everything, its measured peak `measured_peak`): what plan() would
  /// predict for keeping everything; INT64_MAX when the step's spans do not say when its calls ran, or with fixed masks.
  int64_t keep_all_ceiling(int64_t measured_peak) const;

  /// The tape signatures of the calls observed since begin_step(), in step order.
  std::vector<uint64_t> call_signatures() const;

  /// The step-level frontier of the last step's problems with the op costs measured so far: the best plan at
  /// `points` (>= 2) limits spread between the smallest feasible peak and the keep-everything peak, under the peak
  /// model and the keep-everything ceiling of the last plan. Throws tapesac::Error (kGeneric) before the first plan.
  std::vector<FrontierPoint> frontier(int points) const;

  /// The last observed problem of the block call `index` in planner text format (for fixtures and debugging).
  /// Throws tapesac::Error (kConfig) for an index past the last step's calls.
  std::string dump_problem(size_t index) const;

  /// Block calls observed since begin_step().
  size_t observed_calls() const { return calls_.size(); }

 private:
  struct Call {
    std::string name;
    std::string key;  // replay::plan_key: the name, "name#k" for the block's k-th call in the step (its spans' call)
    uint64_t signature;
    std::shared_ptr<const planner::BlockProblem> problem;
    std::vector<uint8_t> kept;
    std::shared_ptr<const std::vector<uint8_t>> holdable;  // per value (replay::holdable)
  };
  /// The problems of the last step's calls with the op costs measured so far, the step input built from them, and
  /// what the plan that ran kept per call.
  struct Prepared {
    std::vector<planner::UnpackOrder> orders;  // per call (empty values: none observed)
    planner::StepInput input;
    std::vector<int64_t> kept_ref, ws_ref;
    planner::StepExtras extras;  // of the last step (the sequence model's calibration)
    int64_t sum_kept = 0;
    int64_t max_ws = 0;
  };

  Prepared prepare() const;
  /// Adds the last step's values alive anyway (Session::last_liveness) to alive_anyway_.
  void remember_alive_anyway();
  /// alive_anyway_'s key of a call: its name and tape signature.
  static std::string alive_key(const Call& c);
  planner::UnpackOrder unpack_order(const Call& c) const;
  /// The working set of the schedule call `j` ran with in the last step (the sequence model's reference);
  /// `replayed`: the mask of what it did not replay (kept, or served live).
  int64_t ran_working_set(size_t j, const planner::BlockProblem& p, const planner::UnpackOrder& order,
                          const planner::KeepMask& replayed) const;
  planner::BlockProblem problem_with_costs(const Call& c) const;
  /// `extras`: with a retained graph, its last_backward is set (and the first backward's windows end where the
  /// second begins).
  planner::StepProfile step_profile(planner::StepExtras* extras = nullptr) const;
  planner::StepPlan plan_step(const planner::StepInput& input, bool sequence, const planner::PeakModel& model,
                              int64_t limit) const;
  /// plan_step with keeping everything predicted at the lower of the model's figure and `ceiling` (Note
  /// [Keep-everything ceiling]): a limit at (or a few bytes per call below) the ceiling keeps everything. Throws
  /// planner::InfeasibleLimitError naming at most the ceiling.
  planner::StepPlan plan_under_ceiling(const planner::StepInput& input, bool sequence, const planner::PeakModel& model,
                                       int64_t limit, int64_t ceiling) const;
  /// The keep-everything ceiling of the last step (planner::keep_all_ceiling; Note [Keep-everything ceiling] in
  /// planner/peak_model.h; a step that kept everything: its measured peak); INT64_MAX when its spans do not say
  /// when calls ran.
  int64_t keep_all_ceiling(const Prepared& prep, int64_t measured_peak) const;
  PlanInfo install(const planner::StepPlan& plan, const planner::StepInput& input);
  void observe(const replay::BlockTapeView& view);
  /// The problems_ key of a call: its signature, suffixed by its must_keep pattern when another call of that
  /// signature came with another one (Note [One tape, several must-keep patterns]).
  std::string problem_key(const std::string& sig, const std::vector<uint8_t>& must_keep);

  replay::Session& session_;
  AutoPlannerOptions options_;
  planner::CostModel cost_model_;
  std::unordered_map<std::string, std::shared_ptr<const planner::BlockProblem>> problems_;
  std::unordered_map<std::string, std::shared_ptr<const std::vector<uint8_t>>> holdable_;
  // Per call (name and signature): candidates found alive anyway after a forward that dropped them (kept by every
  // later plan of that call).
  std::unordered_map<std::string, std::unordered_set<int32_t>> alive_anyway_;
  // Per signature: the must_keep pattern of its first call (Note [One tape, several must-keep patterns]).
  std::unordered_map<std::string, std::vector<uint8_t>> must_keep_of_;
  std::vector<Call> calls_;
  planner::PeakModel last_model_;
  planner::SequencePeakModel seq_;
  int64_t seq_baseline_ = 0;  // the baseline of the step seq_ was calibrated on
  bool last_used_seq_ = false;
  int64_t last_ceiling_ = INT64_MAX;  // the keep-everything ceiling of the step the last plan was made after
  planner::StepInput last_input_;
};

}  // namespace tapesac::runtime
