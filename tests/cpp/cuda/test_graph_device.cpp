// Tests of CudaGraphDevice (tapesac/cuda/graph_device.h), driven the way the graph replayer drives it: an eager
// warm-up on the caller's stream, begin_capture / one after_op per op / end_capture, node disabling, staging, and
// before_launch / launch / after_launch with the payloads of two forward calls. They need a device and
// GTEST_SKIP() without one (ctest label gpu, run by perf/gpu_check.sh); CudaHost* suites run everywhere.
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cuda_test_util.h"
#include "tapesac/common/errors.h"
#include "tapesac/cuda/device.h"
#include "tapesac/cuda/graph_device.h"

namespace tc = tapesac::cuda;
using tapesac::cuda::testing::bitwise_equal;
using tapesac::capture::ExecGraph;
using tapesac::capture::kUnowned;
using tapesac::capture::NodeKind;
using tapesac::capture::OpIndex;
using tapesac::capture::OpPayload;

namespace {

at::Generator default_cuda_generator() { return at::globalContext().defaultGenerator(at::Device(at::kCUDA, 0)); }

/// The generator's state now (get_state(): seed, offset), as the recorder takes it before a random op.
at::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::Tensor(gen.unsafeGetGeneratorImpl()->get_state());
}

/// The payload the recorder keeps for a random op that is about to draw from `gen`.
OpPayload random_payload(at::Generator gen) {
  OpPayload p;
  std::lock_guard<std::mutex> lock(gen.mutex());
  p.generator_state = gen.unsafeGetGeneratorImpl()->get_state();
  p.generator = gen;
  return p;
}

void after_op(tc::CudaGraphDevice& dev, OpIndex op, std::vector<at::Tensor> outputs) {
  dev.after_op(op, torch::jit::Stack{}, outputs);
}

void set_enabled_for_op(ExecGraph& g, OpIndex op, bool on) {
  const auto& topo = g.topology();
  int n = 0;
  for (size_t i = 0; i < topo.node_count(); ++i) {
    if (topo.owner[i] == op && tapesac::capture::can_disable(topo.kinds[i])) {
      g.set_enabled(static_cast<int>(i), on);
      ++n;
    }
  }
  ASSERT_GT(n, 0) << "op " << op << " owns no node that can be disabled";
}

cudaStreamCaptureStatus capture_status(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  EXPECT_EQ(cudaStreamIsCapturing(s, &st), cudaSuccess);
  return st;
}

/// The calling thread's capture interaction mode (read by exchanging it and putting it back).
cudaStreamCaptureMode thread_capture_mode() {
  cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
  EXPECT_EQ(cudaThreadExchangeStreamCaptureMode(&m), cudaSuccess);
  cudaStreamCaptureMode back = m;
  EXPECT_EQ(cudaThreadExchangeStreamCaptureMode(&back), cudaSuccess);
  return m;
}

}  // namespace

TEST(CudaHostGraphDevice, RejectsADeviceIndexOutsideTheVisibleDevices) {
  const int n = tc::device_count();
  EXPECT_THROW(tc::CudaGraphDevice(-1, 0, 0), tapesac::Error);
  try {
    tc::CudaGraphDevice dev(n, 0, 0);
    ADD_FAILURE() << "device index " << n << " of " << n << " visible devices was accepted";
  } catch (const tapesac::Error& e) {
    EXPECT_EQ(e.kind(), tapesac::ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("got " + std::to_string(n)), std::string::npos) << e.what();
  }
}

TEST(CudaGraphDevice, AttributesEveryOpAndPrunedLaunchesMatchEager) {
  TAPESAC_NEED_DEVICE();
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  const auto x = torch::randn({256, 256}, opts);
  const auto w = torch::randn({256, 256}, opts);
  const auto b = torch::randn({256}, opts);
  // The replayer's warm-up: the first replay of a signature runs eagerly on the caller's stream.
  const auto ref_y = at::mm(x, w);
  const auto ref_z = at::add(ref_y, b);
  const auto ref_r = at::relu(ref_z);
  torch::cuda::synchronize();

  tc::CudaGraphDevice dev(0, 0, 0);
  EXPECT_STREQ(dev.name(), "cuda_graph");
  const auto caller = c10::cuda::getCurrentCUDAStream();
  dev.begin_capture();
  EXPECT_TRUE(dev.capturing());
  EXPECT_NE(c10::cuda::getCurrentCUDAStream(), caller) << "the capture runs on a side stream";
  auto y = at::mm(x, w);
  after_op(dev, 0, {y});
  auto z = at::add(y, b);
  after_op(dev, 1, {z});
  auto r = at::relu(z);
  after_op(dev, 2, {r});
  std::string error = "stale";
  auto exec = dev.end_capture(&error);
  ASSERT_TRUE(exec) << error;
  EXPECT_TRUE(error.empty());
  EXPECT_FALSE(dev.capturing());
  EXPECT_EQ(c10::cuda::getCurrentCUDAStream(), caller);

  const auto& topo = exec->topology();
  std::set<OpIndex> kernel_owners;
  for (size_t i = 0; i < topo.node_count(); ++i) {
    if (topo.kinds[i] == NodeKind::kKernel) {
      EXPECT_NE(topo.owner[i], kUnowned) << "kernel node " << i << " belongs to no op";
      kernel_owners.insert(topo.owner[i]);
    }
  }
  EXPECT_EQ(kernel_owners, (std::set<OpIndex>{0, 1, 2}));

  y.zero_();
  z.zero_();
  r.zero_();
  exec->launch();
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(y, ref_y));
  EXPECT_TRUE(bitwise_equal(z, ref_z));
  EXPECT_TRUE(bitwise_equal(r, ref_r));

  // relu disabled: mm and add still produce the eager bytes, r keeps what we wrote into it.
  set_enabled_for_op(*exec, 2, false);
  y.zero_();
  z.zero_();
  r.fill_(7);
  exec->launch();
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(y, ref_y));
  EXPECT_TRUE(bitwise_equal(z, ref_z));
  EXPECT_TRUE(bitwise_equal(r, torch::full_like(r, 7)));

  // mm disabled (its result kept by the caller and staged), add and relu enabled: the enabled part is eager's.
  set_enabled_for_op(*exec, 2, true);
  set_enabled_for_op(*exec, 0, false);
  dev.stage(y, ref_y);
  z.zero_();
  r.zero_();
  exec->launch();
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(z, ref_z));
  EXPECT_TRUE(bitwise_equal(r, ref_r));
}

TEST(CudaGraphDevice, BeforeLaunchReproducesTheReplayedForwardsDropoutMasks) {
  TAPESAC_NEED_DEVICE();
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  torch::manual_seed(1);
  const auto x = torch::randn({1 << 16}, opts);
  at::Generator gen = default_cuda_generator();
  torch::cuda::manual_seed(1234);

  // One forward of the block: dropout, an op that draws nothing, dropout. Returns the payloads (indexed by op)
  // and the outputs.
  auto forward = [&](std::vector<OpPayload>* payloads, std::vector<at::Tensor>* outs) {
    payloads->assign(3, OpPayload{});
    (*payloads)[0] = random_payload(gen);
    auto [a, ma] = at::native_dropout(x, 0.5, true);
    auto b = at::mul(x, 3);
    (*payloads)[2] = random_payload(gen);
    auto [c, mc] = at::native_dropout(b, 0.3, true);
    *outs = {a, ma, b, c, mc};
  };
  std::vector<OpPayload> captured, current;
  std::vector<at::Tensor> captured_outs, current_outs;
  forward(&captured, &captured_outs);  // the call the graph is captured from (eager warm-up)

  const auto pool = at::cuda::graph_pool_handle();
  tc::CudaGraphDevice dev(0, pool.first, pool.second);
  dev.begin_capture();
  auto [a, ma] = at::native_dropout(x, 0.5, true);
  after_op(dev, 0, {a, ma});
  auto b = at::mul(x, 3);
  after_op(dev, 1, {b});
  auto [c, mc] = at::native_dropout(b, 0.3, true);
  after_op(dev, 2, {c, mc});
  std::string error;
  auto exec = dev.end_capture(&error);
  ASSERT_TRUE(exec) << error;

  forward(&current, &current_outs);  // the call being replayed, at later offsets
  (void)torch::rand({1000}, opts);   // the rest of the step draws more
  const at::Tensor before = state_of(gen);
  ASSERT_FALSE(bitwise_equal(at::Tensor(captured[0].generator_state), at::Tensor(current[0].generator_state)));

  // dropout 0 disabled (its result kept): dropout 2 still draws what the forward drew.
  set_enabled_for_op(*exec, 0, false);
  a.fill_(-1);
  ma.fill_(false);
  c.zero_();
  mc.fill_(false);
  ASSERT_EQ(dev.before_launch(*exec, {0, 2}, captured, current), "");
  exec->launch();
  dev.after_launch(*exec);
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(c, current_outs[3]));
  EXPECT_TRUE(bitwise_equal(mc, current_outs[4]));
  EXPECT_FALSE(bitwise_equal(mc, captured_outs[4])) << "the masks of two calls should differ";
  EXPECT_TRUE(bitwise_equal(a, torch::full_like(a, -1)));
  EXPECT_TRUE(bitwise_equal(state_of(gen), before)) << "after_launch must put the generator back";

  // All enabled: both masks are the replayed call's.
  set_enabled_for_op(*exec, 0, true);
  ASSERT_EQ(dev.before_launch(*exec, {0, 2}, captured, current), "");
  exec->launch();
  dev.after_launch(*exec);
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(a, current_outs[0]));
  EXPECT_TRUE(bitwise_equal(ma, current_outs[1]));
  EXPECT_TRUE(bitwise_equal(c, current_outs[3]));
  EXPECT_TRUE(bitwise_equal(mc, current_outs[4]));
  EXPECT_TRUE(bitwise_equal(state_of(gen), before));

  // No random ops: nothing to do, the generator is not touched.
  EXPECT_EQ(dev.before_launch(*exec, {}, captured, current), "");
  dev.after_launch(*exec);
  EXPECT_TRUE(bitwise_equal(state_of(gen), before));
}

TEST(CudaGraphDevice, BeforeLaunchRefusesWhatTheGraphCannotReproduce) {
  TAPESAC_NEED_DEVICE();
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  const auto x = torch::ones({4096}, opts);
  at::Generator gen = default_cuda_generator();
  torch::cuda::manual_seed(7);
  tc::CudaGraphDevice dev(0, 0, 0);
  dev.begin_capture();
  auto [a, ma] = at::native_dropout(x, 0.5, true);
  after_op(dev, 0, {a, ma});
  auto [c, mc] = at::native_dropout(x, 0.5, true);
  after_op(dev, 1, {c, mc});
  std::string error;
  auto exec = dev.end_capture(&error);
  ASSERT_TRUE(exec) << error;

  // payloads of a forward; `between` runs between the two random ops.
  auto forward = [&](const std::function<void()>& between) {
    std::vector<OpPayload> p(2);
    p[0] = random_payload(gen);
    (void)at::native_dropout(x, 0.5, true);
    between();
    p[1] = random_payload(gen);
    (void)at::native_dropout(x, 0.5, true);
    return p;
  };
  const auto captured = forward([] {});
  const auto plain = forward([] {});
  auto refused = [&](const std::vector<OpPayload>& cur, const std::string& needle) {
    const at::Tensor before = state_of(gen);
    const std::string why = dev.before_launch(*exec, {0, 1}, captured, cur);
    EXPECT_NE(why.find(needle), std::string::npos) << "expected a refusal mentioning '" << needle << "', got '" << why
                                                   << "'";
    EXPECT_TRUE(bitwise_equal(state_of(gen), before)) << "a refusal must leave the generator alone";
  };

  const at::Tensor before = state_of(gen);
  ASSERT_EQ(dev.before_launch(*exec, {0, 1}, captured, plain), "");
  dev.after_launch(*exec);
  EXPECT_TRUE(bitwise_equal(state_of(gen), before));

  // Something outside the tape drew in between: the graph's offsets no longer match.
  refused(forward([&] { (void)torch::rand({100}, opts); }), "offsets after");
  // Reseeded in between.
  refused(forward([&] { torch::cuda::manual_seed(99); }), "reseeded");
  // A CPU generator, a non-default CUDA generator, a missing state.
  auto cpu = plain;
  cpu[1] = random_payload(at::globalContext().defaultGenerator(at::Device(at::kCPU)));
  refused(cpu, "cpu");
  auto other = plain;
  at::Generator clone;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    clone = gen.clone();
  }
  other[0] = random_payload(clone);
  refused(other, "non-default generator");
  auto missing = plain;
  missing[1].generator_state.reset();
  refused(missing, "no recorded generator state");
  auto truncated = plain;
  truncated.resize(1);
  refused(truncated, "outside");
}

TEST(CudaGraphDevice, AbortAndFailedCapturesLeaveNoCaptureAndRestoreTheStream) {
  TAPESAC_NEED_DEVICE();
  const auto x = torch::randn({1024}, torch::TensorOptions().device(torch::kCUDA));
  const cudaStreamCaptureMode mode = thread_capture_mode();
  const auto caller = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  c10::cuda::CUDAStreamGuard on_caller(caller);
  tc::CudaGraphDevice dev(0, 0, 0);

  // Abandoned mid-run.
  dev.begin_capture();
  const cudaStream_t side = c10::cuda::getCurrentCUDAStream().stream();
  EXPECT_EQ(capture_status(side), cudaStreamCaptureStatusActive);
  auto y = x * 2;
  after_op(dev, 0, {y});
  dev.abort_capture();
  EXPECT_FALSE(dev.capturing());
  EXPECT_EQ(c10::cuda::getCurrentCUDAStream(), caller);
  EXPECT_EQ(capture_status(side), cudaStreamCaptureStatusNone);
  EXPECT_EQ(capture_status(caller.stream()), cudaStreamCaptureStatusNone);
  EXPECT_EQ(thread_capture_mode(), mode);
  dev.abort_capture();  // idempotent

  // Invalidated by a host sync: end_capture reports it and restores the stream.
  dev.begin_capture();
  const cudaStream_t side2 = c10::cuda::getCurrentCUDAStream().stream();
  auto z = x * 3;
  after_op(dev, 0, {z});
  try {
    (void)z.sum().item<float>();
  } catch (const std::exception&) {
    // PyTorch may report the illegal sync itself; the capture is invalid either way.
  }
  std::string error;
  EXPECT_FALSE(dev.end_capture(&error));
  EXPECT_FALSE(error.empty());
  EXPECT_EQ(c10::cuda::getCurrentCUDAStream(), caller);
  EXPECT_EQ(capture_status(side2), cudaStreamCaptureStatusNone);
  EXPECT_EQ(thread_capture_mode(), mode);
  (void)cudaGetLastError();

  // end_capture without a capture reports, does not throw.
  error.clear();
  EXPECT_FALSE(dev.end_capture(&error));
  EXPECT_NE(error.find("no capture in progress"), std::string::npos) << error;

  // The device still captures afterwards, and the graph launches on the caller's stream.
  const auto ref = x + 1;
  dev.begin_capture();
  auto w = x + 1;
  after_op(dev, 0, {w});
  auto exec = dev.end_capture(&error);
  ASSERT_TRUE(exec) << error;
  w.zero_();
  exec->launch();
  caller.synchronize();
  EXPECT_TRUE(bitwise_equal(w, ref));
}

TEST(CudaGraphDevice, StageCopiesOnTheCurrentStreamAndRejectsAnotherShape) {
  TAPESAC_NEED_DEVICE();
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  tc::CudaGraphDevice dev(0, 0, 0);
  auto dst = torch::zeros({64, 32}, opts);
  const auto src = torch::randn({64, 32}, opts);
  const auto launch = c10::cuda::getStreamFromPool(false, 0);
  {
    c10::cuda::CUDAStreamGuard g(launch);
    dev.stage(dst, src);
  }
  launch.synchronize();
  EXPECT_TRUE(bitwise_equal(dst, src));
  EXPECT_THROW(dev.stage(dst, torch::randn({32}, opts)), tapesac::Error);  // would broadcast
  EXPECT_THROW(dev.stage(dst, src.to(torch::kDouble)), tapesac::Error);
}

TEST(CudaGraphDevice, TimedLaunchChargesOnlyTheEnabledOps) {
  // Note [Graph launch times]: the capture maps the executable's nodes to ops (CUPTI at instantiation); a timed
  // launch charges each kernel to its op, and a disabled op's kernels do not run, so they cost nothing.
  TAPESAC_NEED_DEVICE();
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  const auto x = torch::randn({1024, 1024}, opts);
  (void)at::relu(at::mm(x, x));  // warm-up
  torch::cuda::synchronize();
  tc::CudaGraphDevice dev(0, 0, 0, /*map_exec_nodes=*/true);
  dev.begin_capture();
  auto y = at::mm(x, x);
  after_op(dev, 0, {y});
  auto r = at::relu(y);
  after_op(dev, 1, {r});
  auto s = at::sigmoid(y);
  after_op(dev, 2, {s});
  std::string error;
  auto g = dev.end_capture(&error);
  ASSERT_TRUE(g) << error;
  set_enabled_for_op(*g, 2, false);
  ASSERT_EQ(dev.before_launch(*g, {}, {}, {}), "");
  std::string why;
  auto timer = dev.time_launch(*g, &why);
  if (!timer) {
    dev.after_launch(*g);
    GTEST_SKIP() << "CUPTI unavailable here: " << why;
  }
  g->launch();
  dev.after_launch(*g);
  const auto t = timer->finish(3);
  EXPECT_EQ(timer->kind(), tapesac::capture::OpTiming::kCupti);
  EXPECT_GT(t.ns[0], 0);
  EXPECT_GT(t.ns[1], 0);
  EXPECT_EQ(t.ns[2], 0) << "a disabled node was charged";
  EXPECT_GT(t.ns[0], t.ns[1]) << "a 1024^3 matmul outlasts a relu";

  // Without the node map no launch of that graph can be timed, and the reason says so.
  tc::CudaGraphDevice unmapped(0, 0, 0, /*map_exec_nodes=*/false);
  unmapped.begin_capture();
  auto y2 = at::mm(x, x);
  after_op(unmapped, 0, {y2});
  auto g2 = unmapped.end_capture(&error);
  ASSERT_TRUE(g2) << error;
  EXPECT_EQ(unmapped.time_launch(*g2, &why), nullptr);
  EXPECT_NE(why.find("not mapped"), std::string::npos) << why;
}
