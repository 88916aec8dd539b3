// CuptiTimer and EventOpTimer (tapesac/cuda/cupti_timer.h). CudaHostCuptiTimer needs no device (CI): start()
// either claims CUPTI or says why, and a second timer is refused. The others need a device (label gpu): eager and
// graph-replay kernel times are attributed to the ops that launched them.
#include <string>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tapesac/capture/kernel_times.h"
#include "tapesac/cuda/cupti_timer.h"
#include "tapesac/cuda/device.h"
#include "tapesac/cuda/graph_capture.h"

namespace tc = tapesac::cuda;
namespace cap = tapesac::capture;

TEST(CudaHostCuptiTimer, StartsOrSaysWhyAndIsExclusive) {
  std::string why;
  auto t = tc::CuptiTimer::start(&why);
  if (!t) {
    EXPECT_NE(why.find("CUPTI"), std::string::npos) << why;
    return;
  }
  std::string why2;
  EXPECT_EQ(tc::CuptiTimer::start(&why2), nullptr);
  EXPECT_NE(why2.find("already in use"), std::string::npos) << why2;
  t.reset();  // the destructor releases CUPTI (its errors are swallowed without a device)
}

TEST(CudaCuptiTimer, EagerAndGraphKernelTimesAreAttributedToOps) {
  if (tc::device_count() == 0) {
    GTEST_SKIP() << "needs a CUDA device";
  }
  const auto opts = torch::TensorOptions().device(torch::kCUDA);
  auto x = torch::randn({1024, 1024}, opts);
  (void)torch::mm(x, x);  // lazy init outside the timed region
  torch::cuda::synchronize();
  std::string why;
  auto timer = tc::CuptiTimer::start(&why);
  ASSERT_TRUE(timer) << why;
  timer->push(cap::external_id(0, 0));
  auto y = torch::mm(x, x);
  timer->pop();
  timer->push(cap::external_id(0, 1));
  auto z = torch::relu(y);
  timer->pop();
  // A graph instantiated while the timer runs: its clones are mapped.
  tc::GraphCapture gc;
  gc.begin();
  auto gy = torch::mm(x, x);
  gc.after_op(0);
  auto gz = torch::relu(gy);
  gc.after_op(1);
  auto outcome = gc.end();
  ASSERT_TRUE(outcome.graph) << outcome.error;
  outcome.graph->launch();
  const tc::CuptiRecords rec = timer->stop();
  const auto eager = cap::attribute_kernel_times(rec.activities, rec.correlations, 0, 2, {});
  EXPECT_GT(eager.ns[0], 0);
  EXPECT_GT(eager.ns[1], 0);
  EXPECT_GT(eager.ns[0], eager.ns[1]);  // a 1024^3 matmul outlasts a relu
  const auto owner = timer->exec_node_owner(outcome.graph->node_handles(), outcome.graph->topology().owner, rec);
  EXPECT_FALSE(owner.empty());
  const auto graph = cap::attribute_kernel_times(rec.activities, {}, 0, 2, owner);
  EXPECT_GT(graph.ns[0], 0);
  EXPECT_GT(graph.ns[1], 0);
}

TEST(CudaEventOpTimer, TimesEachOp) {
  if (tc::device_count() == 0) {
    GTEST_SKIP() << "needs a CUDA device";
  }
  auto x = torch::randn({1024, 1024}, torch::TensorOptions().device(torch::kCUDA));
  (void)torch::mm(x, x);
  tc::EventOpTimer t;
  t.begin(0);
  auto y = torch::mm(x, x);
  t.end();
  t.begin(1);
  auto z = y + 1;
  t.end();
  const auto ns = t.collect(2);
  EXPECT_GT(ns[0], 0);
  EXPECT_GT(ns[1], 0);
  EXPECT_THROW(t.end(), std::logic_error);
}
