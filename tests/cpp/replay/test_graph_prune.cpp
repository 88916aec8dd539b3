// Tests of the CUDA-graph backend's logic on CPU (capture/exec_graph.h, replay/graph_prune.h): node attribution from
// capture snapshots, the enabled mask of a pruned replay on random tapes, capturability and fallback reasons,
// and which ops a session's capture leaves out (graph_block.h: tainted_ops, hash_constants). The session's graph
// replayer itself runs end to end on CPU through the emulated device (tests/python/test_graph_backend.py).
#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/capture/exec_graph.h"
#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/graph_block.h"
#include "tapesac/replay/graph_prune.h"
#include "tapesac/replay/prune.h"

namespace tapesac::replay {
namespace {

using capture::ArgRef;
using capture::kUnowned;
using capture::NodeAttribution;
using capture::OpRecord;
using capture::StorageId;
using capture::TensorMeta;
using capture::ValueId;
using Handle = NodeAttribution::Handle;

TensorMeta meta_of(int64_t numel) {
  TensorMeta m;
  m.sizes = {numel};
  m.strides = {1};
  m.dtype = 6;
  m.nbytes = numel * 4;
  return m;
}

/// Functional ops only (every op reads earlier values at their current state and makes one new storage), the way
/// capture::Recorder fills a tape.
struct Builder {
  Tape tape;
  ValueId ext() {
    const StorageId s = tape.add_storage(true, 64);
    return tape.add_external_value(s, meta_of(16));
  }
  ValueId op(const std::string& name, const std::vector<ValueId>& reads, uint32_t flags = 0, int64_t numel = 16) {
    OpRecord rec;
    rec.kind = capture::intern_op_kind(name);
    rec.flags = flags;
    for (size_t i = 0; i < reads.size(); ++i) {
      ArgRef a;
      a.arg = static_cast<int16_t>(i);
      a.value = reads[i];
      a.state = tape.state_of(tape.value(reads[i]).storage);
      rec.inputs.push_back(a);
    }
    const StorageId s = tape.add_storage(false, numel * 4);
    rec.writes.push_back(s);
    rec.outputs.push_back(tape.add_output_value(s, 1, meta_of(numel)));
    tape.add_op(std::move(rec));
    return tape.ops().back().outputs[0];
  }
};

/// Random functional tape: `n_ext` externals, `n_ops` ops reading 1..3 earlier values.
Builder random_tape(std::mt19937& rng, int n_ext, int n_ops) {
  Builder b;
  std::vector<ValueId> vals;
  for (int i = 0; i < n_ext; ++i) vals.push_back(b.ext());
  for (int i = 0; i < n_ops; ++i) {
    std::uniform_int_distribution<int> nread(1, 3);
    std::vector<ValueId> reads;
    const int k = nread(rng);
    for (int j = 0; j < k; ++j) {
      std::uniform_int_distribution<size_t> pick(0, vals.size() - 1);
      reads.push_back(vals[pick(rng)]);
    }
    vals.push_back(b.op("aten::op" + std::to_string(i % 5), reads));
  }
  return b;
}

/// A fake capture: per op, a few nodes of random kinds appear (sometimes none: views), and unowned nodes appear
/// between some ops. Drives NodeAttribution the way the CUDA capture does, listing *all* nodes in shuffled order.
struct FakeCapture {
  GraphTopology truth;  // in order of creation
  NodeAttribution attribution;

  FakeCapture(std::mt19937& rng, size_t n_ops, bool only_disableable) {
    std::vector<Handle> all;
    Handle next = 0x1000;
    std::uniform_int_distribution<int> count(0, 3), coin(0, 9);
    const std::vector<NodeKind> kinds = only_disableable
        ? std::vector<NodeKind>{NodeKind::kKernel, NodeKind::kMemcpy, NodeKind::kMemset}
        : std::vector<NodeKind>{NodeKind::kKernel, NodeKind::kMemcpy, NodeKind::kMemset, NodeKind::kEmpty,
                                NodeKind::kEventRecord};
    std::uniform_int_distribution<size_t> kind(0, kinds.size() - 1);
    auto add = [&](OpIndex owner, NodeKind k) {
      all.push_back(next);
      next += 0x40 + 8 * static_cast<Handle>(coin(rng));  // not dense, like real pointers
      truth.kinds.push_back(k);
      truth.owner.push_back(owner);
    };
    auto snapshot = [&]() {
      std::vector<Handle> s = all;
      std::shuffle(s.begin(), s.end(), rng);
      return s;
    };
    add(kUnowned, NodeKind::kMemcpy);  // a static-input copy before the first op
    auto s0 = snapshot();
    attribution.after_unowned(s0.data(), s0.size());
    for (size_t op = 0; op < n_ops; ++op) {
      const int n = count(rng);
      for (int j = 0; j < n; ++j) add(static_cast<OpIndex>(op), kinds[kind(rng)]);
      auto s = snapshot();
      EXPECT_EQ(attribution.after_op(static_cast<OpIndex>(op), s.data(), s.size()), static_cast<size_t>(n));
      if (coin(rng) == 0) {
        add(kUnowned, NodeKind::kKernel);
        auto u = snapshot();
        attribution.after_unowned(u.data(), u.size());
      }
    }
  }

  /// The topology as the capture produced it (attribution order == creation order here).
  GraphTopology topology() const {
    GraphTopology t;
    t.owner = attribution.owner();
    t.kinds = truth.kinds;
    return t;
  }
};

TEST(GraphAttribution, AssignsEveryNewNodeToTheOpThatLaunchedIt) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    FakeCapture cap(rng, 40, false);
    ASSERT_EQ(cap.attribution.node_count(), cap.truth.node_count());
    // Node ids are in order of first sight; here that is creation order, so owners must match the truth exactly.
    EXPECT_EQ(cap.attribution.owner(), cap.truth.owner) << "trial " << trial;
    for (size_t i = 0; i < cap.attribution.node_count(); ++i)
      EXPECT_EQ(cap.attribution.find(cap.attribution.handles()[i]), static_cast<NodeId>(i));
  }
}

TEST(GraphAttribution, OpsWithoutNodesAndUnknownHandles) {
  NodeAttribution a;
  const std::vector<Handle> g1{10, 20};
  EXPECT_EQ(a.after_op(0, g1.data(), g1.size()), 2u);
  EXPECT_EQ(a.after_op(1, g1.data(), g1.size()), 0u);  // a view op launches nothing
  const std::vector<Handle> g2{20, 30, 10};
  EXPECT_EQ(a.after_op(3, g2.data(), g2.size()), 1u);
  EXPECT_EQ(a.owner(), (std::vector<OpIndex>{0, 0, 3}));
  EXPECT_EQ(a.find(99), -1);
  EXPECT_THROW(a.after_op(2, g2.data(), g2.size()), std::invalid_argument);
  EXPECT_THROW(a.after_op(-1, g2.data(), g2.size()), std::invalid_argument);
}

TEST(GraphPrune, EnabledNodesAreExactlyTheNodesOfNeededOpsOnRandomTapes) {
  std::mt19937 rng(11);
  int nontrivial = 0;
  for (int trial = 0; trial < 200; ++trial) {
    Builder b = random_tape(rng, 3, 30);
    const Tape& tape = b.tape;
    FakeCapture cap(rng, tape.ops().size(), trial % 2 == 0);
    const GraphTopology topo = cap.topology();
    std::vector<uint8_t> available(tape.values().size(), 0);
    std::bernoulli_distribution keep(0.3);
    for (auto& a : available) a = keep(rng) ? 1 : 0;
    std::vector<Read> targets;
    std::uniform_int_distribution<ValueId> pick(3, static_cast<ValueId>(tape.values().size()) - 1);
    for (int i = 0; i < 3; ++i) targets.push_back({pick(rng), 1});
    const PruneResult pr = prune(tape, targets, available);
    ASSERT_TRUE(pr.ok) << pr.reason;
    const std::set<OpIndex> needed(pr.ops.begin(), pr.ops.end());
    const GraphPrune gp = prune_graph(tape, topo, pr.ops);
    ASSERT_TRUE(gp.ok()) << gp.verdict.detail;
    size_t on = 0, off = 0, forced = 0;
    for (size_t n = 0; n < topo.node_count(); ++n) {
      const OpIndex o = topo.owner[n];
      const bool want = o == kUnowned || needed.count(o) > 0 || !capture::can_disable(topo.kinds[n]);
      EXPECT_EQ(gp.enabled[n] != 0, want) << "trial " << trial << " node " << n << " op " << o;
      (want ? on : off) += 1;
      if (want && o != kUnowned && !needed.count(o) && topo.kinds[n] != NodeKind::kEmpty) ++forced;
    }
    EXPECT_EQ(gp.enabled_nodes, on);
    EXPECT_EQ(gp.disabled_nodes, off);
    EXPECT_EQ(gp.forced_nodes, forced);
    if (off > 0) ++nontrivial;
  }
  EXPECT_GT(nontrivial, 100);  // the random tapes really prune
}

TEST(GraphPrune, RefusesToForceANodeOfAnOpThatMustNotRerun) {
  Builder b;
  const ValueId x = b.ext();
  const ValueId y = b.op("aten::mul", {x});
  b.op("aten::record_event", {y}, capture::kNonReplayable);
  b.op("aten::relu", {y});
  GraphTopology topo;
  topo.kinds = {NodeKind::kKernel, NodeKind::kEventRecord, NodeKind::kKernel};
  topo.owner = {0, 1, 2};
  GraphPrune gp = prune_graph(b.tape, topo, {0});
  EXPECT_EQ(gp.verdict.reason, GraphFallback::kNotPrunable);
  EXPECT_EQ(gp.verdict.where, 1);
  // The same event node on an ordinary op is forced on (extra work, still correct).
  Builder c;
  const ValueId x2 = c.ext();
  const ValueId y2 = c.op("aten::mul", {x2});
  c.op("aten::sync_free", {y2});
  c.op("aten::relu", {y2});
  gp = prune_graph(c.tape, topo, {0});
  ASSERT_TRUE(gp.ok());
  EXPECT_EQ(gp.enabled, (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(gp.forced_nodes, 1u);
  EXPECT_THROW(prune_graph(c.tape, topo, {5}), std::invalid_argument);
  topo.owner[2] = 9;
  EXPECT_THROW(prune_graph(c.tape, topo, {0}), std::invalid_argument);
}

TEST(GraphCapturable, RefusesMemoryConditionalAndHostNodes) {
  GraphTopology topo;
  topo.kinds = {NodeKind::kMemcpy, NodeKind::kKernel, NodeKind::kEmpty, NodeKind::kMemset};
  topo.owner = {kUnowned, 0, 1, 1};
  EXPECT_TRUE(check_capturable(topo).ok());
  const std::vector<std::pair<NodeKind, GraphFallback>> bad{
      {NodeKind::kMemAlloc, GraphFallback::kMemoryNodes},
      {NodeKind::kMemFree, GraphFallback::kMemoryNodes},
      {NodeKind::kConditional, GraphFallback::kConditionalNodes},
      {NodeKind::kHost, GraphFallback::kHostNodes}};
  for (const auto& [kind, reason] : bad) {
    GraphTopology t = topo;
    t.kinds[2] = kind;
    const GraphVerdict v = check_capturable(t);
    EXPECT_EQ(v.reason, reason) << capture::to_string(kind);
    EXPECT_EQ(v.where, 2);
    EXPECT_NE(v.detail.find(capture::to_string(kind)), std::string::npos) << v.detail;
  }
  EXPECT_STREQ(to_string(GraphFallback::kMemoryNodes), "memory_nodes");
  EXPECT_STREQ(to_string(GraphFallback::kOutputsLive), "outputs_live");
}

// --- What a capture leaves out (graph_block.h, Note [What a graph captures]) -------------------------------------

TEST(TaintedOps, AnOpThatMustNotRerunTaintsItsReadersUnlessItsResultIsKept) {
  Builder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("test::a", {x});
  const ValueId w = b.op("test::writes_state", {a}, capture::kWritesExternal);
  const ValueId c = b.op("test::c", {w});
  b.op("test::d", {c, a});
  std::vector<uint8_t> live;
  // Nothing kept: the writer and everything downstream of it stay out of the graph.
  std::vector<uint8_t> available(b.tape.values().size(), 0);
  EXPECT_EQ(tainted_ops(b.tape, available, &live), (std::vector<uint8_t>{0, 1, 1, 1}));
  EXPECT_EQ(live[static_cast<size_t>(x)], 1);
  EXPECT_EQ(live[static_cast<size_t>(w)], 0);
  // The writer's result kept: the graph reads it from a static buffer and holds its readers.
  available[static_cast<size_t>(w)] = 1;
  EXPECT_EQ(tainted_ops(b.tape, available, &live), (std::vector<uint8_t>{0, 1, 0, 0}));
  EXPECT_EQ(live[static_cast<size_t>(w)], 1);
  EXPECT_EQ(live[static_cast<size_t>(a)], 0);  // made inside the graph
  // Kept values of untainted ops change nothing: one capture serves every plan.
  available[static_cast<size_t>(c)] = 1;
  EXPECT_EQ(tainted_ops(b.tape, available, &live), (std::vector<uint8_t>{0, 1, 0, 0}));
  EXPECT_EQ(live[static_cast<size_t>(c)], 0);
}

TEST(TaintedOps, ANonReplayableInPlaceWriterTaintsLaterReadersOfTheStorage) {
  Builder b;
  const ValueId x = b.ext();
  const ValueId a = b.op("test::a", {x});
  // An in-place op on a's storage that must not re-run (state 1 -> 2), then a reader of the new state.
  OpRecord rec;
  rec.kind = capture::intern_op_kind("test::inplace_effect_");
  rec.flags = capture::kNonReplayable;
  ArgRef in;
  in.value = a;
  in.state = 1;
  rec.inputs.push_back(in);
  const StorageId s = b.tape.value(a).storage;
  rec.writes.push_back(s);
  rec.outputs.push_back(b.tape.add_output_value(s, 2, meta_of(16)));
  b.tape.add_op(std::move(rec));
  const ValueId a2 = b.tape.ops().back().outputs[0];
  b.op("test::reader", {a2});
  std::vector<uint8_t> available(b.tape.values().size(), 0);
  EXPECT_EQ(tainted_ops(b.tape, available, nullptr), (std::vector<uint8_t>{0, 1, 1}));
}

TEST(HashConstants, SameConstantsSameHashAndObjectsAreRefused) {
  std::vector<capture::OpPayload> p(2);
  p[0].args.push_back(c10::IValue());
  p[0].args.push_back(c10::IValue(0.5));
  p[1].args.push_back(c10::IValue(std::vector<int64_t>{1, 2}));
  p[1].args.push_back(c10::IValue(std::string("tanh")));
  uint64_t h1 = 0, h2 = 0;
  ASSERT_TRUE(hash_constants(p, {0, 1}, &h1));
  ASSERT_TRUE(hash_constants(p, {0, 1}, &h2));
  EXPECT_EQ(h1, h2);
  p[0].args[1] = c10::IValue(0.25);  // another scale: another graph
  ASSERT_TRUE(hash_constants(p, {0, 1}, &h2));
  EXPECT_NE(h1, h2);
  p[1].args[1] = c10::IValue(c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()));
  EXPECT_FALSE(hash_constants(p, {0, 1}, &h2));
}

}  // namespace
}  // namespace tapesac::replay
