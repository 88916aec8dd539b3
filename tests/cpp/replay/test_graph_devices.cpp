// The graph replayer's device checks (Note [Host tensors under capture], replay/graph_block.h) on hand-made tapes:
// a key whose captured ops read a tensor off the graph's device is refused (host_tensor_read), and the tensors a
// capture run made are compared with the forward's metadata (check_captured_outputs). Devices are faked on CPU:
// the "graph device" is the meta device, whose tensors exist without memory, and the forward's metadata says CPU
// or CUDA as the test needs.
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tape_builder.h"
#include "tapesac/replay/eager_replayer.h"
#include "tapesac/replay/graph_block.h"
#include "tapesac/replay/graph_emulation.h"

namespace tapesac::replay {
namespace {

TensorMeta meta_on(c10::DeviceType type, std::vector<int64_t> sizes, int16_t dtype = 6) {
  TensorMeta m;
  m.sizes.assign(sizes.begin(), sizes.end());
  int64_t stride = 1, numel = 1;
  std::vector<int64_t> strides(sizes.size());
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  for (int64_t s : sizes) numel *= s;
  m.strides.assign(strides.begin(), strides.end());
  m.dtype = dtype;
  m.device_type = static_cast<int16_t>(type);
  m.device_index = type == c10::DeviceType::CUDA ? 0 : -1;  // as at::Device reports them
  m.nbytes = numel * 4;
  return m;
}

ValueId ext_on(TapeBuilder& b, const TensorMeta& m) {
  const StorageId s = b.tape.add_storage(/*external=*/true, m.nbytes);
  return b.tape.add_external_value(s, m);
}

std::vector<OpIndex> all_ops(const Tape& t) {
  std::vector<OpIndex> ops;
  for (size_t i = 0; i < t.ops().size(); ++i) ops.push_back(static_cast<OpIndex>(i));
  return ops;
}

TEST(GraphDevices, ACapturedOpReadingAHostScalarRefusesTheKey) {
  TapeBuilder b;
  const ValueId x = ext_on(b, meta_on(c10::DeviceType::CUDA, {16}));
  const ValueId scale = ext_on(b, meta_on(c10::DeviceType::CPU, {}));  // a CPU scalar tensor
  const ValueId y = b.op("aten::mul", {x, scale});
  b.op("aten::relu", {y});
  const std::string why = host_tensor_read(b.tape, all_ops(b.tape), c10::DeviceType::CUDA);
  EXPECT_NE(why.find("op #0"), std::string::npos) << why;
  EXPECT_NE(why.find("v" + std::to_string(scale)), std::string::npos) << why;
  EXPECT_NE(why.find("0-dim tensor on cpu"), std::string::npos) << why;
  // Op #1 reads op #0's output, which the forward made on the CPU too: fine for a CPU-bound graph only; on a
  // CPU-bound graph the CUDA input is the stranger.
  EXPECT_EQ(host_tensor_read(b.tape, {1}, c10::DeviceType::CPU), "");
  EXPECT_NE(host_tensor_read(b.tape, {1}, c10::DeviceType::CUDA).find("output of op #0"), std::string::npos);
  EXPECT_NE(host_tensor_read(b.tape, {0}, c10::DeviceType::CPU).find("v" + std::to_string(x)), std::string::npos);
}

TEST(GraphDevices, EveryInputOnTheGraphsDeviceIsCapturable) {
  TapeBuilder b;  // TapeBuilder's values are CPU float tensors
  const ValueId x = b.ext(), w = b.ext();
  b.op("aten::add", {b.op("aten::mm", {x, w}), x});
  EXPECT_EQ(host_tensor_read(b.tape, all_ops(b.tape), c10::DeviceType::CPU), "");
}

// A random op like memory-efficient attention: its philox seed and offset were CPU tensors in the forward and are
// made on the graph's device under capture.
struct PhiloxTape {
  TapeBuilder b;
  ValueId q = -1, out = -1, seed = -1;
  explicit PhiloxTape(c10::DeviceType out_device = c10::DeviceType::CPU) {
    q = b.ext();
    OpRecord rec;
    rec.kind = capture::intern_op_kind("aten::_efficient_attention_forward");
    ArgRef a;
    a.arg = 0;
    a.value = q;
    rec.inputs.push_back(a);
    const StorageId so = b.tape.add_storage(false, kBytes), ss = b.tape.add_storage(false, 8);
    rec.writes = {so, ss};
    out = b.tape.add_output_value(so, 1, meta_on(out_device, {16}));
    seed = b.tape.add_output_value(ss, 1, meta_on(c10::DeviceType::CPU, {}, /*int64*/ 4));
    rec.outputs = {out, seed};
    b.tape.add_op(std::move(rec));
  }
  std::vector<at::Tensor> env(const at::Tensor& o, const at::Tensor& s) const {
    std::vector<at::Tensor> e(b.tape.values().size());
    e[static_cast<size_t>(out)] = o;
    e[static_cast<size_t>(seed)] = s;
    return e;
  }
};

TEST(GraphDevices, AnOutputTheGraphMakesOnItsDeviceIsHandedOutAsACopy) {
  PhiloxTape t;
  const auto meta = at::TensorOptions().device(at::kMeta);
  std::vector<uint8_t> copy_out;
  GraphFallback reason = GraphFallback::kNone;
  // Bound to CPU: the output stays on CPU (same as the forward), the seed made on CPU: nothing to copy.
  EXPECT_EQ(check_captured_outputs(t.b.tape, {0}, t.env(at::zeros({16}), at::zeros({}, at::kLong)),
                                   c10::DeviceType::CPU, &copy_out, &reason),
            "");
  EXPECT_EQ(copy_out[static_cast<size_t>(t.seed)], 0);
  // Bound to meta (standing in for CUDA): the seed made on the graph's device is copied back at hand-out; the CPU
  // output, made on the host under capture, refuses the graph.
  std::string why = check_captured_outputs(t.b.tape, {0}, t.env(at::zeros({16}), at::zeros({}, meta.dtype(at::kLong))),
                                           c10::DeviceType::Meta, &copy_out, &reason);
  EXPECT_EQ(reason, GraphFallback::kHostTensors);
  EXPECT_NE(why.find("v" + std::to_string(t.out)), std::string::npos) << why;
  reason = GraphFallback::kNone;
  // The output recorded on the meta device too: then only the seed differs, and it is handed out as a copy.
  PhiloxTape u(c10::DeviceType::Meta);
  EXPECT_EQ(check_captured_outputs(u.b.tape, {0}, u.env(at::zeros({16}, meta), at::zeros({}, meta.dtype(at::kLong))),
                                   c10::DeviceType::Meta, &copy_out, &reason),
            "");
  EXPECT_EQ(copy_out[static_cast<size_t>(u.seed)], 1);
  EXPECT_EQ(copy_out[static_cast<size_t>(u.out)], 0);
  // The hand-out copies it to the forward's device.
  EXPECT_EQ(device_of(u.b.tape.value(u.seed).meta), at::Device("cpu"));
  // Unbound (the emulation): devices are not compared.
  EXPECT_EQ(check_captured_outputs(t.b.tape, {0}, t.env(at::zeros({16}), at::zeros({}, meta.dtype(at::kLong))),
                                   std::nullopt, &copy_out, &reason),
            "");
  EXPECT_EQ(copy_out[static_cast<size_t>(t.seed)], 0);
}

TEST(GraphDevices, ACapturedOutputOfAnotherDtypeOrLayoutRefusesTheGraph) {
  PhiloxTape t;
  std::vector<uint8_t> copy_out;
  GraphFallback reason = GraphFallback::kNone;
  std::string why = check_captured_outputs(t.b.tape, {0}, t.env(at::zeros({16}, at::kDouble), at::zeros({}, at::kLong)),
                                           std::nullopt, &copy_out, &reason);
  EXPECT_EQ(reason, GraphFallback::kOutputMismatch);
  EXPECT_NE(why.find("Double"), std::string::npos) << why;
  reason = GraphFallback::kNone;
  const at::Tensor sparse = at::zeros({16}).to_sparse();
  why = check_captured_outputs(t.b.tape, {0}, t.env(sparse, at::zeros({}, at::kLong)), std::nullopt, &copy_out,
                               &reason);
  EXPECT_EQ(reason, GraphFallback::kOutputMismatch);
  EXPECT_NE(why.find("Sparse"), std::string::npos) << why;
}

TEST(GraphDevices, TheEagerMetadataCheckComparesLayoutAndDevice) {
  const TensorMeta cpu = meta_on(c10::DeviceType::CPU, {4});
  EXPECT_TRUE(same_layout(cpu, at::zeros({4})));
  EXPECT_FALSE(same_layout(cpu, at::zeros({4}).to_sparse()));
  EXPECT_TRUE(same_device(cpu, at::zeros({4})));
  EXPECT_FALSE(same_device(cpu, at::zeros({4}, at::TensorOptions().device(at::kMeta))));
  EXPECT_EQ(device_of(meta_on(c10::DeviceType::CUDA, {4})), at::Device("cuda:0"));
}

TEST(GraphDevices, TheEmulationActsAsABoundGraphWhenAsked) {
  EXPECT_FALSE(make_emulated_graph_device()->graph_device_type().has_value());
  EXPECT_EQ(make_emulated_graph_device(c10::DeviceType::CUDA)->graph_device_type(), c10::DeviceType::CUDA);
}

/// A device that never captures (a warm-up never reaches it) but holds `overhead` bytes for capturing.
class OverheadDevice final : public capture::GraphDevice {
 public:
  explicit OverheadDevice(int64_t overhead) : overhead_(overhead) {}
  const char* name() const override { return "overhead"; }
  int64_t capture_overhead_bytes() const override { return overhead_; }
  void begin_capture() override { throw std::logic_error("not for capturing"); }
  void after_op(OpIndex, const torch::jit::Stack&, const std::vector<at::Tensor>&) override {}
  std::unique_ptr<capture::ExecGraph> end_capture(std::string* error) override {
    *error = "not for capturing";
    return nullptr;
  }
  void abort_capture() noexcept override {}
  std::string before_launch(capture::ExecGraph&, const std::vector<OpIndex>&, const std::vector<capture::OpPayload>&,
                            const std::vector<capture::OpPayload>&) override {
    return "not for launching";
  }
  void after_launch(capture::ExecGraph&) noexcept override {}
  void stage(const at::Tensor&, const at::Tensor&) override {}

 private:
  int64_t overhead_;
};

/// One replay of a two-op tape (x -> relu -> neg) on `cache`: the targets are the last value.
/// Payloads naming each op's operator (a capture run that executes the ops needs them); the tape's ops are unary
/// (relu, neg): one argument, its tensor slot empty. `with_ops` false: empty payloads.
std::vector<capture::OpPayload> unary_payloads(const TapeBuilder& b, bool with_ops = true) {
  std::vector<capture::OpPayload> payloads(b.tape.ops().size());
  for (size_t i = 0; with_ops && i < payloads.size(); ++i) {
    payloads[i].handle = c10::Dispatcher::singleton().findSchemaOrThrow(
        capture::op_kind_name(b.tape.ops()[i].kind).c_str(), "");
    payloads[i].args.emplace_back();
  }
  return payloads;
}

/// `with_ops`: see unary_payloads.
GraphReplayOutcome replay_once(GraphCache& cache, TapeBuilder& b, uint64_t signature = 7, bool with_ops = false) {
  std::vector<capture::OpPayload> payloads = unary_payloads(b, with_ops);
  std::vector<at::Tensor> live(b.tape.values().size());
  live[0] = at::zeros({16});
  const std::vector<uint8_t> available = b.keep({});
  GraphCall call;
  call.tape = &b.tape;
  call.payloads = &payloads;
  call.live = &live;
  call.available = &available;
  call.signature = signature;
  PruneResult plan;
  plan.ops = all_ops(b.tape);
  GraphReplayOutcome out;
  cache.replay(call, {b.now(b.tape.op(b.last_op()).outputs[0])}, plan, &out);
  return out;
}

TEST(GraphDevices, TheCaptureOverheadCountsInThePendingStaticBytes) {
  TapeBuilder b;
  b.op("aten::neg", {b.op("aten::relu", {b.ext()})});
  GraphCache cache(std::make_shared<OverheadDevice>(1000), GraphOptions{});
  EXPECT_EQ(cache.pending_bytes(), 0);  // nothing warmed up: no overhead either
  const GraphReplayOutcome out = replay_once(cache, b);
  EXPECT_TRUE(out.warmup);
  // Two op outputs (64 bytes each) and the input's static buffer (64), plus the device's capture overhead.
  EXPECT_EQ(cache.pending_bytes(), 3 * kBytes + 1000);
  EXPECT_EQ(cache.static_bytes(), 0);
  GraphCache free_device(std::make_shared<OverheadDevice>(0), GraphOptions{});
  replay_once(free_device, b);
  EXPECT_EQ(free_device.pending_bytes(), 3 * kBytes);
}

// Only graphs that can still be captured are pending (the planner reserves room for them: Note [Graph reserve]).
// Once the session holds max_graphs, a warmed-up key is refused for good; it counted as pending for good too — 99 MB
// of reserve for 1 MB of graphs over 300 shapes in an adversarial test, every plan made under the limit less that.
TEST(GraphDevices, OnlyKeysThatCanStillBeCapturedArePending) {
  TapeBuilder b;
  b.op("aten::neg", {b.op("aten::relu", {b.ext()})});
  GraphOptions two;
  two.max_graphs = 2;
  GraphCache cache(make_emulated_graph_device(), two);
  for (uint64_t key : {1, 2, 3}) replay_once(cache, b, key);  // three keys warmed up, room for two graphs
  EXPECT_EQ(cache.pending_bytes(), 2 * 3 * kBytes);
  GraphOptions none;
  none.max_graphs = 0;
  GraphCache full(make_emulated_graph_device(), none);  // as a cache holding max_graphs already
  EXPECT_TRUE(replay_once(full, b, 1).warmup);
  EXPECT_EQ(full.pending_bytes(), 0) << "a key the full cache will refuse is pending";
  EXPECT_EQ(replay_once(full, b, 1).reason, GraphFallback::kGraphLimit);
  EXPECT_EQ(full.pending_bytes(), 0) << "a key the full cache refused stays pending";
}

TEST(GraphDevices, ABoundGraphRefusesACpuTapeBeforeItsWarmUp) {
  TapeBuilder b;
  b.op("aten::neg", {b.op("aten::relu", {b.ext()})});
  GraphCache cuda_bound(make_emulated_graph_device(c10::DeviceType::CUDA), GraphOptions{});
  GraphReplayOutcome out = replay_once(cuda_bound, b);
  EXPECT_FALSE(out.warmup);
  EXPECT_EQ(out.reason, GraphFallback::kHostTensors);
  EXPECT_NE(out.detail.find("tensor on cpu"), std::string::npos) << out.detail;
  EXPECT_EQ(cuda_bound.pending_bytes(), 0);  // a refused key is not pending
  GraphCache cpu_bound(make_emulated_graph_device(c10::DeviceType::CPU), GraphOptions{});
  out = replay_once(cpu_bound, b);
  EXPECT_TRUE(out.warmup);
  EXPECT_EQ(out.reason, GraphFallback::kNone);
}

// Issue 17 item 6 (Note [Staged values and captured scratch]): a captured output whose storage overlaps memory the
// capture freed is unstageable; its neighbours are not.
TEST(GraphDevices, OutputsOverFreedScratchAreUnstageable) {
  TapeBuilder b;
  const ValueId x = b.ext();
  const ValueId y = b.op("aten::relu", {x});
  const ValueId z = b.op("aten::neg", {y});
  std::vector<at::Tensor> env(b.tape.values().size());
  env[static_cast<size_t>(x)] = at::zeros({16});
  env[static_cast<size_t>(y)] = at::zeros({16});
  env[static_cast<size_t>(z)] = at::zeros({16});
  const auto at_of = [&](ValueId v) { return reinterpret_cast<uintptr_t>(env[static_cast<size_t>(v)].data_ptr()); };
  // A freed range covering the last 4 bytes of z's storage only.
  std::vector<capture::AddressRange> freed{{at_of(z) + 60, 16}};
  std::vector<uint8_t> over = values_over_freed(b.tape, all_ops(b.tape), env, freed);
  EXPECT_EQ(over[static_cast<size_t>(z)], 1);
  EXPECT_EQ(over[static_cast<size_t>(y)], 0);
  EXPECT_EQ(over[static_cast<size_t>(x)], 0);  // an input: allocated before the capture, never an op output here
  // A range ending right where y begins does not overlap it.
  over = values_over_freed(b.tape, all_ops(b.tape), env, {{at_of(y) - 16, 16}});
  EXPECT_EQ(over[static_cast<size_t>(y)], 0);
  EXPECT_EQ(values_over_freed(b.tape, all_ops(b.tape), env, {}), std::vector<uint8_t>(b.tape.values().size(), 0));
}


// Reviewer's finding (GPU, not run): a block whose ops run on another CUDA device than the capture stream's executes
// them there, uncaptured, and the graph comes out empty; every launch then did nothing and handed out the static
// buffers. Such a key is refused before its capture, and a capture without work is refused after it.
TEST(GraphDevices, ACapturedOpOnAnotherDeviceIndexRefusesTheKey) {
  TapeBuilder b;
  TensorMeta on1 = meta_on(c10::DeviceType::CUDA, {16});
  on1.device_index = 1;
  const ValueId x = ext_on(b, on1);
  b.op("aten::relu", {x});
  EXPECT_EQ(host_tensor_read(b.tape, {0}, c10::DeviceType::CUDA, 1), "");
  EXPECT_EQ(host_tensor_read(b.tape, {0}, c10::DeviceType::CUDA, -1), "");
  const std::string why = host_tensor_read(b.tape, {0}, c10::DeviceType::CUDA, 0);
  EXPECT_NE(why.find("on cuda:1"), std::string::npos) << why;
  EXPECT_NE(why.find("captured on cuda:0"), std::string::npos) << why;
}

// A helper's finding: a sparse block input crashed the emulated graph's static buffers with torch's untyped error in
// the backward, every step. Values without strides (meta_of records none for a non-strided layout) are refused,
// read or made by a captured op, whatever the graph's device.
TEST(GraphDevices, AValueWithoutStridesRefusesTheKey) {
  TapeBuilder b;
  TensorMeta sparse = meta_on(c10::DeviceType::CPU, {4, 4});
  sparse.strides = capture::SmallDims();
  const ValueId s = ext_on(b, sparse);
  b.op("aten::relu", {b.ext()});
  b.op("aten::mm", {s, b.ext()});
  EXPECT_EQ(host_tensor_read(b.tape, {0}, std::nullopt), "");
  const std::string why = host_tensor_read(b.tape, {1}, std::nullopt);
  EXPECT_NE(why.find("without strides"), std::string::npos) << why;
  EXPECT_NE(why.find("reads v" + std::to_string(s)), std::string::npos) << why;
  EXPECT_NE(host_tensor_read(b.tape, {1}, c10::DeviceType::CPU).find("without strides"), std::string::npos);
}

/// A graph with the nodes a test gives (none: what a capture returns when the block's kernels ran on another
/// stream); its launch does nothing.
class NoNodesExec final : public capture::ExecGraph {
 public:
  NoNodesExec() = default;
  explicit NoNodesExec(capture::GraphTopology topo) : topo_(std::move(topo)) {}
  const capture::GraphTopology& topology() const override { return topo_; }
  void set_enabled(NodeId, bool) override { throw std::invalid_argument("no nodes"); }
  bool enabled(NodeId) const override { return false; }
  void launch() override {}

 private:
  capture::GraphTopology topo_;
};

class NoWorkDevice final : public capture::GraphDevice {
 public:
  NoWorkDevice() = default;
  explicit NoWorkDevice(capture::GraphTopology topo) : topo_(std::move(topo)) {}
  const char* name() const override { return "no_work"; }
  bool capture_executes() const override { return true; }
  void begin_capture() override {}
  void after_op(OpIndex, const torch::jit::Stack&, const std::vector<at::Tensor>&) override {}
  std::unique_ptr<capture::ExecGraph> end_capture(std::string*) override { return std::make_unique<NoNodesExec>(topo_); }
  void abort_capture() noexcept override {}
  std::string before_launch(capture::ExecGraph&, const std::vector<OpIndex>&, const std::vector<capture::OpPayload>&,
                            const std::vector<capture::OpPayload>&) override {
    return "";
  }
  void after_launch(capture::ExecGraph&) noexcept override {}
  void stage(const at::Tensor&, const at::Tensor&) override {}

 private:
  capture::GraphTopology topo_;
};

TEST(GraphDevices, ACaptureThatRecordedNoWorkIsRefused) {
  TapeBuilder b;
  b.op("aten::neg", {b.op("aten::relu", {b.ext()})});
  GraphCache cache(std::make_shared<NoWorkDevice>(), GraphOptions{});
  GraphReplayOutcome out = replay_once(cache, b, 7, /*with_ops=*/true);
  for (int i = 0; i < 8 && out.warmup; ++i) out = replay_once(cache, b, 7, /*with_ops=*/true);
  EXPECT_FALSE(out.captured);
  EXPECT_EQ(out.reason, GraphFallback::kCaptureInvalidated);
  EXPECT_NE(out.detail.find("recorded no work"), std::string::npos) << out.detail << " / reason " << to_string(out.reason);
}

// Note [Nodes that run anyway] (graph_block.cpp), a reviewer's finding: op #0 owns a node that cannot be disabled
// (a child graph), so it runs at every launch although a replay keeping its output does not need it; staging that
// kept output would be overwritten by the launch. Such a replay is refused (it goes eager).
TEST(GraphDevices, AValueStagedWhereANodeThatRunsAnywayWritesIsRefused) {
  // A child graph may write memory; an event node writes none (the launch goes ahead).
  for (capture::NodeKind forced : {capture::NodeKind::kChildGraph, capture::NodeKind::kEventRecord}) {
    SCOPED_TRACE(capture::to_string(forced));
    TapeBuilder b;
    const ValueId mid = b.op("aten::relu", {b.ext()});
    b.op("aten::neg", {mid});
    capture::GraphTopology topo;
    topo.kinds = {forced, capture::NodeKind::kKernel};
    topo.owner = {0, 1};
    GraphCache cache(std::make_shared<NoWorkDevice>(topo), GraphOptions{});
    GraphReplayOutcome out = replay_once(cache, b, 7, /*with_ops=*/true);
    for (int i = 0; i < 8 && out.warmup; ++i) out = replay_once(cache, b, 7, /*with_ops=*/true);
    ASSERT_TRUE(out.captured) << out.detail;
    // Now a call that keeps relu's output: the plan needs neg alone and stages relu's output.
    std::vector<capture::OpPayload> payloads = unary_payloads(b);
    std::vector<at::Tensor> live(b.tape.values().size());
    live[static_cast<size_t>(mid)] = at::ones({16});
    const std::vector<uint8_t> available = b.keep({mid});
    GraphCall call;
    call.tape = &b.tape;
    call.payloads = &payloads;
    call.live = &live;
    call.available = &available;
    call.signature = 7;
    PruneResult plan;
    plan.ops = {1};
    GraphReplayOutcome kept;
    for (int i = 0; i < 8 && (i == 0 || kept.warmup || kept.captured); ++i) {  // this availability's key: warm up
      kept = GraphReplayOutcome{};
      cache.replay(call, {b.now(b.tape.op(1).outputs[0])}, plan, &kept);
    }
    if (forced == capture::NodeKind::kChildGraph) {
      EXPECT_EQ(kept.reason, GraphFallback::kStagingConflict) << kept.detail << " launched " << kept.launched;
      EXPECT_NE(kept.detail.find("reads v" + std::to_string(mid) + " as kept"), std::string::npos) << kept.detail;
    } else {
      EXPECT_TRUE(kept.launched) << kept.detail;
      EXPECT_EQ(kept.reason, GraphFallback::kNone) << kept.detail;
    }
  }
}

}  // namespace
}  // namespace tapesac::replay
