// The planner on real block tapes: problems dumped from tiny HF Qwen3 / Llama decoder layers and the Python suite's
// toy blocks (tests/cpp/planner/data/*.plan, written by make_fixtures.py through AutoPlanner.dump_problem). On
// every budget from the minimum-memory mask to keeping everything, the heuristic must be within 1% of the exact
// optimum whenever the exact solver can run (at most 25 decided candidates), and both must respect the budget.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/common/errors.h"
#include "tapesac/planner/evaluate.h"
#include "tapesac/planner/problem_io.h"
#include "tapesac/planner/select.h"

namespace tapesac::planner {
namespace {

std::vector<std::filesystem::path> fixtures() {
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(TAPESAC_TEST_DATA_DIR)) {
    if (e.path().extension() == ".plan") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(PlannerRealTapes, HeuristicWithinOnePercentOfExact) {
  const auto files = fixtures();
  ASSERT_GE(files.size(), 8u) << "fixtures missing in " << TAPESAC_TEST_DATA_DIR;
  int compared = 0;
  int large = 0;
  double worst = 0;
  for (const auto& path : files) {
    std::ifstream in(path);
    const BlockProblem p = read_problem(in);
    const KeepMask lo = forced_keep(p);
    const int64_t min_bytes = kept_bytes(p, lo);
    const int64_t max_bytes = kept_bytes(p, keep_all(p));
    for (int k = 0; k <= 10; ++k) {
      const int64_t budget = min_bytes + (max_bytes - min_bytes) * k / 10;
      const Selection h = select_heuristic(p, budget);
      ASSERT_TRUE(h.feasible) << path.filename();
      EXPECT_LE(h.kept_bytes, budget) << path.filename();
      EXPECT_DOUBLE_EQ(h.replay_cost_ns, replay_cost_ns(p, h.keep)) << path.filename();
      Selection e;
      try {
        e = select_exact(p, budget, ExactOptions{25});
      } catch (const tapesac::Error&) {
        ++large;  // more than 25 decided candidates: no exact reference for this problem
        break;
      }
      ASSERT_TRUE(e.feasible);
      EXPECT_LE(e.kept_bytes, budget);
      EXPECT_LE(e.replay_cost_ns, h.replay_cost_ns * (1 + 1e-9)) << path.filename() << " budget " << budget;
      const double gap = e.replay_cost_ns > 0 ? (h.replay_cost_ns - e.replay_cost_ns) / e.replay_cost_ns : 0;
      worst = std::max(worst, gap);
      EXPECT_LE(gap, 0.01) << path.filename() << " budget " << budget << ": heuristic " << h.replay_cost_ns
                           << " ns vs exact " << e.replay_cost_ns << " ns";
      ++compared;
    }
  }
  std::printf("real tapes: %zu problems, %d (problem, budget) pairs compared with the exact optimum, worst gap "
              "%.4f%%; %d problem(s) above 25 decided candidates\n",
              files.size(), compared, 100 * worst, large);
  EXPECT_GE(compared, 40);
}

}  // namespace
}  // namespace tapesac::planner
