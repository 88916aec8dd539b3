// The replay schedule of one block call: which dropped values each replay rebuilds, in which order, and which values
// a replay leaves alive for a later one. Torch-free (gtests build the tapes by hand); BlockCall follows it
// (block_call_schedule.cpp), the planner chooses it (planner/schedule.h).
//
// Note [Replay schedule]. Backward first-unpacks a block's dropped values in an order that is stable for a tape
// signature: observed on a measuring step; before that, guessed as the reverse of the order in which autograd saved
// them. A schedule splits that order into *segments*. The first unpack of a value of segment s that is not rebuilt
// yet replays s: the producer closure (prune()) of s's values still needed, reading as live the externals and kept
// values, the values earlier replays *hold* for later segments, and the rebuilt values of earlier segments still
// waiting for their unpacks. A hold {value, until} is a value (a later segment's dropped value, or an intermediate of
// the replay that computes it) which the replay producing it keeps alive until segment `until` has replayed; what a
// later segment needs and nobody holds, its own replay recomputes. So:
//  * one segment is the replay of every dropped value at the block's first unpack (the behaviour without a
//    schedule); one segment per value is the lazy extreme;
//  * holding everything later segments read (hold_everything) runs every op at most once — no recompute — and keeps
//    about as much alive as one segment; holding nothing keeps the least alive and recomputes the most. What lies
//    between is the planner's choice from measured op costs and bytes (planner/schedule.h; Config.schedule
//    "planned"). Under a memory limit a replay holds only the extras that fit (BlockCall::fit_extras).
//  * without a plan's schedule or a forced shape (Session::force_schedule) a call replays one segment.
// Only a value at its storage's final state on the tape can be held (holdable()): a later in-place write inside the
// same replay would change the held bytes. Following a schedule never changes what a replay computes, only when: a
// value nobody holds any more is recomputed, so a replay in another order than the schedule's is still exact.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tapesac/capture/tape.h"
#include "tapesac/common/schedule_shape.h"
#include "tapesac/replay/prune.h"

namespace tapesac::replay {

/// How one block call's backward used its dropped values (the planner's input, planner/schedule.h).
using UnpackObservation = common::UnpackObservation;
/// A value a segment's replay keeps alive for a later one (Note [Replay schedule]).
using ScheduleHold = common::ScheduleHold;
/// The schedule a block call follows: the order, its segments and the holds (the planner's ScheduleChoice is one).
using ReplaySchedule = common::ScheduleShape;

/// A schedule shape every block call follows whatever its plan says (Session::force_schedule; tests and diagnosis):
/// kNone (plans, else the default), kOneSegment, kHoldAll (one segment per value, hold_everything) and kLazy (one
/// segment per value, nothing held: every segment recomputes what it needs).
enum class ForcedSchedule : uint8_t { kNone, kOneSegment, kHoldAll, kLazy };
/// "none", "one_segment", "hold_all", "lazy". Throws ConfigError listing them otherwise.
ForcedSchedule parse_forced_schedule(const std::string& name);

/// Dropped values in the order backward is expected to first unpack them when none was observed: `saved` lists the
/// value of every saved tensor in pack order (duplicates allowed); a value is placed by its last save, latest first
/// (what the forward saved last, the backward needs first).
std::vector<ValueId> guessed_order(const std::vector<ValueId>& saved);

/// `order` as one segment (no holds).
ReplaySchedule one_segment(std::vector<ValueId> order);
/// `order` with one segment per value (no holds).
ReplaySchedule per_value_segments(std::vector<ValueId> order);

/// Per ValueId (size `nvalues`): the segment of each value of `s.order`, -1 for the others.
std::vector<int32_t> segment_index(const ReplaySchedule& s, size_t nvalues);
/// Per ValueId (size `nvalues`): the `until` of each held value, -1 for the others; `from` (may be null) receives
/// each held value's `from`.
std::vector<int32_t> hold_index(const ReplaySchedule& s, size_t nvalues, std::vector<int32_t>* from = nullptr);

/// A value a replay may hold: produced on the tape, in an internal storage, at that storage's final state.
bool holdable(const Tape& tape, ValueId v);

/// The holds under which no later segment recomputes what an earlier one computed (Note [Replay schedule]): the
/// segments are simulated in order, each replay making every holdable value it produces available to the later ones;
/// a value some later segment's closure reads is held until the last such segment. `state` gives the state at which
/// each value of `s.order` is read (indexed by ValueId); `available` as for prune(). Pure; O(segments * (ops + reads)).
std::vector<ScheduleHold> hold_everything(const Tape& tape, const ReplaySchedule& s, const std::vector<int32_t>& state,
                                          const std::vector<uint8_t>& available);

/// One segment's replay as BlockCall runs it: the closure of `targets` over `available` (which includes what is held
/// and the rebuilt values still alive), and the values the replay must also return because a later segment holds
/// them: every holdable value with hold_from <= `segment` < hold_until (per ValueId; hold_until -1: none) that an op
/// of the closure produces and that is not available already.
struct SegmentReplay {
  PruneResult plan;
  std::vector<ValueId> extras;
};
SegmentReplay plan_segment(const Tape& tape, const std::vector<Read>& targets, const std::vector<uint8_t>& available,
                           const std::vector<int32_t>& hold_from, const std::vector<int32_t>& hold_until,
                           int32_t segment);

}  // namespace tapesac::replay
