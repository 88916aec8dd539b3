// The graph reserve (runtime/graph_reserve.h, Note [Graph reserve]) with a stand-in planner: feasible down to a
// given limit, keeping everything from another.
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/common/errors.h"
#include "tapesac/runtime/graph_reserve.h"

namespace tapesac::runtime {
namespace {

/// Plans that fit from `smallest` bytes and keep everything from `keep_all`; records the limits asked for.
struct FakePlanner {
  int64_t smallest = 0;
  int64_t keep_all = INT64_MAX;
  std::vector<int64_t> asked;

  PlanInfo operator()(int64_t limit) {
    asked.push_back(limit);
    if (limit < smallest) throw Error(ErrorKind::kMemoryLimit, "infeasible");
    PlanInfo p;
    p.limit = limit;
    p.predicted_peak_bytes = std::min(limit, keep_all);
    p.keeps_everything = limit >= keep_all;
    return p;
  }
};

ReservedPlan run(FakePlanner& f, int64_t budget, int64_t pending) {
  return plan_with_graph_reserve(budget, pending, [&](int64_t limit) { return f(limit); });
}

TEST(GraphReserve, WithoutPendingGraphsThePlanGetsTheBudgetAndCaptureIsLeftAlone) {
  FakePlanner f{100, 10'000, {}};
  const ReservedPlan r = run(f, 1000, 0);
  EXPECT_EQ(f.asked, (std::vector<int64_t>{1000}));
  EXPECT_EQ(r.plan.limit, 1000);
  EXPECT_EQ(r.reserve_bytes, 0);
  EXPECT_FALSE(r.capture.has_value());
}

TEST(GraphReserve, WithRoomThePlanLeavesTheGraphsTheirStaticMemory) {
  FakePlanner f{100, 10'000, {}};
  const ReservedPlan r = run(f, 1000, 300);
  EXPECT_EQ(f.asked, (std::vector<int64_t>{1000, 700}));
  EXPECT_EQ(r.plan.limit, 700);
  EXPECT_EQ(r.reserve_bytes, 300);
  EXPECT_EQ(r.capture, true);
}

TEST(GraphReserve, WithoutRoomThePlanGetsTheWholeBudgetAndNothingIsCaptured) {
  FakePlanner f{800, 10'000, {}};
  const ReservedPlan r = run(f, 1000, 300);  // 700 is infeasible
  EXPECT_EQ(f.asked, (std::vector<int64_t>{1000, 700}));
  EXPECT_EQ(r.plan.limit, 1000);
  EXPECT_EQ(r.reserve_bytes, 0);
  EXPECT_EQ(r.capture, false);
}

TEST(GraphReserve, APlanThatKeepsEverythingNeedsNoGraph) {
  FakePlanner f{100, 900, {}};
  const ReservedPlan r = run(f, 1000, 300);
  EXPECT_EQ(f.asked, (std::vector<int64_t>{1000}));  // not planned again with the reserve
  EXPECT_TRUE(r.plan.keeps_everything);
  EXPECT_EQ(r.reserve_bytes, 0);
  EXPECT_EQ(r.capture, false);
}

TEST(GraphReserve, AnInfeasibleBudgetAndOtherErrorsPropagate) {
  FakePlanner f{2000, 10'000, {}};
  try {
    run(f, 1000, 300);
    FAIL() << "expected the infeasible limit to propagate";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kMemoryLimit);
  }
  int calls = 0;
  auto broken = [&](int64_t) -> PlanInfo {
    if (++calls == 2) throw Error(ErrorKind::kConfig, "malformed");
    return PlanInfo{};
  };
  try {
    plan_with_graph_reserve(1000, 300, broken);
    FAIL() << "expected the planner's own error to propagate";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
  }
}

}  // namespace
}  // namespace tapesac::runtime
