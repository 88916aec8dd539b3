// Tests of the block frontier (frontier.h): shape (monotone, endpoints), and equality with the brute-force Pareto
// set on small random tapes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include <gtest/gtest.h>

#include "planner_test_util.h"
#include "tapesac/planner/evaluate.h"
#include "tapesac/planner/frontier.h"

namespace tapesac::planner {
namespace {

void expect_well_formed(const BlockProblem& p, const BlockFrontier& f) {
  ASSERT_FALSE(f.points.empty());
  EXPECT_EQ(f.signature, p.signature);
  EXPECT_EQ(f.points.back().keep, keep_all(p));
  EXPECT_EQ(f.points.back().replay_cost_ns, 0);
  // The first point keeps the forced candidates (and possibly zero-byte ones) and nothing that costs bytes.
  EXPECT_EQ(f.points.front().kept_bytes, kept_bytes(p, forced_keep(p)));
  for (size_t k = 0; k < f.points.size(); ++k) {
    const FrontierPoint& pt = f.points[k];
    EXPECT_EQ(pt.kept_bytes, kept_bytes(p, pt.keep));
    EXPECT_EQ(pt.replay_cost_ns, replay_cost_ns(p, pt.keep));
    EXPECT_EQ(pt.working_set_bytes, replay_working_set_bytes(p, pt.keep));
    if (k == 0) continue;
    EXPECT_GT(pt.kept_bytes, f.points[k - 1].kept_bytes) << k;
    if (k + 1 < f.points.size()) {
      EXPECT_LT(pt.replay_cost_ns, f.points[k - 1].replay_cost_ns) << k;
    } else {
      EXPECT_LE(pt.replay_cost_ns, f.points[k - 1].replay_cost_ns) << k;
    }
  }
}

// The Pareto set by enumeration: for each kept-bytes value, the least cost; then strictly decreasing costs.
std::vector<std::pair<int64_t, double>> brute_pareto(const BlockProblem& p) {
  std::map<int64_t, double> best;
  testing::for_each_mask(p, [&](const KeepMask& keep) {
    const int64_t b = kept_bytes(p, keep);
    const double c = replay_cost_ns(p, keep);
    auto it = best.find(b);
    if (it == best.end() || c < it->second) best[b] = c;
  });
  std::vector<std::pair<int64_t, double>> out;
  for (const auto& [b, c] : best) {
    if (out.empty() || c < out.back().second - 1e-9 * std::max(1.0, c)) out.emplace_back(b, c);
  }
  return out;
}

TEST(PlanFrontier, ExactFrontierIsTheParetoSet) {
  for (uint64_t seed = 0; seed < 60; ++seed) {
    testing::RandomOptions o;
    o.n_ops = 30;
    o.n_candidates = 10;
    const BlockProblem p = testing::random_problem(300 + seed, o);
    const BlockFrontier f = block_frontier(p);
    ASSERT_TRUE(f.exact);
    expect_well_formed(p, f);
    const auto ref = brute_pareto(p);
    // Ignoring the keep-all point appended after a tie, the frontier is exactly the Pareto set.
    std::vector<std::pair<int64_t, double>> got;
    for (const FrontierPoint& pt : f.points) {
      if (got.empty() || pt.replay_cost_ns < got.back().second) got.emplace_back(pt.kept_bytes, pt.replay_cost_ns);
    }
    ASSERT_EQ(got.size(), ref.size()) << "seed " << seed;
    for (size_t k = 0; k < ref.size(); ++k) {
      EXPECT_EQ(got[k].first, ref[k].first) << "seed " << seed << " point " << k;
      EXPECT_NEAR(got[k].second, ref[k].second, 1e-9 * std::max(1.0, ref[k].second));
    }
  }
}

TEST(PlanFrontier, HeuristicFrontierIsWellFormedAndHasTheExactHull) {
  double worst = 0;
  for (uint64_t seed = 0; seed < 30; ++seed) {
    testing::RandomOptions o;
    o.n_ops = 60;
    o.n_candidates = 20;
    // No storage sharing: the min-cut hull is then exact (it prices each candidate's bytes on its own).
    o.p_view = 0;
    o.p_inplace = 0;
    const BlockProblem p = testing::random_problem(700 + seed, o);
    FrontierOptions heuristic;
    heuristic.exact_max_candidates = 0;
    const BlockFrontier h = block_frontier(p, heuristic);
    EXPECT_FALSE(h.exact);
    expect_well_formed(p, h);
    FrontierOptions exact;
    exact.exact_max_candidates = 64;
    const BlockFrontier e = block_frontier(p, exact);
    expect_well_formed(p, e);
    // At every exact point's bytes, the heuristic frontier's best cost within those bytes, relative to the
    // cost of replaying everything (relative to the point's own cost, gaps near zero cost would dominate).
    const double full = e.points.front().replay_cost_ns;
    for (const FrontierPoint& pt : e.points) {
      double h_cost = full;
      for (const FrontierPoint& q : h.points) {
        if (q.kept_bytes <= pt.kept_bytes) h_cost = q.replay_cost_ns;
      }
      EXPECT_GE(h_cost, pt.replay_cost_ns - 1e-9 * full);
      worst = std::max(worst, full > 0 ? (h_cost - pt.replay_cost_ns) / full : 0);
    }
    // Its lower convex hull (what the step planner's LP uses) matches the exact one: every exact hull vertex
    // is a heuristic point (tolerance: float sums in a different order).
    std::vector<const FrontierPoint*> hull;
    for (const FrontierPoint& c : e.points) {
      while (hull.size() >= 2) {
        const FrontierPoint& a = *hull[hull.size() - 2];
        const FrontierPoint& b = *hull.back();
        const double cross = static_cast<double>(b.kept_bytes - a.kept_bytes) * (c.replay_cost_ns - a.replay_cost_ns) -
                             (b.replay_cost_ns - a.replay_cost_ns) * static_cast<double>(c.kept_bytes - a.kept_bytes);
        if (cross > 0) break;
        hull.pop_back();
      }
      hull.push_back(&c);
    }
    for (const FrontierPoint* b : hull) {
      const bool found = std::any_of(h.points.begin(), h.points.end(), [&](const FrontierPoint& q) {
        return q.kept_bytes <= b->kept_bytes && q.replay_cost_ns <= b->replay_cost_ns + 1e-9 * full;
      });
      EXPECT_TRUE(found) << "seed " << seed << ": exact hull vertex (" << b->kept_bytes << ", " << b->replay_cost_ns
                         << ") missing";
    }
  }
  // Informational: between hull vertices the heuristic frontier samples a few budgets only, so at an exact
  // point's bytes it may offer only a point with fewer bytes (and more cost).
  std::printf("[ heuristic frontier ] worst gap at exact frontier points: %.3f%% of the full replay cost\n",
              100 * worst);
}

TEST(PlanFrontier, ForcedOnlyProblemHasOnePoint) {
  testing::ProblemBuilder b;
  const int32_t x = b.ext();
  b.save(b.op("a", 5, {x}), /*must_keep=*/true);
  const BlockFrontier f = block_frontier(b.problem);
  ASSERT_EQ(f.points.size(), 1u);
  EXPECT_EQ(f.points[0].keep, (KeepMask{1}));
}

TEST(PlanFrontier, TransformerBlockFrontierTime) {
  const BlockProblem p = testing::transformer_block(1);
  const auto t0 = std::chrono::steady_clock::now();
  const BlockFrontier f = block_frontier(p);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ transformer block ] %zu ops, %zu candidates: frontier of %zu points in %.1f ms\n", p.ops.size(),
              p.candidates.size(), f.points.size(), 1e3 * s);
  expect_well_formed(p, f);
  EXPECT_LT(s, 2.0);
}

}  // namespace
}  // namespace tapesac::planner
