// Keep-set selection for one block (select.h): the public entry points. The solvers work on the compiled set form
// (compiled.h): the greedy constructions and local search in select_greedy.cpp, the min-cut (Lagrangian) hull in
// select_hull.cpp, branch and bound and the exact neighbourhoods in select_exact.cpp.
#include "tapesac/planner/select.h"

#include <algorithm>
#include <vector>

#include "compiled.h"
#include "tapesac/common/errors.h"
#include "tapesac/planner/evaluate.h"

namespace tapesac::planner {
namespace {

Selection to_selection(const BlockProblem& problem, const detail::Compiled& m, const detail::ItemSolution& sol,
                       bool feasible) {
  Selection out;
  out.feasible = feasible;
  out.keep = m.mask(sol.kept);
  out.kept_bytes = kept_bytes(problem, out.keep);
  out.replay_cost_ns = replay_cost_ns(problem, out.keep);
  return out;
}

}  // namespace

Selection select_heuristic(const BlockProblem& problem, int64_t budget_bytes, const HeuristicOptions& options) {
  validate_problem(problem);
  const detail::Compiled m = detail::compile(problem);
  if (budget_bytes < m.base_bytes) {
    return to_selection(problem, m, detail::ItemSolution{std::vector<uint8_t>(static_cast<size_t>(m.n_items()), 0)},
                        false);
  }
  return to_selection(problem, m, detail::heuristic_solve(m, budget_bytes - m.base_bytes, options),
                      true);
}

Selection select_exact(const BlockProblem& problem, int64_t budget_bytes, const ExactOptions& options) {
  validate_problem(problem);
  const detail::Compiled m = detail::compile(problem);
  const int32_t limit = std::min<int32_t>(options.max_candidates, 64);
  TAPESAC_CHECK(m.n_items() <= limit, kConfig, "select_exact: '", problem.signature, "' has ", m.n_items(),
                " candidates to decide, the exact solver accepts at most ", limit,
                " (ExactOptions::max_candidates, <= 64); use select_heuristic");
  if (budget_bytes < m.base_bytes) {
    return to_selection(problem, m, detail::ItemSolution{std::vector<uint8_t>(static_cast<size_t>(m.n_items()), 0)},
                        false);
  }
  const int64_t budget = budget_bytes - m.base_bytes;
  HeuristicOptions quick;
  quick.max_improve_rounds = 0;
  quick.neighbourhood = 0;
  const detail::ItemSolution start = detail::heuristic_solve(m, budget, quick);
  return to_selection(problem, m, detail::exact_solve(m, budget, start), true);
}

}  // namespace tapesac::planner
