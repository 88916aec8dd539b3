// The Pareto frontier of one block: the keep masks for which no other mask keeps fewer bytes at no more replay
// cost. Blocks with an equal signature share one frontier (the step planner, step.h, picks one point per call).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tapesac/planner/problem.h"
#include "tapesac/planner/schedule.h"
#include "tapesac/planner/select.h"

namespace tapesac::planner {

struct FrontierPoint {
  int64_t kept_bytes = 0;         // kept_bytes(problem, keep)
  double replay_cost_ns = 0;      // replay_cost_ns(problem, keep)
  int64_t working_set_bytes = 0;  // replay_working_set_bytes(problem, keep)
  KeepMask keep;
  /// The replay schedules of this mask (schedule_choices(); empty: only the single replay, the figures above).
  std::vector<ScheduleChoice> schedules;
  /// In a frontier seen under a working-set cap (step.cpp): the original point and the schedule standing for it.
  int32_t origin = -1;
  int32_t schedule = -1;
};

struct BlockFrontier {
  std::string signature;
  /// Ascending kept_bytes (strictly), descending replay cost (strictly, except that the last point is always
  /// keep-everything, which ties with the one before it when ops of zero cost make keeping all of them free).
  /// First: the minimum-memory mask (forced_keep() plus the candidates that cost no bytes); last: keep everything.
  std::vector<FrontierPoint> points;
  /// true when the points were computed by the exact solver (the frontier is then exactly the Pareto set).
  bool exact = false;
};

struct FrontierOptions {
  /// Use the exact solver when the problem has at most this many candidates to decide (0: never).
  int32_t exact_max_candidates = 16;
  /// Exact mode: stop after this many solver calls (each adds at most one point). Heuristic mode: at most this
  /// many greedy fills between hull vertices.
  int32_t max_solves = 512;
  /// Heuristic mode: size of the exact neighbourhood searched after each fill between hull vertices.
  int32_t fill_neighbourhood = 10;
  /// Heuristic mode: full select_heuristic runs, in the widest gaps between hull vertices.
  int32_t heuristic_solves = 1;
  HeuristicOptions heuristic;
};

/// The frontier of `problem`. Exact mode (few candidates): an epsilon-constraint sweep with the exact solver (best
/// mask under budget B, then B := its bytes - 1), which yields the whole Pareto set. Heuristic mode: the vertices
/// of the frontier's concave hull, exactly, by parametric minimum cuts (the points the step planner's LP uses),
/// greedy fills between consecutive vertices, a few full heuristic solves in the widest gaps, and the greedy drop
/// chain; then the Pareto filter. Throws tapesac::Error (kConfig) on an invalid problem.
BlockFrontier block_frontier(const BlockProblem& problem, const FrontierOptions& options = {});

/// Adds the replay schedules of `unpack` (schedule_choices()) to at most `max_points` points of `frontier`, spread
/// evenly from its least-memory point (the last point, keeping everything, replays nothing and gets none).
void add_schedules(BlockFrontier& frontier, const BlockProblem& problem, const UnpackOrder& unpack,
                   int32_t max_points = 8, const ScheduleOptions& options = {});

}  // namespace tapesac::planner
