// The keep/drop decision of one block call, as a pure function of the tape, what autograd saved and the policy's
// inputs (torch-free, so gtests build the tapes by hand). BlockCall::close_forward() applies it.
//
// Note [Keep or drop]. The values decided on are the *decidable* ones: saved for backward, produced on the tape, in
// an internal storage (externals and every value of a call whose recording failed are kept as they are). In order:
//  1. must-keep: a decidable value replay cannot rebuild from the values available so far (a non-replayable
//     producer, a read of external state at an earlier state, or — with a preservation plan that keeps the
//     dependents of some external storages — a rebuild reading such a storage), or one whose storage the block
//     writes after the save (Note [Written after its save], decide.cpp). Tape order, each found one is made
//     available at once so later values can be rebuilt from it. Skipped under policy "none" when nobody observes
//     (every value is kept anyway: the prunes are O(ops) each).
//  2. the policy: "none" keeps, "full" drops, an op set keeps the outputs of the ops it names (the op that wrote the
//     bytes the save sees, Tape::bytes_writer), a plan keeps what its mask says when its signature matches the tape's
//     (else the call runs as "full"). A policy callable that throws keeps the value and is reported.
//  3. a dropped value that cannot be rebuilt from what is now available (the policy kept less than a rebuild needs)
//     is kept after all.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tapesac/capture/tape.h"
#include "tapesac/replay/prune.h"
#include "tapesac/replay/schedule.h"

namespace tapesac::replay {

enum class PolicyKind { kNone, kFull, kSaveOps, kPlan };

/// The plan of one block call: for the block call whose tape has `signature`, under policy kPlan keep candidate i
/// iff keep[i] (candidates in the order BlockTapeView lists them; other policies decide themselves and leave it
/// empty), and replay the dropped values by `schedule` (schedule.h; empty order: the call's default schedule).
struct BlockPlan {
  uint64_t signature = 0;
  std::vector<uint8_t> keep;
  ReplaySchedule schedule;
  /// The planner's prediction of the most bytes the call's replays hold at once under `schedule` (0: none).
  int64_t schedule_ws_bytes = 0;
};

/// The key of a block call's plan among a step's plans (Session::set_plans): its block's name for the block's first
/// call in the step, "name#k" for its k-th call (k >= 2). A block called twice in a step (a shared layer, a
/// recurrent stack) gets a plan per call: its calls can have other tapes, and the planner can give equal tapes other
/// masks and schedules (before, the second call took the first's plan or none: a step of the random programs with a
/// repeated block ran its second call without a plan and replanned every step).
std::string plan_key(const std::string& name, int32_t occurrence);

/// One saved tensor as the decision sees it: its value (>= 0) and the state of its storage when it was saved.
struct SavedValue {
  ValueId value = -1;
  int32_t state = 0;
};

struct DecisionInput {
  const Tape* tape = nullptr;
  /// Every live saved tensor that the tape produced or registered (duplicates allowed).
  std::vector<SavedValue> saved;
  /// Recording failed: every saved value is kept.
  bool capture_failed = false;
  PolicyKind policy = PolicyKind::kFull;
  /// kSaveOps: true when the outputs of an op of this kind are kept. May throw (the value is then kept).
  std::function<bool(capture::OpKind)> keep_op;
  /// kPlan: the block's plan, or null (the call runs as "full").
  const BlockPlan* plan = nullptr;
  /// Per value: 1 for an external value whose storage the preservation plan keeps the dependents of (empty: none).
  std::vector<uint8_t> kept_externals;
  /// Someone reads must_keep (the planner observes): compute it even under policy "none".
  bool observed = false;
  /// Compute the tape signature (a plan, an observer or the graph cache needs it).
  bool want_signature = false;
};

struct KeepDecision {
  /// Per value: 1 keep, 0 drop, -1 not saved.
  std::vector<int8_t> keep;
  /// Per value: replay holds a live tensor for it (saved externals and every kept value).
  std::vector<uint8_t> available;
  /// The decidable values, ascending; must_keep[i] and kept_mask() follow this order.
  std::vector<ValueId> decidable;
  std::vector<uint8_t> must_keep;
  /// The state each decidable value was saved at (indexed by ValueId).
  std::vector<int32_t> state;
  uint64_t signature = 0;
  /// kPlan: the plan matched the tape and was applied.
  bool planned = false;
  /// The policy callable threw for some value (kept); its first message.
  bool policy_failed = false;
  std::string policy_error;

  /// 1 per decidable value that is kept (the tape observer's view).
  std::vector<uint8_t> kept_mask() const;
  /// Marks `v` kept and available (approximation keeps more values after the decision).
  void force_keep(ValueId v);
};

/// The decision of Note [Keep or drop]. Pure; the rebuildability checks cost O(ops + reads) in all (RebuildCheck).
KeepDecision decide_keep(const DecisionInput& in);

/// Note [Decisions reused]. A block whose tape is the same every step gets the same decision every step, and the
/// rebuildability checks behind it are most of the cost of closing its forward. decision_key() flattens everything
/// decide_keep() reads — every op (kind, flags, inputs with their states and read kinds, outputs, writes), every
/// value (storage, producer, state, the whole view), every storage (external, size), the saved values in order,
/// the policy and its inputs (the plan's signature and mask, the kept external storages, observed, capture failed)
/// — into words: equal keys are equal inputs, compared word for word (no hash, so no collision). The policy
/// callable is the one input not in the key: its answers are asked once per op kind per Session (SaveOpCache), so
/// equal tapes get equal answers; a decision in which it raised is never reused. Reuse is exact by construction:
/// a block whose tape changes (MoE routing, a new sequence length, a data-dependent branch, autocast toggled)
/// gets a new key and is decided afresh.
void decision_key(const DecisionInput& in, std::vector<int64_t>& key);

/// The last decision made for one block name, and what it let the call keep live for replay
/// (BlockCall::trim_live()).
struct DecisionMemo {
  std::vector<int64_t> key;     // decision_key() of the input decided; empty: nothing to reuse
  std::vector<int64_t> scratch; // the next call's key is built here (its capacity kept across steps)
  KeepDecision decision;
  std::vector<uint8_t> needed;  // per value: a live tensor replay reads (valid when has_needed)
  bool has_needed = false;
};
/// Per block name (a Session's; its block calls read and write it on the forward thread).
using DecisionMemos = std::unordered_map<std::string, DecisionMemo>;

/// Values whose rebuild reads a value marked in `seeds` (per value), by forward data flow over the tape: every output
/// of an op reading a marked value is marked. Over-approximates (an op may not read the bytes).
std::vector<uint8_t> propagate_taint(const Tape& tape, std::vector<uint8_t> seeds);

/// A 64-bit signature of a block call's tape and candidates: op kinds, flags, data flow, sizes and the candidate
/// list. Equal signatures mean identical planning problems.
uint64_t tape_signature(const Tape& tape, const std::vector<ValueId>& candidates);

}  // namespace tapesac::replay
