// Tests of problem validation (problem.h) and the text form (problem_io.h).
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "planner_test_util.h"
#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tape.h"
#include "tapesac/common/errors.h"
#include "tapesac/planner/evaluate.h"
#include "tapesac/planner/from_tape.h"
#include "tapesac/planner/problem.h"
#include "tapesac/planner/problem_io.h"

namespace tapesac::planner {
namespace {

using testing::ProblemBuilder;

BlockProblem small_problem() {
  ProblemBuilder b("block.small");
  const int32_t x = b.ext();
  const int32_t y = b.op("mm", 100, {x});
  const int32_t z = b.alias("relu_", 3, y);
  b.save(y);
  b.save(z, /*must_keep=*/true);
  return b.problem;
}

// Expects validate_problem to throw a kConfig error whose message contains `needle`.
void expect_invalid(const BlockProblem& p, const std::string& needle) {
  try {
    validate_problem(p);
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A value on a storage the block did not create is read live by replay (Note [Live reads] in replay/prune.h), so
// the planner's rebuild stops there even when its producer cannot replay: a custom autograd Function's numpy output
// enters the tape through aten::lift_fresh over an external storage, and the candidate pow(y, 2) rebuilds with pow
// alone (before: "keep mask ... drops a candidate whose rebuild needs op #0 (aten::lift_fresh), which is not
// replayable", thrown by "full"'s planned schedules).
TEST(PlanProblem, AValueOnAnExternalStorageIsReadLiveWhateverItsProducer) {
  capture::Tape tape;
  capture::TensorMeta m;
  m.sizes = {16};
  m.strides = {1};
  m.dtype = 6;
  m.nbytes = 64;
  const capture::StorageId ext = tape.add_storage(/*external=*/true, 64);
  const capture::ValueId x = tape.add_external_value(ext, m);
  capture::OpRecord lift;
  lift.kind = capture::intern_op_kind("aten::lift_fresh");
  lift.flags = capture::kNonReplayable | capture::kView;
  lift.inputs.push_back(capture::ArgRef{0, -1, x, 0, /*meta_only=*/true, false});
  const capture::ValueId y = tape.add_output_value(ext, 0, m);
  lift.outputs.push_back(y);
  tape.add_op(std::move(lift));
  capture::OpRecord pow;
  pow.kind = capture::intern_op_kind("aten::pow.Tensor_Scalar");
  pow.inputs.push_back(capture::ArgRef{0, -1, y, 0, false, false});
  const capture::StorageId s = tape.add_storage(/*external=*/false, 64);
  pow.writes.push_back(s);
  const capture::ValueId z = tape.add_output_value(s, 1, m);
  pow.outputs.push_back(z);
  tape.add_op(std::move(pow));
  const BlockProblem p = problem_from_tape(tape, {z}, {0}, {1.0, 5.0}, "lift");
  EXPECT_NO_THROW(validate_problem(p));
  EXPECT_EQ(replay_ops(p, KeepMask{0}), (std::vector<int32_t>{1}));
  EXPECT_EQ(replay_cost_ns(p, KeepMask{0}), 5.0);
}

TEST(PlanProblem, ValidProblemPasses) { EXPECT_NO_THROW(validate_problem(small_problem())); }

TEST(PlanProblem, RejectsOutOfRangeIds) {
  BlockProblem p = small_problem();
  p.ops[0].inputs.push_back(99);
  expect_invalid(p, "reads value v99");
  p = small_problem();
  p.candidates.push_back(-3);
  p.must_keep.push_back(0);
  expect_invalid(p, "is value v-3");
  p = small_problem();
  p.values[0].producer = 7;
  expect_invalid(p, "has producer 7");
}

TEST(PlanProblem, RejectsReadOfALaterValue) {
  BlockProblem p = small_problem();
  p.ops[0].inputs.push_back(2);  // v2 is produced by op #1
  expect_invalid(p, "produced by op #1");
}

TEST(PlanProblem, RejectsDuplicateCandidatesAndBadMustKeep) {
  BlockProblem p = small_problem();
  p.candidates.push_back(p.candidates[0]);
  p.must_keep.push_back(0);
  expect_invalid(p, "listed twice");
  p = small_problem();
  p.must_keep.pop_back();
  expect_invalid(p, "must_keep has 1 entries");
}

TEST(PlanProblem, RejectsInconsistentProducersAndNonSsa) {
  BlockProblem p = small_problem();
  p.ops[1].outputs.push_back(1);  // v1 is op #0's output
  expect_invalid(p, "data flow must be SSA");
  p = small_problem();
  p.values.push_back(PlanValue{8, 0, kOwnStorage});  // claims op #0, not listed there
  expect_invalid(p, "does not list it as an output");
}

TEST(PlanProblem, RejectsNegativeSizesAndCosts) {
  BlockProblem p = small_problem();
  p.values[1].bytes = -1;
  expect_invalid(p, "bytes >= 0 expected");
  p = small_problem();
  p.ops[0].cost_ns = -5;
  expect_invalid(p, "cost_ns -5");
}

TEST(PlanProblem, MaskMustMatchAndKeepMustKeep) {
  const BlockProblem p = small_problem();
  EXPECT_THROW(validate_mask(p, KeepMask{1}), Error);
  EXPECT_THROW(validate_mask(p, KeepMask{1, 0}), Error);  // candidate 1 is must_keep
  EXPECT_NO_THROW(validate_mask(p, KeepMask{0, 1}));
}

void expect_same(const BlockProblem& a, const BlockProblem& b) {
  EXPECT_EQ(a.signature, b.signature);
  ASSERT_EQ(a.ops.size(), b.ops.size());
  for (size_t i = 0; i < a.ops.size(); ++i) {
    EXPECT_EQ(a.ops[i].cost_ns, b.ops[i].cost_ns) << i;  // bit-exact: 17 digits
    EXPECT_EQ(a.ops[i].inputs, b.ops[i].inputs);
    EXPECT_EQ(a.ops[i].outputs, b.ops[i].outputs);
    EXPECT_EQ(a.ops[i].replayable, b.ops[i].replayable);
    EXPECT_EQ(a.ops[i].name, b.ops[i].name);
  }
  ASSERT_EQ(a.values.size(), b.values.size());
  for (size_t v = 0; v < a.values.size(); ++v) {
    EXPECT_EQ(a.values[v].bytes, b.values[v].bytes);
    EXPECT_EQ(a.values[v].producer, b.values[v].producer);
    EXPECT_EQ(a.values[v].storage, b.values[v].storage);
  }
  EXPECT_EQ(a.candidates, b.candidates);
  EXPECT_EQ(a.must_keep, b.must_keep);
}

TEST(PlanProblemIo, RoundTripIsExact) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    testing::RandomOptions o;
    o.p_non_replayable = 0.1;
    BlockProblem p = testing::random_problem(seed, o);
    p.signature = "layers.* Qwen3DecoderLayer (bf16, 2x4096)";  // spaces survive
    p.ops[0].name.clear();                                      // written as '-'
    std::stringstream s;
    write_problem(s, p);
    const BlockProblem q = read_problem(s);
    expect_same(p, q);
  }
}

TEST(PlanProblemIo, ReadsCommentsAndBlankLines) {
  std::stringstream s;
  s << "# dumped by a test\n\ntapesac-plan-problem 1\nsignature b\nvalues 2\n64 -1 -1\n# the op's output\n64 0 -1\n"
       "ops 1\n2.5 1 relu 1 0 1 1\ncandidates 1\n1 0\nend\n";
  const BlockProblem p = read_problem(s);
  ASSERT_EQ(p.ops.size(), 1u);
  EXPECT_EQ(p.ops[0].name, "relu");
  EXPECT_EQ(p.ops[0].cost_ns, 2.5);
  EXPECT_EQ(p.candidates, std::vector<int32_t>{1});
}

TEST(PlanProblemIo, RejectsUnknownVersionAndBadLines) {
  auto expect_read_error = [](const std::string& text, const std::string& needle) {
    std::stringstream s(text);
    try {
      read_problem(s);
      ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_read_error("tapesac-plan-problem 2\n", "format version 2 is not supported");
  expect_read_error("hello\n", "expected the header");
  expect_read_error("tapesac-plan-problem 1\nsignature b\nvalues 1\n64 -1\n", "line 4: expected <storage>");
  expect_read_error("tapesac-plan-problem 1\nsignature b\nvalues 1\n64 -1 -1\nops 1\n1 1 a 1 5 0\ncandidates 0\nend\n",
                    "reads value v5");
  expect_read_error("tapesac-plan-problem 1\nsignature b\nvalues 0\nops 0\ncandidates 0\n", "found the end");
}

TEST(PlanProblemIo, WriteRejectsNamesWithWhitespace) {
  BlockProblem p = small_problem();
  p.ops[0].name = "two words";
  std::stringstream s;
  EXPECT_THROW(write_problem(s, p), Error);
}

}  // namespace
}  // namespace tapesac::planner
