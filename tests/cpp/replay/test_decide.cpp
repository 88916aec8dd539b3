// Tests of the keep/drop decision (replay/decide.h, Note [Keep or drop]) on hand-made tapes: the pure function
// BlockCall::close_forward() applies.
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

#include "tape_builder.h"
#include "tapesac/replay/decide.h"

namespace tapesac::replay {
namespace {

using capture::kNonReplayable;

/// x -> mm(x, w) -> relu -> tanh, saving the three op outputs; returns their ids.
struct Chain {
  TapeBuilder b;
  ValueId x, w, mm, relu, tanh;
  Chain() {
    x = b.ext();
    w = b.ext();
    mm = b.op("aten::mm", {x, w});
    relu = b.op("aten::relu", {mm});
    tanh = b.op("aten::tanh", {relu});
  }
  DecisionInput input(PolicyKind policy) const {
    DecisionInput in;
    in.tape = &b.tape;
    in.policy = policy;
    for (ValueId v : {x, mm, relu, tanh}) in.saved.push_back(SavedValue{b.now(v).value, b.now(v).state});
    return in;
  }
};

SavedValue saved(const Read& r) { return SavedValue{r.value, r.state}; }

TEST(Decide, FullDropsEveryDecidableValueAndKeepsExternals) {
  Chain c;
  DecisionInput in;
  in.tape = &c.b.tape;
  in.policy = PolicyKind::kFull;
  for (ValueId v : {c.x, c.mm, c.relu, c.tanh}) in.saved.push_back(saved(c.b.now(v)));
  const KeepDecision d = decide_keep(in);
  EXPECT_EQ(d.decidable, (std::vector<ValueId>{c.mm, c.relu, c.tanh}));
  EXPECT_EQ(d.keep[static_cast<size_t>(c.x)], 1);  // an external input is kept as it is
  EXPECT_EQ(d.keep[static_cast<size_t>(c.w)], -1);  // not saved: not decided
  for (ValueId v : {c.mm, c.relu, c.tanh}) EXPECT_EQ(d.keep[static_cast<size_t>(v)], 0);
  EXPECT_EQ(d.kept_mask(), (std::vector<uint8_t>{0, 0, 0}));
  EXPECT_EQ(d.available[static_cast<size_t>(c.x)], 1);
}

TEST(Decide, NoneKeepsEverythingAndSkipsTheRebuildChecksUnlessObserved) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId r = b.op("aten::dropout_like", {x}, kNonReplayable);
  DecisionInput in;
  in.tape = &b.tape;
  in.policy = PolicyKind::kNone;
  in.saved = {saved(b.now(r))};
  KeepDecision d = decide_keep(in);
  EXPECT_EQ(d.keep[static_cast<size_t>(r)], 1);
  EXPECT_EQ(d.must_keep, (std::vector<uint8_t>{0}));  // not computed: nobody reads it
  in.observed = true;
  d = decide_keep(in);
  EXPECT_EQ(d.must_keep, (std::vector<uint8_t>{1}));  // the planner sees that it cannot be dropped
}

TEST(Decide, ValuesThatCannotBeRebuiltAreKeptWhateverThePolicy) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId bad = b.op("aten::effectful", {x}, kNonReplayable);
  const ValueId after = b.op("aten::relu", {bad});
  DecisionInput in;
  in.tape = &b.tape;
  in.policy = PolicyKind::kFull;
  in.saved = {saved(b.now(bad)), saved(b.now(after))};
  const KeepDecision d = decide_keep(in);
  EXPECT_EQ(d.must_keep, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(d.keep[static_cast<size_t>(bad)], 1);
  EXPECT_EQ(d.keep[static_cast<size_t>(after)], 0);  // rebuilt from the kept value
}

TEST(Decide, OpSetKeepsOutputsOfTheNamedOpsAndAsksOncePerValue) {
  Chain c;
  DecisionInput in = c.input(PolicyKind::kSaveOps);
  const capture::OpKind mm = capture::intern_op_kind("aten::mm");
  int asked = 0;
  in.keep_op = [&](capture::OpKind k) {
    ++asked;
    return k == mm;
  };
  const KeepDecision d = decide_keep(in);
  EXPECT_EQ(d.keep[static_cast<size_t>(c.mm)], 1);
  EXPECT_EQ(d.keep[static_cast<size_t>(c.relu)], 0);
  EXPECT_EQ(d.keep[static_cast<size_t>(c.tanh)], 0);
  EXPECT_EQ(asked, 3);
  EXPECT_FALSE(d.policy_failed);
}

TEST(Decide, OpSetNamesTheOpThatWroteTheBytesNotTheView) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId w = b.ext();
  const ValueId mm = b.op("aten::mm", {x, w});
  const ValueId view = b.view("aten::_unsafe_view", mm);
  DecisionInput in;
  in.tape = &b.tape;
  in.policy = PolicyKind::kSaveOps;
  in.saved = {saved(b.now(view))};
  const capture::OpKind mm_kind = capture::intern_op_kind("aten::mm");
  in.keep_op = [&](capture::OpKind k) { return k == mm_kind; };
  const KeepDecision d = decide_keep(in);
  EXPECT_EQ(d.keep[static_cast<size_t>(view)], 1);
}

TEST(Decide, APolicyThatThrowsKeepsTheValueAndSaysWhy) {
  Chain c;
  DecisionInput in = c.input(PolicyKind::kSaveOps);
  in.keep_op = [](capture::OpKind) -> bool { throw std::runtime_error("boom from the policy"); };
  const KeepDecision d = decide_keep(in);
  EXPECT_TRUE(d.policy_failed);
  EXPECT_EQ(d.policy_error, "boom from the policy");
  for (ValueId v : {c.mm, c.relu, c.tanh}) EXPECT_EQ(d.keep[static_cast<size_t>(v)], 1);
}

TEST(Decide, APlanAppliesOnlyToTheTapeItWasMadeFor) {
  Chain c;
  DecisionInput in = c.input(PolicyKind::kPlan);
  const uint64_t sig = tape_signature(c.b.tape, {c.mm, c.relu, c.tanh});
  BlockPlan plan{sig, {1, 0, 1}, {}, 0};
  in.plan = &plan;
  KeepDecision d = decide_keep(in);
  EXPECT_TRUE(d.planned);
  EXPECT_EQ(d.signature, sig);
  EXPECT_EQ(d.kept_mask(), (std::vector<uint8_t>{1, 0, 1}));
  plan.signature = sig + 1;  // another tape: the call runs as "full"
  d = decide_keep(in);
  EXPECT_FALSE(d.planned);
  EXPECT_EQ(d.kept_mask(), (std::vector<uint8_t>{0, 0, 0}));
}

TEST(Decide, ADroppedValueTheKeptOnesCannotRebuildIsKeptAfterAll) {
  // relu's input is an in-place-written external read at an earlier state: dropping relu's output is fine only
  // when relu itself can run from live values, which it cannot here.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.op("aten::relu", {x});
  b.inplace("aten::add_", x, {});  // the external input changes after relu read it
  DecisionInput in;
  in.tape = &b.tape;
  in.policy = PolicyKind::kFull;
  in.saved = {saved(b.now(y))};
  const KeepDecision d = decide_keep(in);
  EXPECT_EQ(d.keep[static_cast<size_t>(y)], 1);
  EXPECT_EQ(d.must_keep, (std::vector<uint8_t>{1}));
}

TEST(Decide, ValuesReadingAStorageWhoseDependentsAreKeptAreKept) {
  Chain c;
  DecisionInput in = c.input(PolicyKind::kFull);
  in.kept_externals.assign(c.b.tape.values().size(), 0);
  in.kept_externals[static_cast<size_t>(c.w)] = 1;  // the preservation plan keeps w's dependents
  const KeepDecision d = decide_keep(in);
  for (ValueId v : {c.mm, c.relu, c.tanh}) EXPECT_EQ(d.keep[static_cast<size_t>(v)], 1) << "v" << v;
}

TEST(Decide, RecordingFailureKeepsEverySavedValue) {
  Chain c;
  DecisionInput in = c.input(PolicyKind::kFull);
  in.capture_failed = true;
  const KeepDecision d = decide_keep(in);
  EXPECT_TRUE(d.decidable.empty());
  for (ValueId v : {c.x, c.mm, c.relu, c.tanh}) EXPECT_EQ(d.keep[static_cast<size_t>(v)], 1);
}

TEST(Decide, TheSignatureFollowsStructureSizesAndCandidates) {
  Chain a, b;
  EXPECT_EQ(tape_signature(a.b.tape, {a.mm}), tape_signature(b.b.tape, {b.mm}));
  EXPECT_NE(tape_signature(a.b.tape, {a.mm}), tape_signature(a.b.tape, {a.relu}));
  TapeBuilder other;
  const ValueId x = other.ext(2 * kBytes);  // the same ops on a bigger input
  const ValueId w = other.ext();
  const ValueId mm = other.op("aten::mm", {x, w});
  other.op("aten::tanh", {other.op("aten::relu", {mm})});
  EXPECT_NE(tape_signature(a.b.tape, {a.mm}), tape_signature(other.tape, {mm}));
}

}  // namespace
}  // namespace tapesac::replay
