// The Pareto frontier of one block (frontier.h).
#include "tapesac/planner/frontier.h"

#include <algorithm>

#include "compiled.h"
#include "tapesac/common/errors.h"
#include "tapesac/planner/evaluate.h"

namespace tapesac::planner {

BlockFrontier block_frontier(const BlockProblem& problem, const FrontierOptions& options) {
  validate_problem(problem);
  const detail::Compiled m = detail::compile(problem);
  const bool exact = m.n_items() <= std::min<int32_t>(options.exact_max_candidates, 64);

  const std::vector<detail::ItemSolution> chain = detail::drop_chain(m);
  const std::vector<detail::ItemSolution> hull = detail::lagrangian_hull(m);
  std::vector<detail::ItemSolution> found = chain;
  found.insert(found.end(), hull.begin(), hull.end());
  if (exact) {
    // Epsilon-constraint sweep: the best mask under B, then B := its bytes - 1. Finds every Pareto point.
    int64_t budget = chain.front().bytes;  // everything kept
    for (int32_t solve = 0; solve < options.max_solves && budget >= 0; ++solve) {
      const HeuristicOptions quick{0, 0};  // only an incumbent for the exact solver
      const detail::ItemSolution start = detail::heuristic_solve(m, budget, quick, &chain, &hull);
      detail::ItemSolution sol = detail::exact_solve(m, budget, start);
      budget = sol.bytes - 1;
      found.push_back(std::move(sol));
    }
  } else {
    // The hull vertices are optimal for their bytes; between two of them (a quarter, half, three quarters of the
    // way and just below the upper one), fill greedily from the lower one and trim greedily from the upper one.
    for (size_t k = 0; k + 1 < hull.size() && static_cast<int32_t>(found.size()) < options.max_solves; ++k) {
      const int64_t lo = hull[k].bytes, hi = hull[k + 1].bytes;
      for (int64_t budget : {lo + (hi - lo) / 4, lo + (hi - lo) / 2, lo + 3 * (hi - lo) / 4, hi - 1}) {
        if (budget <= lo) continue;
        // The exact-neighbourhood search only on the better of the two.
        detail::ItemSolution up = detail::fill_from(m, hull[k], budget, 0);
        detail::ItemSolution down = detail::trim_from(m, hull[k + 1], budget, 0);
        found.push_back(detail::improve_neighbourhood(m, budget, up.saved >= down.saved ? up : down,
                                                      options.fill_neighbourhood));
        found.push_back(std::move(up.saved >= down.saved ? down : up));
      }
    }
    // And a few full heuristic solves where the hull is sparsest.
    std::vector<std::pair<int64_t, size_t>> gaps;
    for (size_t k = 0; k + 1 < hull.size(); ++k) gaps.emplace_back(hull[k + 1].bytes - hull[k].bytes, k);
    std::sort(gaps.rbegin(), gaps.rend());
    for (size_t g = 0; g < gaps.size() && static_cast<int32_t>(g) < options.heuristic_solves; ++g) {
      const size_t k = gaps[g].second;
      found.push_back(detail::heuristic_solve(m, hull[k].bytes + gaps[g].first / 2, options.heuristic, &chain, &hull));
    }
  }

  // Pareto filter: ascending bytes, keep a point only when it saves strictly more than every smaller one.
  std::sort(found.begin(), found.end(), [](const detail::ItemSolution& a, const detail::ItemSolution& b) {
    return a.bytes != b.bytes ? a.bytes < b.bytes : a.saved > b.saved;
  });
  const double eps = 1e-9 * m.total_weight;
  BlockFrontier out;
  out.signature = problem.signature;
  out.exact = exact;
  double best_saved = -1;
  for (const detail::ItemSolution& sol : found) {
    if (!out.points.empty() && sol.saved <= best_saved + eps) continue;
    best_saved = sol.saved;
    FrontierPoint pt;
    pt.keep = m.mask(sol.kept);
    pt.kept_bytes = kept_bytes(problem, pt.keep);
    pt.replay_cost_ns = replay_cost_ns(problem, pt.keep);
    pt.working_set_bytes = replay_working_set_bytes(problem, pt.keep);
    TAPESAC_INTERNAL_ASSERT(pt.kept_bytes == m.base_bytes + sol.bytes, "frontier point of '", problem.signature,
                            "': kept bytes ", pt.kept_bytes, " != ", m.base_bytes, " + ", sol.bytes);
    out.points.push_back(std::move(pt));
  }
  const KeepMask all = keep_all(problem);
  if (out.points.back().keep != all) {
    FrontierPoint pt;
    pt.keep = all;
    pt.kept_bytes = kept_bytes(problem, all);
    pt.replay_cost_ns = replay_cost_ns(problem, all);
    pt.working_set_bytes = replay_working_set_bytes(problem, all);
    if (pt.kept_bytes == out.points.back().kept_bytes) {
      out.points.back() = std::move(pt);  // same bytes, at most the same cost (nothing replayed)
    } else {
      out.points.push_back(std::move(pt));
    }
  }
  return out;
}

}  // namespace tapesac::planner
