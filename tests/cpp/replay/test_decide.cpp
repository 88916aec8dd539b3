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


// Note [Decisions reused]: the key is equal exactly when every input decide_keep() reads is.
TEST(Decide, TheDecisionKeyIsEqualOnlyForEqualInputs) {
  auto key = [](const DecisionInput& in) {
    std::vector<int64_t> k;
    decision_key(in, k);
    return k;
  };
  Chain a, b;
  const DecisionInput base = a.input(PolicyKind::kFull);
  EXPECT_EQ(key(base), key(b.input(PolicyKind::kFull)));  // two tapes built alike
  EXPECT_EQ(decide_keep(base).keep, decide_keep(b.input(PolicyKind::kFull)).keep);

  std::vector<std::vector<int64_t>> different;
  DecisionInput in = base;
  in.policy = PolicyKind::kNone;
  different.push_back(key(in));
  in = base;
  in.saved.pop_back();  // one saved value fewer
  different.push_back(key(in));
  in = base;
  std::swap(in.saved[1], in.saved[2]);  // saved in another order (the drop targets follow it)
  different.push_back(key(in));
  in = base;
  in.saved[1].state += 1;
  different.push_back(key(in));
  in = base;
  in.capture_failed = true;
  different.push_back(key(in));
  in = base;
  in.observed = true;
  different.push_back(key(in));
  in = base;
  in.kept_externals.assign(a.b.tape.values().size(), 0);
  in.kept_externals[static_cast<size_t>(a.w)] = 1;
  different.push_back(key(in));
  BlockPlan plan;
  plan.signature = 7;
  plan.keep = {1, 0, 0};
  in = base;
  in.policy = PolicyKind::kPlan;
  in.plan = &plan;
  different.push_back(key(in));
  BlockPlan other_mask = plan;
  other_mask.keep = {0, 1, 0};
  in.plan = &other_mask;
  different.push_back(key(in));
  // The same ops over an input of another size, another layout, or with one op flagged non-replayable.
  for (int variant = 0; variant < 3; ++variant) {
    TapeBuilder t;
    capture::TensorMeta m = meta_of_bytes(variant == 0 ? 2 * kBytes : kBytes);
    if (variant == 1) {
      m.sizes = {4, 4};
      m.strides = {1, 4};  // the same bytes, transposed
    }
    const ValueId x = t.tape.add_external_value(t.tape.add_storage(/*external=*/true, m.nbytes), m);
    const ValueId w = t.ext();
    const ValueId mm = t.op("aten::mm", {x, w});
    const ValueId relu = t.op("aten::relu", {mm}, variant == 2 ? kNonReplayable : 0u);
    const ValueId tanh = t.op("aten::tanh", {relu});
    DecisionInput o;
    o.tape = &t.tape;
    o.policy = PolicyKind::kFull;
    for (ValueId v : {x, mm, relu, tanh}) o.saved.push_back(saved(t.now(v)));
    different.push_back(key(o));
  }
  for (size_t i = 0; i < different.size(); ++i) {
    EXPECT_NE(different[i], key(base)) << "variant " << i;
    for (size_t j = 0; j < i; ++j) EXPECT_NE(different[i], different[j]) << "variants " << j << " and " << i;
  }
}

// Note [Written after its save]: t = x * 2; u = t * w saves t; t.data.add_(1) writes t's storage (no version move).
// A backward without tapesac reads the written bytes; a replay would rebuild those at the save. Kept, every policy.
TEST(Decide, ASavedValueTheBlockWritesAfterTheSaveIsKept) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId w = b.ext();
  const ValueId t = b.op("aten::mul", {x});
  const Read t_at_save = b.now(t);
  const ValueId u = b.op("aten::mul", {t, w});
  const ValueId after = b.inplace("aten::add_", t, {});
  const ValueId v = b.op("aten::tanh", {u});
  DecisionInput in;
  in.tape = &b.tape;
  in.saved = {saved(t_at_save), saved(b.now(v))};
  for (PolicyKind policy : {PolicyKind::kFull, PolicyKind::kSaveOps, PolicyKind::kPlan}) {
    in.policy = policy;
    const KeepDecision d = decide_keep(in);
    EXPECT_EQ(d.must_keep, (std::vector<uint8_t>{1, 0})) << static_cast<int>(policy);
    EXPECT_EQ(d.keep[static_cast<size_t>(t)], 1);
    if (policy == PolicyKind::kFull) EXPECT_EQ(d.keep[static_cast<size_t>(v)], 0);  // the rest is dropped as before
  }
  // The value after the write, saved at the storage's last state, is rebuilt like any other.
  in.policy = PolicyKind::kFull;
  in.saved = {saved(b.now(after))};
  EXPECT_EQ(decide_keep(in).must_keep, (std::vector<uint8_t>{0}));
  // One value saved before the write and again after it (e = exp(h) saved by exp, e.data.mul_(0.5), then e * x saves
  // it at the later state): both saves are the one storage, kept (random program 265).
  in.saved = {saved(t_at_save), SavedValue{t, b.now(after).state}};
  EXPECT_EQ(decide_keep(in).must_keep, (std::vector<uint8_t>{1}));
}

}  // namespace
}  // namespace tapesac::replay
