// Keep-set selection for one block: the keep mask of minimal replay cost whose kept bytes fit a budget.
//
// select_heuristic is for real tapes (hundreds of ops, 20-200 candidates): greedy constructions that are
// closure-aware (a move may keep a whole set of candidates when only together they make an op unnecessary; a drop
// is priced by the ops it alone brings back), starts from the exact Lagrangian (min-cut) hull points, local search
// (swaps, add-and-repair, drop-and-refill), and a final large-neighbourhood search that re-solves a few
// candidates near the decision boundary exactly. select_exact is a branch and bound for small problems. Both see
// the problem as in Note [Replay closure] (problem.h).
// Pure functions; thread-compatible.
#pragma once

#include <cstdint>

#include "tapesac/planner/problem.h"

namespace tapesac::planner {

struct Selection {
  /// false when even the minimum-memory mask exceeds the budget; `keep` is then that mask.
  bool feasible = true;
  KeepMask keep;
  int64_t kept_bytes = 0;
  double replay_cost_ns = 0;
};

struct HeuristicOptions {
  /// Rounds of local search after the greedy constructions (0: greedy only).
  int32_t max_improve_rounds = 50;
  /// Size of the neighbourhoods solved exactly by the final large-neighbourhood search (0: off); the search
  /// costs up to a few branch-and-bound runs on this many candidates.
  int32_t neighbourhood = 16;
};

struct ExactOptions {
  /// Largest number of decided candidates (candidates that are neither forced nor trivially dropped) accepted;
  /// the search is exponential in it. Throws tapesac::Error (kConfig) above.
  int32_t max_candidates = 30;
};

/// Fast near-optimal selection: minimal replay cost with kept_bytes <= budget_bytes. Throws tapesac::Error
/// (kConfig) on an invalid problem.
Selection select_heuristic(const BlockProblem& problem, int64_t budget_bytes, const HeuristicOptions& options = {});

/// Optimal selection (among masks of equal cost, not necessarily the one with fewest bytes). Throws
/// tapesac::Error (kConfig) on an invalid problem
/// or one with more than options.max_candidates decided candidates.
Selection select_exact(const BlockProblem& problem, int64_t budget_bytes, const ExactOptions& options = {});

}  // namespace tapesac::planner
