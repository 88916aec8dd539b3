// Tests of the cost and memory evaluation of keep masks (evaluate.h) on hand-made tapes with known answers.
#include <vector>

#include <gtest/gtest.h>

#include "planner_test_util.h"
#include "tapesac/common/errors.h"
#include "tapesac/planner/evaluate.h"

namespace tapesac::planner {
namespace {

using testing::kMiB;
using testing::ProblemBuilder;
using Ops = std::vector<int32_t>;

TEST(PlanEvaluate, SharedProducerIsReplayedOnceAndUntilBothAreKept) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const int32_t t = b.op("expensive", 100, {x});  // not saved: freed after the forward
  b.save(b.op("f", 1, {t}));
  b.save(b.op("g", 2, {t}));
  const BlockProblem& p = b.problem;
  EXPECT_EQ(replay_ops(p, {0, 0}), (Ops{0, 1, 2}));
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 0}), 103);  // expensive counted once
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {1, 0}), 102);  // keeping one alone saves only its own op
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 1}), 101);
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {1, 1}), 0);
  EXPECT_TRUE(replay_ops(p, {1, 1}).empty());
}

TEST(PlanEvaluate, ChainStopsAtKeptCandidates) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const int32_t c1 = b.op("op1", 10, {x});
  const int32_t c2 = b.op("op2", 20, {c1});
  b.op("op3", 30, {c2});
  for (int32_t v : {1, 2, 3}) b.save(v);
  const BlockProblem& p = b.problem;
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 0, 0}), 60);
  EXPECT_EQ(replay_ops(p, {1, 0, 0}), (Ops{1, 2}));
  EXPECT_EQ(replay_ops(p, {0, 1, 0}), (Ops{0, 2}));  // c3 is rebuilt from the kept c2
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {1, 1, 0}), 30);
}

TEST(PlanEvaluate, NonCandidateIntermediatesAreRecomputed) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const int32_t t1 = b.op("op1", 10, {x});
  const int32_t t2 = b.op("op2", 20, {t1});
  b.save(b.op("op3", 30, {t2}));
  EXPECT_DOUBLE_EQ(replay_cost_ns(b.problem, {0}), 60);
  EXPECT_EQ(replay_ops(b.problem, {0}), (Ops{0, 1, 2}));
}

TEST(PlanEvaluate, Diamond) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const int32_t a = b.op("a", 10, {x});
  const int32_t l = b.op("left", 20, {a});
  const int32_t r = b.op("right", 30, {a});
  const int32_t d = b.op("join", 40, {l, r});
  b.save(a);
  b.save(d);
  const BlockProblem& p = b.problem;
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {1, 0}), 90);
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 0}), 100);
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 1}), 10);
}

TEST(PlanEvaluate, MultiOutputOpServesBothOutputs) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const std::vector<int32_t> o = b.multi("sdpa", 50, {x}, {4 * kMiB, 4096});
  b.save(o[0]);
  b.save(o[1]);
  const BlockProblem& p = b.problem;
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 0}), 50);
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {1, 0}), 50);
  EXPECT_EQ(kept_bytes(p, {1, 1}), 4 * kMiB + 4096);
  // Rebuilding the small output runs the op, which allocates a fresh copy of the kept big one, freed at once.
  EXPECT_EQ(replay_working_set_bytes(p, {1, 0}), 4 * kMiB + 4096);
  EXPECT_EQ(replay_working_set_bytes(p, {0, 0}), 4 * kMiB + 4096);
}

TEST(PlanEvaluate, InPlaceVersionsShareStorage) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const int32_t y = b.op("linear", 10, {x}, 2 * kMiB);
  const int32_t y2 = b.alias("relu_", 5, y);  // new SSA value, same storage
  b.save(y);
  b.save(y2);
  const BlockProblem& p = b.problem;
  EXPECT_EQ(kept_bytes(p, {1, 1}), 2 * kMiB);  // one storage
  EXPECT_EQ(kept_bytes(p, {1, 0}), 2 * kMiB);
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {1, 0}), 5);
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 1}), 10);
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {0, 0}), 15);
  EXPECT_EQ(replay_working_set_bytes(p, {0, 0}), 2 * kMiB);
  // Replaying relu_ on the kept y writes a storage that is resident already.
  EXPECT_EQ(replay_working_set_bytes(p, {1, 0}), 0);
}

TEST(PlanEvaluate, WorkingSetFreesIntermediatesButHoldsDroppedCandidates) {
  ProblemBuilder b;
  const int32_t x = b.ext(16 * kMiB);  // external: never counted
  const int32_t t1 = b.op("op1", 1, {x}, 1 * kMiB);
  const int32_t t2 = b.op("op2", 1, {t1}, 2 * kMiB);
  b.save(b.op("op3", 1, {t2}, 4 * kMiB));
  // op1: 1; op2: 1 + 2 (inputs live while outputs are allocated), then t1 freed; op3: 2 + 4.
  EXPECT_EQ(replay_working_set_bytes(b.problem, {0}), 6 * kMiB);
  EXPECT_EQ(replay_working_set_bytes(b.problem, {1}), 0);

  ProblemBuilder c;
  const int32_t y = c.ext();
  const int32_t c1 = c.op("op1", 1, {y}, 1 * kMiB);
  const int32_t c2 = c.op("op2", 1, {c1}, 2 * kMiB);
  c.op("op3", 1, {c2}, 4 * kMiB);
  for (int32_t v : {1, 2, 3}) c.save(v);
  EXPECT_EQ(replay_working_set_bytes(c.problem, {0, 0, 0}), 7 * kMiB);  // all three live to the end
  EXPECT_EQ(replay_working_set_bytes(c.problem, {1, 0, 0}), 6 * kMiB);
  EXPECT_EQ(replay_working_set_bytes(c.problem, {1, 1, 0}), 4 * kMiB);
}

TEST(PlanEvaluate, WorkingSetCountsUnusedOutputsWhileTheirOpRuns) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const std::vector<int32_t> o = b.multi("split_op", 1, {x}, {4 * kMiB, 1 * kMiB});
  b.save(b.op("consumer", 1, {o[1]}, 2 * kMiB));
  // split_op: 4 + 1 (the 4 MiB output is freed right after); consumer: 1 + 2.
  EXPECT_EQ(replay_working_set_bytes(b.problem, {0}), 5 * kMiB);
}

TEST(PlanEvaluate, KeptBytesSkipExternalStorages) {
  ProblemBuilder b;
  const int32_t w = b.ext(8 * kMiB, /*storage=*/100);
  const int32_t wt = b.alias("t", 0, w);  // a view of a parameter
  const int32_t y = b.op("mm", 5, {wt}, 2 * kMiB);
  b.save(wt);
  b.save(y);
  EXPECT_EQ(kept_bytes(b.problem, {1, 1}), 2 * kMiB);
  EXPECT_EQ(replay_working_set_bytes(b.problem, {0, 0}), 2 * kMiB);  // the view is resident
}

TEST(PlanEvaluate, ForcedKeepCoversMustKeepAndNonReplayableClosures) {
  ProblemBuilder b;
  const int32_t x = b.ext();
  const int32_t t = b.op("writes_buffer", 1, {x}, kMiB, /*replayable=*/false);
  const int32_t a = b.op("a", 1, {t});
  const int32_t c = b.op("c", 1, {a});
  const int32_t d = b.op("d", 1, {x});
  b.save(a);
  b.save(c);
  b.save(d, /*must_keep=*/true);
  const BlockProblem& p = b.problem;
  EXPECT_EQ(forced_keep(p), (KeepMask{1, 0, 1}));  // c only needs a, which is kept
  EXPECT_DOUBLE_EQ(replay_cost_ns(p, {1, 0, 1}), 1);
  try {
    replay_cost_ns(p, {0, 1, 1});
    ADD_FAILURE() << "dropping a needs the non-replayable op";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("not replayable"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kept_bytes(p, {1, 1, 0}), Error);  // must_keep dropped
}

}  // namespace
}  // namespace tapesac::planner
