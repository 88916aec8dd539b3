// GPU tests of the CUDA-graph capture (tapesac/cuda/graph_capture.h): per-op node attribution, full and pruned
// replays bitwise equal to eager, dropout under capture. They need a device and GTEST_SKIP() without one (ctest
// label gpu, run by perf/gpu_check.sh); in CI they only prove that the capture code compiles and links.
#include <algorithm>
#include <set>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cuda_test_util.h"
#include "tapesac/cuda/device.h"
#include "tapesac/capture/recorder.h"
#include "tapesac/cuda/graph_capture.h"

namespace tc = tapesac::cuda;
using tapesac::cuda::testing::bitwise_equal;
using tapesac::capture::kUnowned;
using tapesac::capture::NodeKind;

TEST(CudaGraphCapture, AttributesNodesToOpsAndPrunedReplayRunsOnlyNeededOps) {
  TAPESAC_NEED_DEVICE();
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  auto x = torch::randn({256, 256}, opts);
  auto w = torch::randn({256, 256}, opts);
  tc::GraphCapture cap;
  torch::Tensor y, z, out;
  {
    // Warm-up on the capture stream (cuBLAS handle and workspace), then capture.
    auto s = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(cap.stream()), 0);
    c10::cuda::CUDAStreamGuard g(s);
    (void)torch::relu(torch::mm(x, w) + 1);
    s.synchronize();
  }
  cap.begin();
  y = torch::mm(x, w);
  cap.after_op(0);
  z = y + 1;
  cap.after_op(1);
  out = torch::relu(z);
  cap.after_op(2);
  auto outcome = cap.end();
  ASSERT_TRUE(outcome.graph) << outcome.error;
  auto& g = *outcome.graph;
  const auto& topo = g.topology();
  std::set<int> owners;
  for (size_t i = 0; i < topo.node_count(); ++i) {
    if (topo.kinds[i] == NodeKind::kKernel) {
      EXPECT_NE(topo.owner[i], kUnowned) << "kernel node " << i;
    }
    owners.insert(topo.owner[i]);
  }
  EXPECT_TRUE(owners.count(0) && owners.count(1) && owners.count(2));

  const auto ref_y = torch::mm(x, w);
  const auto ref_out = torch::relu(ref_y + 1);
  y.zero_();
  out.zero_();
  g.launch();
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(y, ref_y));
  EXPECT_TRUE(bitwise_equal(out, ref_out));

  // Pruned: only op 0 (mm) is needed; relu's nodes are disabled, so `out` keeps what we write into it.
  for (size_t i = 0; i < topo.node_count(); ++i) {
    if (topo.owner[i] > 0 && tapesac::capture::can_disable(topo.kinds[i])) {
      g.set_enabled(static_cast<int>(i), false);
      EXPECT_FALSE(g.enabled(static_cast<int>(i)));
    }
  }
  y.zero_();
  out.fill_(7);
  g.launch();
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(y, ref_y));
  EXPECT_TRUE(bitwise_equal(out, torch::full_like(out, 7)));
}

TEST(CudaGraphCapture, HostSyncInvalidatesTheCaptureAndReportsIt) {
  TAPESAC_NEED_DEVICE();
  auto x = torch::randn({64}, torch::TensorOptions().device(torch::kCUDA));
  tc::GraphCapture cap;
  cap.begin();
  auto y = x * 2;
  cap.after_op(0);
  bool threw = false;
  try {
    (void)y.sum().item<float>();  // a host sync: illegal under capture
  } catch (const std::exception&) {
    threw = true;
  }
  cap.after_op(1);
  auto outcome = cap.end();
  EXPECT_TRUE(threw || !outcome.graph);
  EXPECT_FALSE(outcome.graph);
  EXPECT_FALSE(outcome.error.empty());
}

TEST(CudaGraphCapture, DropoutMasksMatchEagerAndSurvivePruning) {
  TAPESAC_NEED_DEVICE();
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  auto x = torch::ones({1 << 16}, opts);
  tc::GraphCapture cap;
  {
    auto s = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(cap.stream()), 0);
    c10::cuda::CUDAStreamGuard g(s);
    (void)torch::dropout(x * 3, 0.5, true);
    s.synchronize();
  }
  cap.begin();
  auto a = torch::dropout(x, 0.5, /*train=*/true);
  cap.after_op(0);
  auto b = x * 3;
  cap.after_op(1);
  auto c = torch::dropout(b, 0.5, /*train=*/true);
  cap.after_op(2);
  auto outcome = cap.end();
  ASSERT_TRUE(outcome.graph) << outcome.error;
  auto& g = *outcome.graph;

  // Eager reference of the same op sequence from the same (seed, offset).
  torch::cuda::manual_seed(1234);
  const auto ea = torch::dropout(x, 0.5, true);
  const auto ec = torch::dropout(x * 3, 0.5, true);
  torch::cuda::manual_seed(1234);
  g.launch();
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(a, ea));
  EXPECT_TRUE(bitwise_equal(c, ec));

  // Pruned (op 0 disabled): op 2 still draws the numbers of the full sequence.
  const auto& topo = g.topology();
  for (size_t i = 0; i < topo.node_count(); ++i) {
    if (topo.owner[i] == 0 && tapesac::capture::can_disable(topo.kinds[i])) g.set_enabled(static_cast<int>(i), false);
  }
  a.fill_(-1);
  c.zero_();
  torch::cuda::manual_seed(1234);
  g.launch();
  torch::cuda::synchronize();
  EXPECT_TRUE(bitwise_equal(c, ec));
  EXPECT_TRUE(bitwise_equal(a, torch::full_like(a, -1)));
}
