// Tests of step-level selection under one memory limit (step.h, peak_model.h): feasibility, infeasibility,
// keep-everything, optimality against enumeration on small instances, and the planning time of a 48-layer model.
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>

#include <gtest/gtest.h>

#include "planner_test_util.h"
#include "tapesac/planner/evaluate.h"
#include "tapesac/planner/step.h"

namespace tapesac::planner {
namespace {

using testing::kMiB;

TEST(PlanPeakModel, CalibrateReproducesTheMeasuredPeak) {
  const PeakModel m = PeakModel::calibrate(/*measured=*/1000, /*sum_kept=*/300, /*max_ws=*/50);
  EXPECT_EQ(m.baseline_bytes, 650);
  EXPECT_EQ(m.predict(300, 50), 1000);
  EXPECT_EQ(m.predict(100, 80), 830);
}

StepInput small_step(uint64_t seed, int n_calls) {
  testing::RandomOptions o;
  o.n_ops = 25;
  o.n_candidates = 8;
  // The frontiers copy what they need: the problems need not outlive build_step_input.
  const std::vector<BlockProblem> problems{testing::random_problem(seed, o), testing::random_problem(seed + 1, o)};
  std::vector<const BlockProblem*> calls;
  for (int j = 0; j < n_calls; ++j) calls.push_back(&problems[static_cast<size_t>(j % 2)]);
  return build_step_input(calls);
}

TEST(PlanStep, SharesFrontiersBySignature) {
  const StepInput in = small_step(40, 5);
  EXPECT_EQ(in.frontiers.size(), 2u);
  EXPECT_EQ(in.calls, (std::vector<int32_t>{0, 1, 0, 1, 0}));
  testing::RandomOptions o;
  BlockProblem a = testing::random_problem(1, o), b = testing::random_problem(2, o);
  b.signature = a.signature;
  EXPECT_THROW(build_step_input({&a, &b}), Error);
}

TEST(PlanStep, LimitAtKeepAllPeakKeepsEverything) {
  const StepInput in = small_step(50, 4);
  const PeakModel model{100 * kMiB};
  const StepPlan probe = plan_step(in, model, std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(probe.keeps_everything);
  const StepPlan plan = plan_step(in, model, probe.keep_all_peak_bytes);
  EXPECT_TRUE(plan.keeps_everything);
  EXPECT_EQ(plan.replay_cost_ns, 0);
  for (const CallPlan& c : plan.calls) {
    EXPECT_EQ(c.keep, in.frontiers[static_cast<size_t>(c.frontier)].points.back().keep);
  }
  EXPECT_EQ(plan.predicted_peak_bytes, probe.keep_all_peak_bytes);
  const StepPlan below = plan_step(in, model, probe.keep_all_peak_bytes - 1);
  EXPECT_FALSE(below.keeps_everything);
  EXPECT_LE(below.predicted_peak_bytes, probe.keep_all_peak_bytes - 1);
}

TEST(PlanStep, InfeasibleLimitNamesTheSmallestFeasible) {
  const StepInput in = small_step(60, 3);
  const PeakModel model{10 * kMiB};
  const StepPlan any = plan_step(in, model, std::numeric_limits<int64_t>::max());
  const int64_t smallest = any.min_feasible_peak_bytes;
  try {
    plan_step(in, model, smallest - 1);
    ADD_FAILURE() << "expected InfeasibleLimitError";
  } catch (const InfeasibleLimitError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kMemoryLimit);
    EXPECT_EQ(e.smallest_feasible_bytes(), smallest);
    EXPECT_EQ(e.limit_bytes(), smallest - 1);
    EXPECT_NE(std::string(e.what()).find("smallest feasible"), std::string::npos) << e.what();
  }
  const StepPlan tight = plan_step(in, model, smallest);
  EXPECT_EQ(tight.predicted_peak_bytes, smallest);
}

// Against enumeration of every combination of frontier points: the plan fits, never beats the optimum, and is
// within the gap that Note [Step knapsack] allows (at most one call's largest single-step cost difference).
TEST(PlanStep, NearOptimalAgainstEnumeration) {
  double worst_rel = 0;
  for (uint64_t seed = 0; seed < 30; ++seed) {
    const StepInput in = small_step(100 + 2 * seed, 4);
    const PeakModel model{50 * kMiB};
    const StepPlan all = plan_step(in, model, std::numeric_limits<int64_t>::max());
    for (int k = 0; k <= 8; ++k) {
      const int64_t span = all.keep_all_peak_bytes - all.min_feasible_peak_bytes;
      const int64_t limit = all.min_feasible_peak_bytes + span * k / 8;
      double best = std::numeric_limits<double>::infinity();
      std::vector<int32_t> pick(in.calls.size(), 0);
      std::function<void(size_t, int64_t, int64_t, double)> rec = [&](size_t j, int64_t kept, int64_t ws, double cost) {
        if (j == in.calls.size()) {
          if (model.predict(kept, ws) <= limit) best = std::min(best, cost);
          return;
        }
        for (const FrontierPoint& pt : in.frontiers[static_cast<size_t>(in.calls[j])].points) {
          rec(j + 1, kept + pt.kept_bytes, std::max(ws, pt.working_set_bytes), cost + pt.replay_cost_ns);
        }
      };
      rec(0, 0, 0, 0);
      const StepPlan plan = plan_step(in, model, limit);
      EXPECT_LE(plan.predicted_peak_bytes, limit);
      EXPECT_GE(plan.replay_cost_ns, best - 1e-6);
      EXPECT_LE(plan.replay_cost_lower_bound_ns, best + 1e-6);
      double max_point_cost = 0;
      for (const BlockFrontier& f : in.frontiers) {
        max_point_cost = std::max(max_point_cost, f.points.front().replay_cost_ns);
      }
      EXPECT_LE(plan.replay_cost_ns - best, max_point_cost + 1e-6);
      const double full = all.calls.size() * max_point_cost;
      worst_rel = std::max(worst_rel, (plan.replay_cost_ns - best) / std::max(1.0, full));
    }
  }
  std::printf("[ step plan vs enumeration ] worst excess %.3f%% of the full replay cost (4 calls)\n", 100 * worst_rel);
}

TEST(PlanStep, FortyEightLayerPlanningTime) {
  const BlockProblem block = testing::transformer_block(3);
  const std::vector<const BlockProblem*> calls(48, &block);
  const auto t0 = std::chrono::steady_clock::now();
  const StepInput in = build_step_input(calls);
  const auto t1 = std::chrono::steady_clock::now();
  const PeakModel model{20 * 1024 * kMiB};
  const StepPlan bounds = plan_step(in, model, std::numeric_limits<int64_t>::max());
  const int64_t limit = (bounds.min_feasible_peak_bytes + bounds.keep_all_peak_bytes) / 2;
  const auto t2 = std::chrono::steady_clock::now();
  const StepPlan plan = plan_step(in, model, limit);
  const auto t3 = std::chrono::steady_clock::now();
  const double frontier_ms = 1e3 * std::chrono::duration<double>(t1 - t0).count();
  const double step_ms = 1e3 * std::chrono::duration<double>(t3 - t2).count();
  const double full = 48 * in.frontiers[0].points.front().replay_cost_ns;  // everything dropped in every call
  std::printf("[ 48 layers ] %zu ops, %zu candidates per block, frontier %zu points: frontier %.1f ms + plan_step "
              "%.1f ms = %.1f ms; at the halfway limit replay cost %.1f%% of full checkpointing's, LP bound gap "
              "%.3f%%\n",
              block.ops.size(), block.candidates.size(), in.frontiers[0].points.size(), frontier_ms, step_ms,
              frontier_ms + step_ms, 100 * plan.replay_cost_ns / full,
              100 * (plan.replay_cost_ns - plan.replay_cost_lower_bound_ns) / std::max(1.0, plan.replay_cost_ns));
  EXPECT_LE(plan.predicted_peak_bytes, limit);
  EXPECT_EQ(plan.calls.size(), 48u);
  EXPECT_LT(frontier_ms + step_ms, 2000);
}

}  // namespace
}  // namespace tapesac::planner
