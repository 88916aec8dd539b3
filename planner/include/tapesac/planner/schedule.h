// Replay schedules as the planner models them (replay/schedule.h runs them; Note [Replay schedule] there). For a
// block's keep mask and the order in which its backward first unpacks the dropped candidates, the schedules worth
// choosing between: from one segment (every dropped value rebuilt at the first unpack, no recompute) to one segment
// per value with nothing held (the least alive at once, the most recompute), each with its replay cost and the most
// bytes the block's replays hold at once — the sequence peak model's working set ws_i (peak_model.h).
//
// Note [Schedule model]. Segment s starts at the first unpack of its first value. While its replay runs, alive are:
// the rebuilt values of earlier segments whose last unpack comes later (UnpackOrder::dies_before), the values held
// for s or later segments, and the replay's own working set (its outputs while read, its targets and what it holds
// to the end). Its closure stops at external values, kept candidates and whatever is alive and holdable. A value is
// held when a replay at or after its `hold_from` segment produces it and a later segment's closure reads it; it is
// then alive from that replay to the replay of the last segment reading it (a value produced earlier than hold_from
// is freed and recomputed by the first segment that needs it, which may then hold it). schedule_choices() starts
// from "hold everything from the start" on the finest segments and, at the segment where the working set peaks,
// moves one hold past it (hold_from := that segment + 1): the one that lowers the working set most per nanosecond of
// recompute it adds, as long as the working set falls. Pure, torch-free; O(segments * (ops + reads)) per evaluation.
#pragma once

#include <cstdint>
#include <vector>

#include "tapesac/common/schedule_shape.h"
#include "tapesac/planner/problem.h"

namespace tapesac::planner {

/// How a block's backward uses its dropped values, observed on a measuring step (replay::Session::unpack_orders; the
/// values and dies_before of common::UnpackObservation), and which values a replay may hold.
struct UnpackOrder : common::UnpackObservation {
  /// Per value of the problem: 1 when a replay may hold it (replay::holdable: at its storage's final state). Empty:
  /// every value produced by an op.
  std::vector<uint8_t> holdable;
};

/// One replay schedule of a keep mask (its shape: the dropped candidates' value ids in replay order, the index of
/// each segment's first value — empty: one segment — and the holds) and its model figures (Note [Schedule model]).
struct ScheduleChoice : common::ScheduleShape {
  /// What is held: `value` when a replay of a segment in [from, until) produces it, until segment `until` replayed.
  using Hold = common::ScheduleHold;
  double replay_cost_ns = 0;
  /// The most bytes the block's replays hold at once.
  int64_t working_set_bytes = 0;
  /// The most bytes held across segments (values rebuilt for a later segment).
  int64_t held_bytes = 0;
  /// The segment whose replay makes working_set_bytes.
  int32_t peak_segment = 0;
};

// Note [Bounded schedule search]. One evaluation costs O(segments * (values + ops)) and the greedy may evaluate once
// per held storage group per step, so on a block of thousands of ops (an unrolled RNN: bidirectional nn.GRU layers
// saved 1,172 tensors in two blocks) the search grew with the cube of the block: a first step of 6.5 s at sequence 16
// and 26 s at 32 against 0.05-0.07 s plain (an adversarial test). The finest segments are therefore at most
// `max_segments` runs of consecutive values of the replay order (one value each in blocks that drop fewer), and the
// greedy stops after `max_cells` segment-times-(values + ops) of simulation (at least 4 evaluations). Neither binds
// on a transformer layer (about 40 dropped values, 250 values and ops: 1,600 evaluations' worth against 800).
struct ScheduleOptions {
  /// Evaluations schedule_choices() may spend on its greedy (each is one simulation of the segments).
  int32_t max_evaluations = 800;
  /// The most segments of the finest schedule (consecutive values of the replay order share one beyond it).
  int32_t max_segments = 128;
  /// The simulation work schedule_choices() may spend, in segments * (values + ops) summed over evaluations.
  int64_t max_cells = 16'000'000;
};

/// Per value: the first segment whose replay may hold it (kNeverHold: none).
constexpr int32_t kNeverHold = 1 << 30;

/// The figures of the schedule with segments `segment_begin` (empty: one) over `order` (the dropped candidates in
/// replay order), where value v may be held from segment hold_from[v] on (per value; empty: never; values that are
/// not holdable never are). Throws tapesac::Error (kConfig) when `keep` is not a mask of `problem` or `order` lists a
/// value that `keep` does not drop.
ScheduleChoice evaluate_schedule(const BlockProblem& problem, const KeepMask& keep, const UnpackOrder& unpack,
                                 std::vector<int32_t> order, std::vector<int32_t> segment_begin,
                                 const std::vector<int32_t>& hold_from);

/// The dropped candidates of `keep` in the order of `unpack` (those it misses last, in reverse candidate order).
std::vector<int32_t> replay_order(const BlockProblem& problem, const KeepMask& keep, const UnpackOrder& unpack);

/// The schedules of `keep` worth choosing between, ascending replay cost and strictly descending working set
/// (Note [Schedule model]); the first costs what one segment costs (every op once): one segment, or finer
/// segments holding what later ones read when those keep less alive (they then replace it). Never empty.
std::vector<ScheduleChoice> schedule_choices(const BlockProblem& problem, const KeepMask& keep,
                                             const UnpackOrder& unpack, const ScheduleOptions& options = {});

}  // namespace tapesac::planner
