// Cost and memory of a keep mask for one block (see Note [Replay closure] in problem.h). These walk the tape
// directly and are the reference the solvers are tested against. Pure functions; each is O(ops + reads + values).
//
// All of them validate the mask (validate_mask) and throw tapesac::Error (kConfig) when it drops a must_keep
// candidate or a candidate whose rebuild needs a non-replayable op. They do not re-validate the problem: call
// validate_problem once on problems that come from outside.
#pragma once

#include <cstdint>
#include <vector>

#include "tapesac/planner/problem.h"

namespace tapesac::planner {

/// The ops replay runs to rebuild every dropped candidate, ascending tape order: the producer closure of the
/// dropped candidates, stopping at kept candidates and external values.
std::vector<int32_t> replay_ops(const BlockProblem& problem, const KeepMask& keep);

/// Sum of the costs of replay_ops (an op serving several dropped values counts once).
double replay_cost_ns(const BlockProblem& problem, const KeepMask& keep);

/// Peak bytes allocated while replaying replay_ops in tape order. An op allocates all its outputs while its inputs
/// are still live; an output lives until its last read by a later replayed op, except dropped candidates, which
/// live to the end (autograd unpacks them), and replayed copies of kept candidates, which die at once (readers use
/// the resident copy). Kept candidates and externals themselves are not counted (they are resident). An output
/// that aliases a storage (PlanValue::storage) replay already holds adds only what it grows it by; one that
/// aliases a resident storage adds nothing (a write into it through a private copy is not counted).
int64_t replay_working_set_bytes(const BlockProblem& problem, const KeepMask& keep);

/// Bytes held by the kept candidates: each storage once (at its largest kept member); external storages are free.
int64_t kept_bytes(const BlockProblem& problem, const KeepMask& keep);

/// The candidates that can never be dropped: must_keep, plus those whose rebuild needs a non-replayable op.
/// Keeping exactly these is the minimum-memory mask (other zero-byte candidates aside).
KeepMask forced_keep(const BlockProblem& problem);

/// Every candidate kept.
KeepMask keep_all(const BlockProblem& problem);

}  // namespace tapesac::planner
