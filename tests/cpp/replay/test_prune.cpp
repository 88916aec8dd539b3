// Tests of the pruning pass (replay/prune.h, Note [Live reads]) on hand-made tapes.
//
// The tapes are made with TapeBuilder (tape_builder.h), the way capture::Recorder fills them. Two randomized tests
// compare prune() against independent brute-force references.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/eager_replayer.h"
#include "tapesac/replay/prune.h"
#include "tape_builder.h"

namespace tapesac::replay {
namespace {

using capture::ArgRef;
using capture::kExternal;
using capture::kNonReplayable;
using capture::kRandom;
using capture::kView;
using capture::kWritesExternal;
using capture::OpRecord;
using capture::StorageId;
using capture::TensorMeta;
using Ops = std::vector<OpIndex>;

PruneResult prune_ok(const TapeBuilder& b, const std::vector<Read>& targets, const std::vector<uint8_t>& available) {
  PruneResult r = prune(b.tape, targets, available);
  EXPECT_TRUE(r.ok) << r.reason << "\n" << b.tape.to_string();
  return r;
}

// --- Basic closures ------------------------------------------------------------------------------------------------

TEST(Prune, EmptyTargetsGiveEmptyResult) {
  TapeBuilder b;
  const ValueId x = b.ext();
  b.op("aten::relu", {x});
  const PruneResult r = prune(b.tape, {}, b.keep({}));
  EXPECT_TRUE(r.ok);
  EXPECT_TRUE(r.ops.empty());
  EXPECT_EQ(r.blocking_op, -1);
  EXPECT_EQ(r.blocking_value, -1);
}

TEST(Prune, ChainIncludesOnlyProducersUpToTheTarget) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::relu", {x});    // op 0
  const ValueId c = b.op("aten::mul", {a, a});  // op 1
  const ValueId d = b.op("aten::exp", {c});     // op 2
  b.op("aten::sum", {d});                       // op 3
  EXPECT_EQ(prune_ok(b, {b.now(c)}, b.keep({})).ops, (Ops{0, 1}));
  EXPECT_EQ(prune_ok(b, {b.now(a)}, b.keep({})).ops, (Ops{0}));
  EXPECT_EQ(prune_ok(b, {b.now(d)}, b.keep({})).ops, (Ops{0, 1, 2}));
}

TEST(Prune, DiamondListsTheSharedProducerOnceInTapeOrder) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.ext();
  b.op("aten::neg", {y});                       // op 0: unrelated
  const ValueId a = b.op("aten::exp", {x});     // op 1
  const ValueId l = b.op("aten::sin", {a});     // op 2
  const ValueId r = b.op("aten::cos", {a});     // op 3
  b.op("aten::tanh", {x});                      // op 4: unrelated
  const ValueId d = b.op("aten::add", {l, r});  // op 5
  EXPECT_EQ(prune_ok(b, {b.now(d)}, b.keep({})).ops, (Ops{1, 2, 3, 5}));
  // Several targets, duplicated and in reverse order: same ascending, duplicate-free list.
  EXPECT_EQ(prune_ok(b, {b.now(r), b.now(d), b.now(l), b.now(d)}, b.keep({})).ops, (Ops{1, 2, 3, 5}));
  EXPECT_EQ(prune_ok(b, {b.now(r), b.now(l)}, b.keep({})).ops, (Ops{1, 2, 3}));
}

TEST(Prune, DropsProducersWithNoConsumer) {
  // The classic MLP: y = W2 @ gelu(W1 @ x). Autograd of the last matmul saves gelu's output; recomputing it must
  // not run the last matmul (nor anything else after gelu).
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId w1 = b.ext();
  const ValueId w2 = b.ext();
  const ValueId h = b.op("aten::mm", {x, w1});  // op 0
  const ValueId g = b.op("aten::gelu", {h});    // op 1
  const ValueId y = b.op("aten::mm", {g, w2});  // op 2
  b.op("aten::sum", {y});                       // op 3
  EXPECT_EQ(prune_ok(b, {b.now(g)}, b.keep({})).ops, (Ops{0, 1}));
  EXPECT_EQ(prune_ok(b, {b.now(h), b.now(x), b.now(w2)}, b.keep({})).ops, (Ops{0}));
}

TEST(Prune, ExternalTargetsNeedNoOps) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId w = b.ext();
  b.op("aten::mm", {x, w});
  // Externals are live at their final state even with an empty `available` (it may be shorter than the values).
  EXPECT_TRUE(prune_ok(b, {b.now(x), b.now(w)}, {}).ops.empty());
  EXPECT_TRUE(prune_ok(b, {b.now(x)}, b.keep({})).ops.empty());
}

TEST(Prune, ShortAvailableVectorCountsMissingEntriesAsNotAvailable) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::exp", {x});  // op 0
  const ValueId c = b.op("aten::sin", {a});  // op 1
  std::vector<uint8_t> short_avail(static_cast<size_t>(a) + 1, 0);
  short_avail[static_cast<size_t>(a)] = 1;  // c is past the end
  EXPECT_EQ(prune_ok(b, {b.now(c)}, short_avail).ops, (Ops{1}));
}

// --- Available values ----------------------------------------------------------------------------------------------

TEST(Prune, KeptValueAtItsFinalStateStopsTheWalk) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::exp", {x});     // op 0
  const ValueId c = b.op("aten::mul", {a, x});  // op 1
  const ValueId d = b.op("aten::sin", {c});     // op 2
  EXPECT_EQ(prune_ok(b, {b.now(d)}, b.keep({c})).ops, (Ops{2}));
  EXPECT_EQ(prune_ok(b, {b.now(d)}, b.keep({a})).ops, (Ops{1, 2}));
  EXPECT_TRUE(prune_ok(b, {b.now(c)}, b.keep({c})).ops.empty());
  EXPECT_EQ(prune_ok(b, {b.now(d)}, b.keep({})).ops, (Ops{0, 1, 2}));
}

TEST(Prune, KeptValueReadAtAnEarlierStateIsReplayed) {
  // a is kept, but its storage was later written in place: a kept tensor holds the final bytes (state 2), so a read
  // of a at state 1 must be rebuilt by a's creator (and nothing after it).
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.ext();
  const ValueId a = b.op("aten::exp", {x});  // op 0
  const Read a_before = b.now(a);            // state 1
  const ValueId s = b.op("aten::sin", {a});  // op 1 reads a at state 1
  b.inplace("aten::add_", a, {y});           // op 2: a's storage -> state 2
  EXPECT_EQ(a_before.state, 1);
  EXPECT_EQ(prune_ok(b, {a_before}, b.keep({a})).ops, (Ops{0}));
  EXPECT_EQ(prune_ok(b, {b.now(s)}, b.keep({a})).ops, (Ops{0, 1}));
  // At the final state the kept value is live.
  EXPECT_TRUE(prune_ok(b, {b.now(a)}, b.keep({a})).ops.empty());
}

// --- In-place writes -----------------------------------------------------------------------------------------------

TEST(Prune, ReadAfterInplaceIncludesCreatorAndInplaceWriter) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.ext();
  const ValueId a = b.op("aten::exp", {x});            // op 0
  const ValueId s = b.op("aten::sin", {a});            // op 1: reads a before add_
  const ValueId w = b.op("aten::cos", {y});            // op 2: other operand of add_
  const ValueId a2 = b.inplace("aten::add_", a, {w});  // op 3
  const ValueId m = b.op("aten::mul", {a2, x});        // op 4: reads after add_
  b.op("aten::neg", {m});                              // op 5
  EXPECT_EQ(b.tape.value(a2).state, 2);
  EXPECT_EQ(b.storage(a2), b.storage(a));
  // After the write: creator, the writer's other operand, the writer.
  EXPECT_EQ(prune_ok(b, {b.now(m)}, b.keep({})).ops, (Ops{0, 2, 3, 4}));
  EXPECT_EQ(prune_ok(b, {b.now(a2)}, b.keep({})).ops, (Ops{0, 2, 3}));
  // The old value read at the storage's final state sees the write too.
  EXPECT_EQ(prune_ok(b, {b.now(a)}, b.keep({})).ops, (Ops{0, 2, 3}));
  // Before the write: not the add_.
  EXPECT_EQ(prune_ok(b, {b.now(s)}, b.keep({})).ops, (Ops{0, 1}));
  EXPECT_EQ(prune_ok(b, {Read{a, 1}}, b.keep({})).ops, (Ops{0}));
}

TEST(Prune, ReadIncludesWritersUpToItsStateOnly) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::exp", {x});            // op 0: state 1
  const ValueId a2 = b.inplace("aten::mul_", a, {x});  // op 1: state 2
  const Read at2 = b.now(a2);
  const ValueId a3 = b.inplace("aten::add_", a2, {x});  // op 2: state 3
  b.inplace("aten::relu_", a3, {});                     // op 3: state 4
  EXPECT_EQ(b.tape.state_of(b.storage(a)), 4);
  EXPECT_EQ(prune_ok(b, {at2}, b.keep({})).ops, (Ops{0, 1}));
  EXPECT_EQ(prune_ok(b, {Read{a3, 3}}, b.keep({})).ops, (Ops{0, 1, 2}));
  EXPECT_EQ(prune_ok(b, {Read{a3, 4}}, b.keep({})).ops, (Ops{0, 1, 2, 3}));
  // A later read at a lower state does not undo an earlier one at a higher state (and vice versa).
  EXPECT_EQ(prune_ok(b, {Read{a3, 3}, at2}, b.keep({})).ops, (Ops{0, 1, 2}));
  EXPECT_EQ(prune_ok(b, {at2, Read{a3, 3}}, b.keep({})).ops, (Ops{0, 1, 2}));
}

TEST(Prune, InplaceOnAViewOfAnIntermediate) {
  // t = exp(x); v = t.view(...); v.add_(y); autograd saves t afterwards (state 2).
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.ext();
  const ValueId t = b.op("aten::exp", {x});  // op 0
  const Read t_before = b.now(t);
  const ValueId v = b.view("aten::view", t);  // op 1
  b.op("aten::neg", {y});                     // op 2: unrelated
  b.inplace("aten::add_", v, {y});            // op 3: writes t's storage through the view
  b.op("aten::sum", {t});                     // op 4: after the read
  EXPECT_EQ(b.tape.state_of(b.storage(t)), 2);
  EXPECT_TRUE(b.tape.op(1).has(kView));
  EXPECT_TRUE(b.tape.op(1).writes.empty());
  EXPECT_EQ(prune_ok(b, {b.now(t)}, b.keep({})).ops, (Ops{0, 1, 3}));
  EXPECT_EQ(prune_ok(b, {t_before}, b.keep({})).ops, (Ops{0}));
  // Keeping t at its final state makes the read live.
  EXPECT_TRUE(prune_ok(b, {b.now(t)}, b.keep({t})).ops.empty());
}

TEST(Prune, OutVariantWritingAnIntermediateStorage) {
  // buf = empty(...); u = exp(x); mul(u, u, out=buf); autograd saves buf afterwards.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId buf = b.op("aten::empty_like", {x});              // op 0
  const ValueId u = b.op("aten::exp", {x});                       // op 1
  const ValueId o = b.out_variant("aten::mul.out", {u, u}, buf);  // op 2
  b.op("aten::sum", {o});                                         // op 3
  EXPECT_EQ(b.storage(o), b.storage(buf));
  EXPECT_EQ(b.tape.value(o).state, 2);
  EXPECT_EQ(b.tape.storage(b.storage(buf)).writers, (Ops{0, 2}));
  EXPECT_EQ(prune_ok(b, {b.now(o)}, b.keep({})).ops, (Ops{0, 1, 2}));
  EXPECT_EQ(prune_ok(b, {b.now(buf)}, b.keep({})).ops, (Ops{0, 1, 2}));
  EXPECT_EQ(prune_ok(b, {Read{buf, 1}}, b.keep({})).ops, (Ops{0}));
  // u kept: the out= op still runs, exp does not.
  EXPECT_EQ(prune_ok(b, {b.now(o)}, b.keep({u})).ops, (Ops{0, 2}));
}

// --- Multi-output ops ----------------------------------------------------------------------------------------------

TEST(Prune, MultiOutputOpIsListedOnce) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const std::vector<ValueId> top = b.multi("aten::topk", {x}, 2);   // op 0: values, indices
  const ValueId t = b.op("aten::exp", {x});                         // op 1
  const std::vector<ValueId> parts = b.views("aten::split", t, 3);  // op 2
  const ValueId m = b.op("aten::mul", {parts[0], parts[2]});        // op 3
  b.op("aten::sum", {parts[1]});                                    // op 4
  ASSERT_EQ(top.size(), 2u);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(prune_ok(b, {b.now(top[1])}, b.keep({})).ops, (Ops{0}));
  EXPECT_EQ(prune_ok(b, {b.now(top[0]), b.now(top[1])}, b.keep({})).ops, (Ops{0}));
  EXPECT_EQ(prune_ok(b, {b.now(parts[1])}, b.keep({})).ops, (Ops{1, 2}));
  EXPECT_EQ(prune_ok(b, {b.now(m), b.now(parts[1])}, b.keep({})).ops, (Ops{1, 2, 3}));
}

// --- What cannot be replayed ---------------------------------------------------------------------------------------

TEST(Prune, OpThatWritesAnExternalInTheClosureFails) {
  // p.add_(a) on a parameter, then c = p * x; autograd saves c.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId p = b.ext();
  const ValueId a = b.op("aten::exp", {x});            // op 0
  const ValueId p2 = b.inplace("aten::add_", p, {a});  // op 1: kWritesExternal
  const ValueId c = b.op("aten::mul", {p2, x});        // op 2
  ASSERT_TRUE(b.tape.op(1).has(kWritesExternal));
  const PruneResult r = prune(b.tape, {b.now(c)}, b.keep({}));
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.blocking_op, 1);
  EXPECT_NE(r.reason.find("writes"), std::string::npos) << r.reason;
  EXPECT_NE(r.reason.find("aten::add_"), std::string::npos) << r.reason;
  // Reads that do not reach the write are fine: the external itself at its final state, and exp's output.
  EXPECT_TRUE(prune_ok(b, {b.now(p)}, b.keep({})).ops.empty());
  EXPECT_EQ(prune_ok(b, {b.now(a)}, b.keep({})).ops, (Ops{0}));
  // Keeping c makes the write unnecessary.
  EXPECT_TRUE(prune_ok(b, {b.now(c)}, b.keep({c})).ops.empty());
}

TEST(Prune, ByteReadOfAnExternalAtAnEarlierStateFails) {
  // a = x * p reads p before the block writes it in place: p's old bytes are gone.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId p = b.ext();
  const Read p_before = b.now(p);
  const ValueId a = b.op("aten::mul", {x, p});  // op 0: reads p at state 0
  b.inplace("aten::mul_", p, {x});              // op 1: p -> state 1
  EXPECT_EQ(b.tape.state_of(b.storage(p)), 1);
  PruneResult r = prune(b.tape, {b.now(a)}, b.keep({}));
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.blocking_value, p);
  EXPECT_EQ(r.blocking_op, 0);
  EXPECT_FALSE(r.reason.empty());
  // Directly as a target.
  r = prune(b.tape, {p_before}, b.keep({}));
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.blocking_value, p);
  EXPECT_EQ(r.blocking_op, -1);
  // Keeping a avoids the read.
  EXPECT_TRUE(prune_ok(b, {b.now(a)}, b.keep({a})).ops.empty());
}

TEST(Prune, ViewOfAnExternalAtAnEarlierStateIsFine) {
  // pt = p.t() before p is written in place; autograd saves pt afterwards (final state): the view only takes p's
  // metadata, so it is replayed on the live p.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId p = b.ext();
  const ValueId pt = b.view("aten::t", p);      // op 0: meta_only read of p at state 0
  b.inplace("aten::add_", p, {x});              // op 1: kWritesExternal, p -> state 1
  const ValueId m = b.op("aten::mm", {x, pt});  // op 2: reads pt at the final state
  EXPECT_EQ(b.tape.op(0).inputs[0].state, 0);
  EXPECT_EQ(prune_ok(b, {b.now(pt)}, b.keep({})).ops, (Ops{0}));
  EXPECT_EQ(prune_ok(b, {b.now(m)}, b.keep({})).ops, (Ops{0, 2}));
  // But the view's bytes at the earlier state are gone.
  EXPECT_FALSE(prune(b.tape, {Read{pt, 0}}, b.keep({})).ok);
}

TEST(Prune, NonReplayableOpFails) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::exp", {x});                         // op 0
  const ValueId c = b.op("c10d::allreduce_", {a}, kNonReplayable);  // op 1
  const ValueId d = b.op("aten::sin", {c});                         // op 2
  PruneResult r = prune(b.tape, {b.now(d)}, b.keep({}));
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.blocking_op, 1);
  EXPECT_NE(r.reason.find("c10d::allreduce_"), std::string::npos) << r.reason;
  EXPECT_EQ(prune_ok(b, {b.now(d)}, b.keep({c})).ops, (Ops{2}));
  EXPECT_EQ(prune_ok(b, {b.now(a)}, b.keep({})).ops, (Ops{0}));
}

// --- Bytes no recorded op wrote (Note [Bytes no recorded op wrote], tape.h) ----------------------------------------

TEST(Prune, ReadOfAnEmptyBufferNoRecordedOpWroteFails) {
  // out = empty_like(h); a kernel fills out through its data pointer; y = gelu(out). Re-running empty_like would
  // serve uninitialised memory: neither out nor anything read from it can be rebuilt.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId h = b.op("aten::mm", {x, x});                                         // op 0
  const ValueId out = b.op("aten::empty_like", {h}, capture::kUninitialized);          // op 1
  const ValueId y = b.op("aten::gelu", {out});                                        // op 2
  const PruneResult r = prune(b.tape, {b.now(out)}, b.keep({}));
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.blocking_value, out);
  EXPECT_NE(r.reason.find("no recorded op wrote"), std::string::npos) << r.reason;
  EXPECT_NE(r.reason.find("aten::empty_like"), std::string::npos) << r.reason;
  const PruneResult ry = prune(b.tape, {b.now(y)}, b.keep({}));
  EXPECT_FALSE(ry.ok);
  EXPECT_EQ(ry.blocking_op, 2);
  // Kept (live at its final state), the buffer serves the replay of y.
  EXPECT_EQ(prune_ok(b, {b.now(y)}, b.keep({out})).ops, (Ops{2}));
}

TEST(Prune, EmptyBufferOverwrittenByARecordedOpIsRebuilt) {
  // buf = empty(); buf.copy_(h) (self overwritten, not read); y = exp(buf): replay runs empty, copy_, exp.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId h = b.op("aten::relu", {x});                                        // op 0
  const ValueId buf = b.op("aten::empty", {}, capture::kUninitialized);             // op 1
  const ValueId filled = b.inplace("aten::copy_", buf, {h});                        // op 2
  const ValueId y = b.op("aten::exp", {filled});                                    // op 3
  // The recorder marks copy_'s self as overwritten; without the mark the read of buf at state 1 is refused.
  PruneResult refused = prune(b.tape, {b.now(y)}, b.keep({}));
  EXPECT_FALSE(refused.ok);
  EXPECT_EQ(refused.blocking_op, 2);
  const_cast<capture::OpRecord&>(b.tape.op(2)).inputs[0].overwritten = true;
  EXPECT_EQ(prune_ok(b, {b.now(y)}, b.keep({})).ops, (Ops{0, 1, 2, 3}));
  EXPECT_EQ(prune_ok(b, {b.now(filled)}, b.keep({})).ops, (Ops{0, 1, 2}));
}

TEST(Prune, OutVariantIntoAnEmptyBufferIsRebuilt) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId buf = b.op("aten::empty_like", {x}, capture::kUninitialized);  // op 0
  const ValueId s = b.out_variant("aten::sigmoid.out", {x}, buf);              // op 1
  const_cast<capture::OpRecord&>(b.tape.op(1)).inputs[1].overwritten = true;   // the out= argument
  EXPECT_EQ(prune_ok(b, {b.now(s)}, b.keep({})).ops, (Ops{0, 1}));
}

TEST(Prune, ViewOfAnEmptyBufferReadsNoBytesButItsReadersDo) {
  TapeBuilder b;
  const ValueId buf = b.op("aten::empty", {}, capture::kUninitialized);  // op 0
  const ValueId v = b.view("aten::view", buf);                           // op 1
  const ValueId y = b.op("aten::tanh", {v});                             // op 2
  EXPECT_FALSE(prune(b.tape, {b.now(y)}, b.keep({})).ok);
  EXPECT_FALSE(prune(b.tape, {b.now(v)}, b.keep({})).ok);
  // The buffer kept: the view is rebuilt from it (path through view ops to a live value).
  EXPECT_EQ(prune_ok(b, {b.now(v)}, b.keep({buf})).ops, (Ops{1}));
  EXPECT_EQ(prune_ok(b, {b.now(y)}, b.keep({buf})).ops, (Ops{1, 2}));
}

TEST(Prune, EmptyBufferOfZeroBytesIsRebuilt) {
  TapeBuilder b;
  OpRecord rec;
  rec.kind = capture::intern_op_kind("aten::empty");
  rec.flags = capture::kUninitialized;
  const StorageId s = b.tape.add_storage(false, 0);
  rec.writes.push_back(s);
  rec.outputs.push_back(b.tape.add_output_value(s, 1, meta_of_bytes(0)));
  b.tape.add_op(std::move(rec));
  const ValueId e = b.tape.op(0).outputs[0];
  EXPECT_EQ(prune_ok(b, {b.now(e)}, b.keep({})).ops, (Ops{0}));
}

TEST(Prune, RandomOpIsReplayable) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId d = b.op("aten::native_dropout", {x}, kRandom);  // op 0
  const ValueId y = b.op("aten::mul", {d, x});                   // op 1
  EXPECT_EQ(prune_ok(b, {b.now(y)}, b.keep({})).ops, (Ops{0, 1}));
}

TEST(Prune, AliasOfAnExternalWrittenInTheBlockIsServedByTheLiveStorage) {
  // p.add_(x) writes the external p; then an op that is not a view returns a new tensor and an alias of p (state 1,
  // p's final state). Reading the alias needs that op only: the live p holds the final bytes, and the write to p is
  // never re-applied.
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId p = b.ext();
  b.inplace("aten::add_", p, {x});  // op 0: kWritesExternal, p -> state 1
  OpRecord rec;
  rec.kind = capture::intern_op_kind("tapesac_test::new_and_alias");
  rec.inputs = {ArgRef{0, -1, p, 1, false}};
  const StorageId fresh = b.tape.add_storage(false, kBytes);
  rec.writes = {fresh};
  const ValueId n = b.tape.add_output_value(fresh, 1, meta_of_bytes(kBytes));
  const ValueId al = b.tape.add_output_value(b.storage(p), 1, meta_of_bytes(kBytes));
  rec.outputs = {n, al};
  b.tape.add_op(std::move(rec));  // op 1
  ASSERT_FALSE(b.tape.op(1).has(kView));
  EXPECT_EQ(prune_ok(b, {b.now(al)}, b.keep({})).ops, (Ops{1}));
  EXPECT_EQ(prune_ok(b, {b.now(n)}, b.keep({})).ops, (Ops{1}));
}

// --- Views of live values (path_live) ------------------------------------------------------------------------------

TEST(Prune, ViewOfAKeptValueNeedsOnlyTheViewOp) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId t = b.op("aten::exp", {x});         // op 0
  const ValueId v = b.view("aten::view", t);        // op 1
  const ValueId vv = b.view("aten::transpose", v);  // op 2
  EXPECT_EQ(prune_ok(b, {b.now(v)}, b.keep({t})).ops, (Ops{1}));
  EXPECT_EQ(prune_ok(b, {b.now(vv)}, b.keep({t})).ops, (Ops{1, 2}));
  EXPECT_EQ(prune_ok(b, {b.now(vv)}, b.keep({v})).ops, (Ops{2}));
  // Without t kept, the storage's creator runs.
  EXPECT_EQ(prune_ok(b, {b.now(v)}, b.keep({})).ops, (Ops{0, 1}));
}

TEST(Prune, ViewOfAnExternalNeedsOnlyTheViewOp) {
  TapeBuilder b;
  const ValueId w = b.ext();
  const ValueId x = b.ext();
  const ValueId wt = b.view("aten::t", w);      // op 0
  const ValueId y = b.op("aten::mm", {x, wt});  // op 1
  EXPECT_EQ(prune_ok(b, {b.now(wt)}, b.keep({})).ops, (Ops{0}));
  EXPECT_EQ(prune_ok(b, {b.now(y)}, b.keep({})).ops, (Ops{0, 1}));
}

TEST(Prune, ViewOfAKeptValueWrittenLaterIsReplayed) {
  // v = t.view(); t.add_(y): the view op read t at state 1, the storage ends at state 2; reading v at state 2 needs
  // the writers (the kept t is not at the state the view op read it).
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.ext();
  const ValueId t = b.op("aten::exp", {x});   // op 0
  const ValueId v = b.view("aten::view", t);  // op 1
  b.inplace("aten::add_", t, {y});            // op 2
  const PruneResult r = prune_ok(b, {b.now(v)}, b.keep({t}));
  EXPECT_EQ(r.ops, (Ops{0, 1, 2}));
}

TEST(Prune, ViewOfAKeptValueReadAtAnEarlierStateIsReplayed) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.ext();
  const ValueId t = b.op("aten::exp", {x});   // op 0
  const ValueId v = b.view("aten::view", t);  // op 1
  const Read v_before = b.now(v);
  const ValueId t2 = b.inplace("aten::add_", t, {y});  // op 2
  EXPECT_EQ(prune_ok(b, {v_before}, b.keep({t, t2})).ops, (Ops{0, 1}));
}

// --- classify_read -------------------------------------------------------------------------------------------------

TEST(ClassifyRead, ExternalValues) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId p = b.ext();
  b.inplace("aten::add_", p, {x});  // p: state 0 -> 1
  const std::vector<uint8_t> none;  // externals are live without an entry
  EXPECT_EQ(classify_read(b.tape, none, x, 0, false), ReadSource::kLive);
  EXPECT_EQ(classify_read(b.tape, none, x, 0, true), ReadSource::kLive);
  EXPECT_EQ(classify_read(b.tape, none, p, 1, false), ReadSource::kLive);
  EXPECT_EQ(classify_read(b.tape, none, p, 0, false), ReadSource::kFail);
  EXPECT_EQ(classify_read(b.tape, none, p, 0, true), ReadSource::kLive);
}

TEST(ClassifyRead, InternalValues) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::exp", {x});  // state 1
  const ValueId c = b.op("aten::sin", {x});  // state 1, final
  b.inplace("aten::add_", a, {x});           // a's storage -> 2
  EXPECT_EQ(classify_read(b.tape, b.keep({}), c, 1, false), ReadSource::kReplay);
  EXPECT_EQ(classify_read(b.tape, b.keep({c}), c, 1, false), ReadSource::kLive);
  EXPECT_EQ(classify_read(b.tape, b.keep({c}), c, 1, true), ReadSource::kLive);
  EXPECT_EQ(classify_read(b.tape, {}, c, 1, false), ReadSource::kReplay);
  // Kept, but read before its storage's last write: replayed, bytes or not.
  EXPECT_EQ(classify_read(b.tape, b.keep({a}), a, 1, false), ReadSource::kReplay);
  EXPECT_EQ(classify_read(b.tape, b.keep({a}), a, 1, true), ReadSource::kReplay);
  EXPECT_EQ(classify_read(b.tape, b.keep({a}), a, 2, false), ReadSource::kLive);
  EXPECT_EQ(classify_read(b.tape, b.keep({}), a, 2, false), ReadSource::kReplay);
}

TEST(ClassifyRead, InternalViewOfAnExternalStorage) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId p = b.ext();
  const ValueId pv = b.view("aten::view", p);  // on p's storage, state 0
  b.inplace("aten::add_", p, {x});             // -> state 1
  EXPECT_EQ(classify_read(b.tape, b.keep({}), pv, 1, false), ReadSource::kReplay);
  EXPECT_EQ(classify_read(b.tape, b.keep({}), pv, 0, false), ReadSource::kFail);
  EXPECT_EQ(classify_read(b.tape, b.keep({}), pv, 0, true), ReadSource::kReplay);
  EXPECT_EQ(classify_read(b.tape, b.keep({pv}), pv, 1, false), ReadSource::kLive);
  EXPECT_EQ(classify_read(b.tape, b.keep({pv}), pv, 0, false), ReadSource::kFail);
}

// --- Randomized comparisons against brute-force references ---------------------------------------------------------

std::vector<uint8_t> random_available(const Tape& tape, std::mt19937& rng, double p) {
  std::bernoulli_distribution keep(p);
  std::vector<uint8_t> a(tape.values().size(), 0);
  for (size_t v = 0; v < a.size(); ++v)
    a[v] = (tape.values()[v].producer != kExternal && keep(rng)) ? 1 : 0;
  // Sometimes shorter than the value table (missing entries are not available).
  if (!a.empty() && std::bernoulli_distribution(0.2)(rng)) {
    a.resize(std::uniform_int_distribution<size_t>(0, a.size())(rng));
  }
  return a;
}

bool avail(const Tape& tape, const std::vector<uint8_t>& a, ValueId v) {
  if (tape.value(v).producer == kExternal)
    return true;
  return static_cast<size_t>(v) < a.size() && a[static_cast<size_t>(v)] != 0;
}

// Reverse reachability through producers from the target values, stopping at available values. Exact for tapes
// of functional ops only (one writer per storage, every read at the final state).
Ops reachable_producers(const Tape& tape, const std::vector<Read>& targets, const std::vector<uint8_t>& a) {
  std::set<OpIndex> seen;
  std::vector<ValueId> stack;
  for (const Read& r : targets)
    stack.push_back(r.value);
  while (!stack.empty()) {
    const ValueId v = stack.back();
    stack.pop_back();
    if (avail(tape, a, v))
      continue;
    const OpIndex p = tape.value(v).producer;
    if (!seen.insert(p).second)
      continue;
    for (const ArgRef& in : tape.op(p).inputs)
      stack.push_back(in.value);
  }
  return Ops(seen.begin(), seen.end());
}

TEST(Prune, MatchesReverseReachabilityOnRandomFunctionalTapes) {
  std::mt19937 rng(20240611);
  int nonempty = 0;
  int partial = 0;
  for (int round = 0; round < 200; ++round) {
    TapeBuilder b;
    std::vector<ValueId> values;
    const int n_ext = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int i = 0; i < n_ext; ++i)
      values.push_back(b.ext());
    const int n_ops = std::uniform_int_distribution<int>(1, 40)(rng);
    for (int i = 0; i < n_ops; ++i) {
      const int n_in = std::uniform_int_distribution<int>(1, 3)(rng);
      std::vector<ValueId> reads;
      for (int k = 0; k < n_in; ++k) {
        // Prefer recent values so chains get deep.
        const int lo = std::max(0, static_cast<int>(values.size()) - 8);
        const int pick = std::bernoulli_distribution(0.7)(rng)
                             ? std::uniform_int_distribution<int>(lo, static_cast<int>(values.size()) - 1)(rng)
                             : std::uniform_int_distribution<int>(0, static_cast<int>(values.size()) - 1)(rng);
        reads.push_back(values[static_cast<size_t>(pick)]);
      }
      const int n_out = std::bernoulli_distribution(0.2)(rng) ? 2 : 1;
      for (ValueId v : b.multi("aten::op" + std::to_string(i % 7), reads, n_out))
        values.push_back(v);
    }
    const std::vector<uint8_t> available = random_available(b.tape, rng, round % 3 == 0 ? 0.0 : 0.25);
    std::vector<Read> targets;
    const int n_targets = std::uniform_int_distribution<int>(0, 4)(rng);
    for (int k = 0; k < n_targets; ++k) {
      const ValueId v = values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
      targets.push_back(b.now(v));
    }
    const PruneResult got = prune(b.tape, targets, available);
    const Ops want = reachable_producers(b.tape, targets, available);
    ASSERT_TRUE(got.ok) << got.reason;
    ASSERT_EQ(got.ops, want) << "round " << round << "\n" << b.tape.to_string();
    nonempty += want.empty() ? 0 : 1;
    partial += (!want.empty() && want.size() < b.tape.ops().size()) ? 1 : 0;
  }
  // The generator exercises the interesting cases (non-trivial and proper-subset closures).
  EXPECT_GT(nonempty, 100);
  EXPECT_GT(partial, 50);
}

// Note [Live reads] restated as a fixpoint, with no worklist, memo or per-storage watermark: the needed set is the
// least set closed under "every read of a target or of a needed op that classify() does not serve live needs the
// value's producer and, for a byte read, the storage's writers up to the read state (unless the value's final bytes
// come from live values through views)". Separately, the closure fails when it holds a read that cannot be served
// or an op that must not be replayed.
struct Reference {
  const Tape& tape;
  const std::vector<uint8_t>& a;

  ReadSource classify(ValueId v, int32_t k, bool cf) const {
    const capture::ValueInfo& info = tape.value(v);
    const capture::StorageInfo& s = tape.storage(info.storage);
    const bool ext_value = info.producer == kExternal;
    const bool final = k == s.final_state();
    if (avail(tape, a, v) && (final || (cf && ext_value)))
      return ReadSource::kLive;
    if (ext_value)
      return ReadSource::kFail;
    if (s.external && !final && !cf)
      return ReadSource::kFail;
    return ReadSource::kReplay;
  }

  bool through_views(ValueId v) const {
    const OpIndex p = tape.value(v).producer;
    if (p == kExternal || !tape.op(p).has(kView))
      return false;
    for (const ArgRef& in : tape.op(p).inputs) {
      const ReadSource src = classify(in.value, in.state, in.meta_only);
      if (src == ReadSource::kFail)
        return false;
      if (src == ReadSource::kReplay && !through_views(in.value))
        return false;
    }
    return true;
  }

  // Adds the ops read (v, k, cf) needs to `needed`; false when the read cannot be served.
  bool serve(ValueId v, int32_t k, bool cf, std::set<OpIndex>& needed) const {
    const ReadSource src = classify(v, k, cf);
    if (src == ReadSource::kLive)
      return true;
    if (src == ReadSource::kFail)
      return false;
    const capture::ValueInfo& info = tape.value(v);
    const capture::StorageInfo& s = tape.storage(info.storage);
    needed.insert(info.producer);
    if (cf || s.external)
      return true;
    if (k == s.final_state() && through_views(v))
      return true;
    for (int32_t w = 0; w < k; ++w)
      needed.insert(s.writers[static_cast<size_t>(w)]);
    return true;
  }

  PruneResult run(const std::vector<Read>& targets) const {
    std::set<OpIndex> needed;
    bool ok = true;
    for (;;) {
      std::set<OpIndex> next = needed;
      for (const Read& r : targets)
        ok = serve(r.value, r.state, false, next) && ok;
      for (OpIndex i : needed) {
        for (const ArgRef& in : tape.op(i).inputs)
          ok = serve(in.value, in.state, in.meta_only, next) && ok;
      }
      if (next == needed)
        break;
      needed = std::move(next);
    }
    PruneResult r;
    for (OpIndex i : needed) {
      if (tape.op(i).has(kWritesExternal) || tape.op(i).has(kNonReplayable))
        ok = false;
    }
    r.ok = ok;
    if (ok)
      r.ops.assign(needed.begin(), needed.end());
    return r;
  }
};

// A random tape of functional ops, views, in-place ops and out= variants over 1-3 externals (with_empty: also
// empty_like buffers, kUninitialized, that later ops overwrite or read); returns its values.
std::vector<ValueId> random_tape(TapeBuilder& b, std::mt19937& rng, bool with_empty = false) {
  std::vector<ValueId> values;
  const int n_ext = std::uniform_int_distribution<int>(1, 3)(rng);
  for (int i = 0; i < n_ext; ++i)
    values.push_back(b.ext());
  const int n_ops = std::uniform_int_distribution<int>(1, 30)(rng);
  auto pick = [&] { return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)]; };
  for (int i = 0; i < n_ops; ++i) {
    const int kind = std::uniform_int_distribution<int>(0, 99)(rng);
    if (with_empty && std::bernoulli_distribution(0.08)(rng)) {
      values.push_back(b.op("aten::empty_like", {pick()}, capture::kUninitialized));
    } else if (kind < 45) {
      const uint32_t flags = std::bernoulli_distribution(0.03)(rng) ? kNonReplayable : 0u;
      const int n_out = std::bernoulli_distribution(0.15)(rng) ? 2 : 1;
      for (ValueId v : b.multi("aten::f", {pick(), pick()}, n_out, flags))
        values.push_back(v);
    } else if (kind < 70) {
      const int n_out = std::bernoulli_distribution(0.2)(rng) ? 2 : 1;
      for (ValueId v : b.views("aten::view", pick(), n_out))
        values.push_back(v);
    } else if (kind < 90) {
      // In place, mostly on internal storages (writing an external is kWritesExternal).
      ValueId target = pick();
      for (int tries = 0; tries < 3 && b.tape.storage(b.storage(target)).external; ++tries)
        target = pick();
      values.push_back(b.inplace("aten::add_", target, {pick()}));
    } else {
      ValueId dst = pick();
      for (int tries = 0; tries < 3 && b.tape.storage(b.storage(dst)).external; ++tries)
        dst = pick();
      values.push_back(b.out_variant("aten::mul.out", {pick(), pick()}, dst));
    }
  }
  return values;
}

// One of `values` at any state it existed at: from its own state to its storage's final one.
Read random_read(const TapeBuilder& b, const std::vector<ValueId>& values, std::mt19937& rng) {
  const ValueId v = values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
  const int32_t lo = b.tape.value(v).state;
  const int32_t hi = b.tape.state_of(b.storage(v));
  return Read{v, std::uniform_int_distribution<int32_t>(lo, hi)(rng)};
}

TEST(Prune, MatchesFixpointReferenceOnRandomTapesWithInplaceAndViews) {
  std::mt19937 rng(7);
  int failures = 0;
  int successes = 0;
  int with_writers = 0;
  for (int round = 0; round < 300; ++round) {
    TapeBuilder b;
    const std::vector<ValueId> values = random_tape(b, rng);
    auto pick = [&] { return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)]; };
    const std::vector<uint8_t> available = random_available(b.tape, rng, round % 4 == 0 ? 0.0 : 0.3);
    std::vector<Read> targets;
    const int n_targets = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int k = 0; k < n_targets; ++k)
      targets.push_back(random_read(b, values, rng));
    const PruneResult got = prune(b.tape, targets, available);
    const PruneResult want = Reference{b.tape, available}.run(targets);
    ASSERT_EQ(got.ok, want.ok) << "round " << round << ": " << got.reason << "\n" << b.tape.to_string();
    if (want.ok) {
      ASSERT_EQ(got.ops, want.ops) << "round " << round << "\n" << b.tape.to_string();
      ++successes;
      for (OpIndex i : want.ops) {
        if (b.tape.op(i).outputs.size() == 1 && b.tape.value(b.tape.op(i).outputs[0]).state > 1) {
          ++with_writers;
          break;
        }
      }
    } else {
      EXPECT_FALSE(got.reason.empty());
      ++failures;
    }
  }
  EXPECT_GT(successes, 100);
  EXPECT_GT(failures, 10);
  EXPECT_GT(with_writers, 30);
}

// RebuildCheck answers what prune() answers for each read, while the available set grows between reads as
// decide_keep grows it (a read that fails is made available, and some others at random): its memo of ops whose
// closure was rebuildable must never answer for a read prune() refuses, nor refuse one prune() accepts.
TEST(RebuildCheck, AgreesWithPruneWhileTheAvailableSetGrows) {
  std::mt19937 rng(11);
  int refused = 0;
  int accepted = 0;
  for (int round = 0; round < 300; ++round) {
    TapeBuilder b;
    const std::vector<ValueId> values = random_tape(b, rng, /*with_empty=*/true);
    std::vector<uint8_t> available = random_available(b.tape, rng, round % 3 == 0 ? 0.0 : 0.2);
    available.resize(b.tape.values().size(), 0);
    RebuildCheck check(b.tape, available);
    for (int k = 0; k < 12; ++k) {
      const Read r = random_read(b, values, rng);
      const ValueId v = r.value;
      const bool want = prune(b.tape, {r}, available).ok;
      ASSERT_EQ(check.ok(r), want) << "round " << round << " read " << k << "\n" << b.tape.to_string();
      (want ? accepted : refused) += 1;
      if (!want || std::bernoulli_distribution(0.2)(rng)) available[static_cast<size_t>(v)] = 1;
    }
  }
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(refused, 100);
}

// The cost decide_keep pays for rebuildability on a long chain (every value saved, as under policy "full"): each op
// is walked once in all, not once per saved value after it (20,000 ops: 2e4 walks instead of 2e8).
TEST(RebuildCheck, WalksEachOpOnceOnALongChain) {
  TapeBuilder b;
  std::vector<ValueId> chain{b.ext()};
  for (int i = 0; i < 20000; ++i) chain.push_back(b.op("aten::tanh", {chain.back()}));
  std::vector<uint8_t> available(b.tape.values().size(), 0);
  RebuildCheck check(b.tape, available);
  for (size_t i = 1; i < chain.size(); ++i) ASSERT_TRUE(check.ok(b.now(chain[i])));
  EXPECT_EQ(check.ops_walked(), 20000);
}

// predict_working_set(): storages created by replayed ops are alive from their creator to their last reader in
// the plan; targets stay alive to the end; views and in-place ops allocate nothing.
TEST(PredictWorkingSet, ChainFreesIntermediatesAndPinsTargets) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::sin", {x});
  const ValueId c1 = b.op("aten::cos", {a});
  const ValueId d = b.op("aten::exp", {c1});
  const std::vector<Read> only_d{b.now(d)};
  const PruneResult p1 = prune(b.tape, only_d, b.keep({}));
  ASSERT_EQ(p1.ops.size(), 3u);
  // a (64), then c1 while a is alive (128), a freed, d while c1 is alive (128).
  EXPECT_EQ(predict_working_set(b.tape, p1, only_d), 2 * kBytes);
  const std::vector<Read> a_and_d{b.now(a), b.now(d)};
  const PruneResult p2 = prune(b.tape, a_and_d, b.keep({}));
  // a is a target: alive to the end, so a + c1 + d.
  EXPECT_EQ(predict_working_set(b.tape, p2, a_and_d), 3 * kBytes);
}

TEST(PredictWorkingSet, ViewsAndInplaceAllocateNothing) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::sin", {x});
  const ValueId v = b.view("aten::view", a);
  const ValueId a2 = b.inplace("aten::mul_", a, {x});
  const ValueId out = b.op("aten::exp", {v});
  (void)a2;
  const std::vector<Read> targets{b.now(out)};
  const PruneResult p = prune(b.tape, targets, b.keep({}));
  ASSERT_FALSE(p.ops.empty());
  // Only sin and exp allocate; sin's storage is read by exp through the view, so both are alive together.
  EXPECT_EQ(predict_working_set(b.tape, p, targets), 2 * kBytes);
}

TEST(PredictWorkingSet, EmptyPlanNeedsNothing) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("aten::sin", {x});
  const std::vector<Read> targets{b.now(a)};
  const PruneResult p = prune(b.tape, targets, b.keep({a}));
  EXPECT_TRUE(p.ops.empty());
  EXPECT_EQ(predict_working_set(b.tape, p, targets), 0);
}

}  // namespace
}  // namespace tapesac::replay
