// Keeping more than a plan that ran, within what its measured step left of the limit (Note [Top-up]).
//
// Note [Top-up]. The peak models bound a plan's peak from above: the sequence model's working-set bound (Note
// [Working set larger than the measured one] in peak_model.h) charges a schedule's whole new working set on the
// largest rest of its window, so a plan that ran may peak well under the limit (small Qwen3, policy "auto" at 0.9 x
// checkpointing's peak: predicted 0.987-0.996 of the limit, measured 0.833-0.840 of checkpointing's peak, i.e. 6-7%
// of the limit unused), and the room left is paid for in replay time. Re-planning from the planned step's
// measurement is not safe (a re-plan calibrated on it ran 1.4% over a limit): another plan changes what is alive
// where. A top-up changes the plan that ran only by keeping some of its dropped values, with the same replay
// schedule otherwise, and bounds the new peak by the measured one plus the bytes kept more:
//   * a value kept instead of rebuilt is alive from its forward to its last unpack, so it adds at most its
//     storage's bytes at any moment (nothing when a kept value of the same storage holds it already);
//   * every other value is alive no longer than before: the replays read the kept copy, so their closures lose ops
//     (their transients and holds shrink), and each segment still starts at the first unpack of its first value.
//     That is why a value that begins a segment with others is never kept more: the segment would start later, and
//     what is held for it would stay alive longer. A segment left with no value disappears (what was held for it is
//     freed a segment earlier).
// So the top-up keeps, greedily by replay time saved per byte (free ones first), values whose bytes fit in the room
// (the caller's limit less margin, safety and measured peak), as long as the schedule model predicts no larger working
// set and no longer holds. A call whose installed schedule the model does not reproduce (its holds) is left alone.
// Pure and torch-free, like schedule.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tapesac/common/schedule_shape.h"
#include "tapesac/planner/problem.h"
#include "tapesac/planner/schedule.h"

namespace tapesac::planner {

/// One block call of the plan that ran.
struct TopUpCall {
  const BlockProblem* problem = nullptr;  ///< with the measured op costs
  KeepMask keep;                          ///< what the plan keeps
  common::ScheduleShape shape;            ///< the schedule it replayed with (order: every dropped candidate)
  UnpackOrder unpack;                     ///< as observed (empty values: unknown)
};

/// A call the top-up changed: its new mask and schedule.
struct TopUpChange {
  size_t call = 0;                  ///< index into the calls given
  KeepMask keep;
  ScheduleChoice schedule;          ///< the new schedule and its model figures
  std::vector<int32_t> values;      ///< the values kept more, in the order chosen
  int64_t added_bytes = 0;          ///< the bound on what keeping them adds to the peak
  double saved_ns = 0;              ///< predicted replay time saved
};

struct TopUp {
  std::vector<TopUpChange> changes;  ///< ascending call index; empty: nothing fits or saves time
  int64_t added_bytes = 0;
  double saved_ns = 0;
};

struct TopUpOptions {
  /// Schedule evaluations the greedy may spend (each is one simulation of a call's segments).
  int64_t max_evaluations = 20000;
  /// The simulation work it may spend, in segments * (values + ops) summed over evaluations (Note [Bounded schedule
  /// search] in schedule.h: on blocks of thousands of ops each top-up took seconds, after every step that left room;
  /// an adversarial test). An evaluation past it is skipped as if it failed: the top-up keeps what it found so far.
  int64_t max_cells = 32'000'000;
};

/// `shape` with value `v` kept instead of replayed (Note [Top-up]): `v` leaves the order and its holds go; a segment
/// left empty disappears (later segments' indices shift down, holds until it end one segment earlier, and a hold
/// left ending before it begins goes). `v` not in the order: `shape` unchanged.
common::ScheduleShape without_value(const common::ScheduleShape& shape, int32_t v);

/// The values to keep more within `room_bytes` (Note [Top-up]). Throws tapesac::Error (kConfig) on a call without a
/// problem or with a mask of the wrong size.
TopUp top_up(const std::vector<TopUpCall>& calls, int64_t room_bytes, const TopUpOptions& options = {});

}  // namespace tapesac::planner
