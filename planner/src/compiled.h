// Internal to tapesac::planner: a BlockProblem compiled into the set form the solvers work on (Note [Replay closure]
// in problem.h). Items are the candidates the solvers decide (free candidates); every other candidate is kept in
// every solution (`base_keep`). An element is a group of ops with the same set of items whose drop needs them,
// with the summed cost: the replay cost of a mask is the weight of the elements with at least one dropped item.
#pragma once

#include <cstdint>
#include <vector>

#include "tapesac/planner/problem.h"
#include "tapesac/planner/select.h"

namespace tapesac::planner::detail {

/// Dense storage-group id per value: values sharing PlanValue::storage >= 0 share a group, every other value has
/// its own. `resident[g]` is 1 when the group holds an external value.
struct StorageGroups {
  std::vector<int32_t> of_value;
  std::vector<uint8_t> external;
  int32_t count = 0;
};
StorageGroups storage_groups(const BlockProblem& problem);

/// Per storage group: its first value, whose op creates the storage (later values of the group alias it).
std::vector<int32_t> group_creators(const StorageGroups& groups);

/// The replay memory walk (replay_working_set_bytes' rules; the schedule model's per-segment replays): peak bytes
/// allocated while the `needed` ops (per op) run in tape order. An op allocates its outputs while its inputs are
/// live; an output lives until its last read by a needed op, a `pinned` one (per value) to the end. Reads of
/// `resident` values (per value) are served by a resident copy and keep no replayed copy alive. A storage group's
/// allocation is its largest live member; an output aliasing a storage no replayed value holds (a resident one) adds
/// nothing. `creators` is group_creators(groups).
int64_t replay_walk_peak(const BlockProblem& problem, const StorageGroups& groups, const std::vector<int32_t>& creators,
                         const std::vector<uint8_t>& needed, const std::vector<uint8_t>& resident,
                         const std::vector<uint8_t>& pinned);

/// Per candidate, the ops of M(c) (ascending) — see Note [Replay closure].
std::vector<std::vector<int32_t>> min_closures(const BlockProblem& problem);

struct Compiled {
  int32_t n_candidates = 0;
  /// Candidates kept in every solution: forced_keep() plus those that cost no extra bytes. Candidates whose drop
  /// replays nothing of positive cost are neither base nor items: every solution drops them.
  KeepMask base_keep;
  /// Bytes of base_keep (kept_bytes).
  int64_t base_bytes = 0;

  /// Items: the candidates the solvers decide.
  std::vector<int32_t> item_candidate;
  std::vector<int64_t> item_bytes;
  std::vector<int32_t> item_group;  // dense index into group_* below
  std::vector<std::vector<int32_t>> item_elements;

  /// Storage groups of items: bytes already held by base members (max), and the items of each.
  std::vector<int64_t> group_base;
  std::vector<std::vector<int32_t>> group_items;

  std::vector<double> element_weight;
  std::vector<std::vector<int32_t>> element_items;
  /// Replay cost with every item dropped (sum of element weights).
  double total_weight = 0;

  int32_t n_items() const { return static_cast<int32_t>(item_candidate.size()); }
  int32_t n_elements() const { return static_cast<int32_t>(element_weight.size()); }
  /// The full keep mask of the items in `kept_items` (size n_items) on top of base_keep.
  KeepMask mask(const std::vector<uint8_t>& kept_items) const;
};

/// Compiles `problem` (assumed valid).
Compiled compile(const BlockProblem& problem);

/// A choice of kept items: `bytes` beyond base_bytes, `saved` = total_weight - replay cost.
struct ItemSolution {
  std::vector<uint8_t> kept;
  int64_t bytes = 0;
  double saved = 0;
};

/// Heuristic best solution with bytes <= budget (budget beyond base_bytes, >= 0); `chain` / `hull`: drop_chain(m)
/// / lagrangian_hull(m) when the caller has them. select_greedy.cpp.
ItemSolution heuristic_solve(const Compiled& m, int64_t budget, const HeuristicOptions& options,
                             const std::vector<ItemSolution>* chain = nullptr,
                             const std::vector<ItemSolution>* hull = nullptr);
/// The vertices of the concave hull of the (bytes, saved) frontier, by minimum cuts (Note [Lagrangian points] in
/// select_hull.cpp), ascending bytes; exact unless items share storage. select_hull.cpp.
std::vector<ItemSolution> lagrangian_hull(const Compiled& m);
/// `start` improved by the exact-neighbourhood search with `size` items (Note [Exact neighbourhoods]).
/// select_exact.cpp.
ItemSolution improve_neighbourhood(const Compiled& m, int64_t budget, const ItemSolution& start, int32_t size);
/// `start` plus the greedy fill (gain per byte) up to `budget`, then the exact-neighbourhood search with
/// `neighbourhood` items (0: none). select_greedy.cpp.
ItemSolution fill_from(const Compiled& m, const ItemSolution& start, int64_t budget, int32_t neighbourhood);
/// `start` less the items that lose least per freed byte until it fits `budget`, then the greedy fill and the
/// exact-neighbourhood search. select_greedy.cpp.
ItemSolution trim_from(const Compiled& m, const ItemSolution& start, int64_t budget, int32_t neighbourhood);
/// Every state of the greedy drop chain, from all items kept to none kept. select_greedy.cpp.
std::vector<ItemSolution> drop_chain(const Compiled& m);
/// Optimal solution with bytes <= budget (>= 0); requires n_items() <= 64 (Note [Branch and bound]).
/// select_exact.cpp.
ItemSolution exact_solve(const Compiled& m, int64_t budget, const ItemSolution& incumbent);

}  // namespace tapesac::planner::detail
