// The step-peak model: predicted peak = baseline + sum over block calls of kept bytes + the largest replay
// working set of one block call. `baseline` is everything the planner does not choose (parameters, gradients,
// optimizer state, activations outside blocks, the forward's transient); it is calibrated from one measured step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
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
  /// Of `bytes`, those the replays allocated that are still alive (rebuilt values, transients of a running replay).
  int64_t replay_bytes = 0;
  /// Of `bytes`, those of dropped values still alive, from their call's forward end to its first unpack (Note
  /// [Dropped bytes still alive] in allocator/telemetry.h).
  int64_t dropped_alive = 0;
};

/// One moment of a backward window (Note [Backward levels]): the bytes in use less the replays' bytes alive
/// (`rest`), and those replay bytes.
struct RestLevel {
  int64_t rest = 0;
  int64_t replay = 0;
};

/// The levels that matter for max over levels of rest + min(k, replay) at every k >= 0, at most `max_levels` (>= 1)
/// of them: the undominated ones (a level is dominated by one with no less rest and no less rest + replay), adjacent
/// ones merged into one that dominates both while too many (so the maximum is never lowered). Rest descending.
std::vector<RestLevel> reduce_levels(std::vector<RestLevel> levels, size_t max_levels = 32);

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
  /// Per block call, in forward order: its backward window's levels (reduce_levels; Note [Backward levels]).
  std::vector<std::vector<RestLevel>> backward_levels;
};

/// The profile of a timeline given each call's forward span and first replay start (forward order; a replay start
/// < 0 means the call did not replay, which makes the profile invalid). `offset` is added to every figure (the
/// step's baseline). The last backward window ends at `end_ns` (the step's end by default).
StepProfile profile_step(const std::vector<TimedBytes>& timeline, const std::vector<int64_t>& forward_begin_ns,
                         const std::vector<int64_t>& forward_end_ns, const std::vector<int64_t>& replay_start_ns,
                         int64_t offset, int64_t end_ns = std::numeric_limits<int64_t>::max());

/// Bytes a step held from `t_ns` to its end only because it replays: the copies that undo writes to a storage a
/// replay reads (replay/preserve.h: a `.data` write after a block read a weight). Keeping everything replays nothing
/// and saves none (random program 4181: a 256-byte weight region, the ceiling 17,352 for a keep-everything peak of
/// 17,096).
struct HeldToEnd {
  int64_t t_ns = 0;
  int64_t bytes = 0;
};

/// A change of the dropped bytes of call `call` (forward order) the step held anyway (allocator::AliveChange):
/// `bytes` > 0 from `t_ns` on, < 0 no longer. A call < 0: a mark of no known call (always subtracted).
struct CallAlive {
  int64_t t_ns = 0;
  int32_t call = -1;
  int64_t bytes = 0;
};

/// Note [Keep-everything ceiling]. Neither peak model ever sees a step that kept everything before one runs: both
/// extrapolate from the plan that ran ("full" on the measuring step), and either can miss keeping everything by
/// kilobytes (the additive model holds every call's kept bytes at once: 30,556 predicted, 26,608 measured on a
/// random program; the sequence model charges a window's whole measured working set: 18,576 vs 14,396). This bound
/// reads the measured timeline instead: keeping everything holds, at each moment t, at most what the step held then
/// (the plan's kept bytes, and its replays' rebuilt values in place of the values keeping everything would hold)
/// plus the bytes the plan dropped from every call whose forward had ended and whose last replay had not begun yet
/// (values that keeping everything would hold then and the step did not), less the dropped values the step held
/// anyway then (`dropped_alive`: autocast's cast cache until the end of its region, a module that stored them; they
/// are in bytes(t) and in dropped_k), and less what each call held only for its replays (`held_bytes`: a block
/// input the forward did not save, as when autocast casts it first — keeping everything frees it; as in the
/// sequence model, it is taken as held from the call's forward end, and the call lets go of it at the step's end).
/// So
///   ceiling = max_t ( bytes(t) - dropped_alive(t) + offset + sum_{k: forward_end_k <= t < release_k} dropped_k
///             - sum_{k: forward_end_k <= t} held_k ).
/// (The autocast case of test_user_holes.py on one intra-op thread: 538,504 without either correction, 489,352 with
/// them, the measured peak of keeping everything.) For a step that kept everything (dropped_k = 0) it is the
/// measured peak. It is not a bound when a kept value
/// outlives its rebuilt copy, or an input the replays read outlives the nodes that saved it (both now freed with
/// them: Note [Kept values freed with their slots], Note [Externals freed with their readers] in
/// replay/src/block_call.cpp). Under the sequence model it alone decides whether keeping everything fits (Note
/// [Keeping everything by the ceiling] in runtime/src/auto_planner.cpp); the additive model takes the lower of it and
/// its own keep-everything figure.
/// `release_ns[k]` < 0: the call never replayed (its dropped bytes count to the end). Returns INT64_MAX for an empty
/// timeline or mismatched sizes (no bound).
/// `held_to_end`: what the step held only because it replays from a moment to its end (HeldToEnd), subtracted from
/// that moment on.
/// `alive` (when not null) replaces the points' `dropped_alive` by whose bytes they are: a call's dropped bytes the
/// step held anyway count once only while they are pending (before the call's last replay began, or to the end
/// when it never replayed). After that they are in bytes(t) only — a value alive at its unpack is served as it is,
/// never rebuilt — and subtracting them would count them not at all (random program 2141: the block's input,
/// which its caller still held, was unmarked at the call's first unpack while its dropped bytes were still
/// pending until the replay: keep-everything predicted 12,928 for a measured 12,548).
int64_t keep_all_ceiling(const std::vector<TimedBytes>& timeline, const std::vector<int64_t>& forward_end_ns,
                         const std::vector<int64_t>& release_ns, const std::vector<int64_t>& dropped_bytes,
                         int64_t offset, const std::vector<int64_t>& held_bytes = {},
                         const std::vector<HeldToEnd>& held_to_end = {},
                         const std::vector<CallAlive>* alive = nullptr);

/// What a measured step held besides the kept bytes of its plan, per block call in forward order (Note [Sequence
/// model in unusual steps]); empty vectors mean zeros.
struct StepExtras {
  /// Bytes of the call's dropped values that stayed alive anyway after its forward (a module stored them, autocast's
  /// cast cache, a later block): alive through the forward windows after the call and the tail.
  std::vector<int64_t> alive_forward;
  /// Bytes of the call's dropped values the backward found alive: alive through the backward windows up to the
  /// call's own.
  std::vector<int64_t> alive_backward;
  /// Bytes of the inputs the call held only for its replay at the end of the forward (a block input the forward
  /// did not save): held from then on through the backward windows up to the call's own, by a plan that replays.
  std::vector<int64_t> held_for_replay;
  /// The call's kept bytes when it keeps everything (a plan keeping less replays, and holds held_for_replay).
  std::vector<int64_t> keep_all;
  /// With `retained`: bytes of the call's values that a later backward's graph held (the first backward rebuilt
  /// them and they were alive when the second began): alive in every backward window.
  std::vector<int64_t> alive_retained;
  /// With `retained`: the profile of the last backward over the graph alone (its windows start at each call's
  /// first replay in it; invalid: not measured, every window then counts every call's kept bytes).
  StepProfile last_backward;
  /// The step backwarded a graph it retained (retain_graph=True then another backward, two autograd.grad calls, a
  /// double backward): a saved tensor was unpacked more than once.
  bool retained = false;
  /// Per call (empty: none): 1 when its replays ran in several segments, spread over its backward window (Note
  /// [Working set larger than the measured one]: any other plan of the call is charged on the window's largest rest).
  std::vector<uint8_t> spread;
};

/// The sequence (max-plus) peak model. During call k's forward, the calls before it hold what they keep and k holds
/// all it saves (it decides at the end of its forward): fwd_k = f_k + sum_{j<k} kept_j. After the last forward,
/// every call's kept bytes are alive: tail = t + sum_j kept_j. While call i's backward runs, the calls before it
/// (and i) still hold what they keep, the calls after it have freed theirs (and their gradients exist), and i's
/// replay working set is alive: bwd_i = b_i + sum_{j<=i} kept_j + ws_i. The step peak is the largest of these and
/// the pre-block peak. The constants come from one measured step (calibrate): they hold what the plan does not
/// change — parameters, gradients so far, optimizer state, the activations outside the blocks, transients.
///
/// Note [Sequence model in unusual steps]. Two step shapes break the windows above, both measured on the step the
/// model is calibrated on (StepExtras):
///  * A graph retained across backwards: while an earlier backward runs, every call still holds what it keeps (the
///    graph is kept for the next backward), so bwd_i = b_i + sum_j kept_j + ws_i over all calls (`retained`),
///    calibrated on the windows up to the start of the second backward. The last backward's windows (from each
///    call's first replay in it) are as in a plain step: last_i = l_i + sum_{j<=i} kept_j + ws_i. Without that
///    measurement every window counts every call's kept bytes: the safe side. A first backward
///    with create_graph=True builds a graph that holds what it unpacked, rebuilt values included: those are counted
///    as kept on the measured step (`alive_retained`), or a plan keeping them would pay for them twice.
///  * Dropped values alive anyway (Note [dropped values alive elsewhere], replay/block_call.h): dropping them freed
///    nothing, so the measured windows hold them although the plan that ran did not keep them. Calibration counts
///    them as kept where they were alive (forward windows after their call and the tail: alive when the backward
///    began; backward windows up to their call's: alive at their first unpack), so that a plan that keeps them is
///    not charged twice. The planner keeps them in every later plan (runtime/auto_planner.h): a plan dropping them
///    would be predicted to save bytes that dropping does not free.
///
/// Note [Backward levels]. In a graph retained across backwards, the windows before the last backward are not
/// "b_i + sum_j kept_j + ws_i" with the whole working set alive at the window's peak: a kept value stays alive after
/// its last unpack (the graph keeps it for the next backward), a rebuilt one dies there — or lives on in the graph a
/// create_graph=True backward built from it, until the next backward consumes that graph. Two errors followed, both
/// measured: (1) calibration subtracted the whole working set ws_i from a peak at which only part of it was alive
/// (double backward: the peak lies after the first backward, in the second's pass over the graph the first built,
/// which holds one rebuilt value of each call and none of the rest), so keeping everything was predicted 49,152
/// bytes (+3.4%) above its measured peak; (2) which values a plan keeps decides when it replays: keeping the value
/// the backward unpacks first and dropping a later one puts the later replay on top of the gradients the backward
/// allocated meanwhile, while the kept value is still alive (retain_graph: predicted 642,184, measured 691,464, for
/// one of two plans of equal kept bytes and working sets; which one the planner picks follows the measured op costs).
/// So these windows are predicted from the measured timeline itself: at each moment t of window i, the bytes in use
/// less the replays' bytes alive (rest(t), less what the plan that ran kept) and those replay bytes p(t). A plan K
/// keeps all_K (every call's kept bytes, alive through these windows) and has rebuilt at most what the measured step
/// had rebuilt and still alive then — it replays no earlier, its rebuilt values die no later — and at most the
/// working sets it replays: bwd_i = max_t rest(t) + all_K + min(sum_j ws_j + dropped_more, p(t)), where dropped_more
/// is what K keeps less than the plan that ran (values that may then be alive as rebuilt ones whenever p(t) had
/// none). For the plan that ran this is the measured window exactly; for keeping everything it is max_t rest(t) +
/// all_K (double backward: equal to the measured no-checkpoint peak).
/// Note [Window of a call keeping more]. Without a retained graph, bwd_i = b_i + sum_{j<=i} kept_j + ws_i charges
/// the whole working set measured for call i's replay as alive at its window's peak, so a plan that keeps more of
/// call i and replays less there is predicted lower by the working set it no longer replays, less what it keeps
/// more. Where the window peaks after the replay (the backward's gradients on top of the values the replay rebuilt,
/// its transients gone), that is wrong: a value kept instead of rebuilt is alive wherever its rebuilt copy was.
/// Random program 2206, at a limit equal to "full"'s measured peak (14,848 bytes): a plan keeping 2,712 more bytes
/// and replaying 4,900 fewer was predicted 14,848 and measured 16,552. So the window is also read from its levels
/// (as Note [Backward levels] does for retained graphs): at each moment t, rest(t) (bytes in use less the replays'
/// bytes alive; less what the plan that ran kept before call i and held up to it) plus what plan K keeps before i
/// and holds up to it, plus at most the replay bytes the measured step had alive then, p(t), of: what K replays in
/// this window (call i's working set, and what K keeps less than the plan that ran) and the values of call i that
/// K keeps and the plan that ran rebuilt (their bytes beyond its kept ones and the dropped values alive anyway):
///   bwd_i = max( b_i + sum_{j<=i} kept_j + ws_i,
///                max_t rest(t) + sum_{j<i} kept_j + min(p(t), ws_i + dropped_more + kept_more_i) ).
/// (Charging also the working sets of the calls backwarded before i, an upper bound on what they may leave alive,
/// put every plan of the bench's small Qwen3 and Llama at the measuring step's one-segment windows: auto refused
/// every limit below checkpointing's peak, test_schedule.py::test_auto_plans_below_checkpointings_peak_on_the_bench_model.)
/// For the plan that ran the second term is at most the measured window; the first covers what p(t) cannot see
/// (a plan that replays more than the timeline's replays held). The second term is for plans that replay: it
/// charges every value a call keeps more wherever the step had replay bytes alive, transients included, which
/// for keeping everything put 11 more random programs above their no-checkpoint peak (2071: 2,264 bytes); that
/// plan is bounded by Note [Keep-everything ceiling] instead.
/// Note [Working set larger than the measured one]. backward_c is the window's peak less the whole working set of
/// the schedule that ran. When that schedule was lazy (the measuring step under a limit: one segment per value),
/// its working set is the most it held at once, often not at the window's peak; a plan replaying more at once
/// (one segment, or segments holding what later ones read) may hold it on top of what the window holds at another
/// moment. Small Qwen3-MoE under "full" at its lowest bench_limits limit, step 2: predicted 70,902,688 bytes,
/// measured 72,431,440 (2.1% over the limit), in the window of call 0. For a call whose working set exceeds the
/// measured one the window is bounded instead by its largest rest (bytes in use less the replays' bytes alive, at
/// any moment of the window) plus the whole new working set: rest_c[i] + sum_{j<=i} kept_j + held + ws_i. When the
/// replays that ran were spread over the window (several segments: auto's lazy measuring step with planned
/// schedules, a planned step), so is the moment of that working set: a plan replaying less, but at another moment,
/// may meet a larger rest (random program 5, `auto` with schedule="planned" at 30% of the way from "full" to "none":
/// the first plan replayed call 0 in one segment of 1,152 bytes where the lazy step's largest was 1,200, and its
/// window ran 200 bytes over the 7,464 predicted, 161 over the limit). For such a call every plan other than the one
/// that ran (other kept bytes or working set) is bounded the same way. The bound is loose; the top-up (Note
/// [Top-up], top_up.h) gives the room back after the step that runs the plan.
/// In that window the measuring step peaked during a replay, with little of the backward's own memory
/// alive; the plan held 9.5 MB of rebuilt values across segments through a later moment at which the backward had
/// 6.3 MB more allocated. Measured with perf/bench_limits.py (small and medium Qwen3, Llama, Qwen3-MoE, 3 limits,
/// `full` and `auto`, 5 steps): 0 of 180 steps over the limit (7 before, all Qwen3-MoE's step 2). The bound is an
/// upper one: planned steps of the dense models now peak at 0.923-0.985 of the limit (0.967-1.000 before), and
/// `auto` at 0.9x checkpointing's peak recomputes more (small Qwen3 / Llama: 66 / 70 ms, 49 / 50 ms before).
struct SequencePeakModel {
  bool valid = false;
  int64_t pre = 0;
  std::vector<int64_t> forward_c;   // per call, forward order
  int64_t tail_c = 0;
  std::vector<int64_t> backward_c;  // per call, forward order
  /// A graph retained across backwards: every call's kept bytes count in the backward windows before the last
  /// backward over the graph; those of the last (last_backward_c, when measured) are as without.
  bool retained = false;
  std::vector<int64_t> last_backward_c;  // per call, forward order (empty: not measured)
  /// With `retained`, per call (empty: not measured): the levels of its window before the last backward, rest less
  /// the kept bytes of the plan that ran (Note [Backward levels]); they replace backward_c there.
  std::vector<std::vector<RestLevel>> backward_levels;
  /// The kept bytes (and held for replays) of the plan the levels were measured on, over all calls.
  int64_t levels_all_ref = 0;
  /// Per call (empty: none): the bytes a plan that replays holds for the replay after the forward (the tail and
  /// the backward windows up to the call's), and the kept bytes of keeping everything (which replays nothing).
  std::vector<int64_t> held_for_replay;
  std::vector<int64_t> keep_all;
  /// Without `retained`, per call (empty: not calibrated with them; Note [Window of a call keeping more]): its
  /// backward window's levels, rest less what the plan that ran kept before the call and held up to it; the kept
  /// bytes and dropped values alive anyway of that plan; and every call's kept and held bytes in that plan.
  std::vector<std::vector<RestLevel>> window_levels;
  std::vector<int64_t> kept_ref, alive_ref;
  int64_t window_all_ref = 0;
  /// Without `retained`, per call (empty: not calibrated with them; Note [Working set larger than the measured
  /// one]): the replay working set of the schedule that ran, and the window's largest bytes in use less the
  /// replays' bytes alive, less what backward_c's term counts besides (as backward_c).
  std::vector<int64_t> ws_ref, rest_c;
  /// With rest_c, per call (empty: none): its replays ran spread over the window (StepExtras::spread); a plan keeping
  /// kept_ref's bytes with the same working set is taken for the plan that ran.
  std::vector<uint8_t> spread;
  /// Added to every prediction: how much the step's baseline (bytes in use when it began: parameters, gradients kept
  /// from the previous step, optimizer state) grew since the step the model was calibrated on.
  int64_t baseline_shift = 0;

  /// The predicted step peak for per-call kept bytes and replay working sets (forward order).
  int64_t predict(const std::vector<int64_t>& kept, const std::vector<int64_t>& ws) const;
  /// The model that predicts `profile` exactly for the plan that ran (its per-call kept bytes and working sets,
  /// and what else the step held: `extras`).
  static SequencePeakModel calibrate(const StepProfile& profile, const std::vector<int64_t>& kept_ref,
                                     const std::vector<int64_t>& ws_ref, const StepExtras& extras = {});
};

}  // namespace tapesac::planner
