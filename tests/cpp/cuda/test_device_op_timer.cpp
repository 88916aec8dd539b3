// The device op timers (capture::device_op_timers, capture/cuda/device_op_timer.cpp) driven by the recorder.
// CudaHostDeviceOpTimers needs no device (CI): without one there is no timer and the reason says so. The others
// need a device (label gpu): a recorded block gets CUPTI times (a matmul outlasts a relu), falls back to CUDA events
// while another client holds CUPTI, and a cancelled timer leaves CUPTI free for the next one; EventOpTimer charges
// nested brackets to the innermost op.
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tapesac/capture/op_timer.h"
#include "tapesac/capture/recorder.h"
#include "tapesac/cuda/cupti_timer.h"
#include "tapesac/cuda/device.h"

namespace tc = tapesac::cuda;
namespace cap = tapesac::capture;

#define TAPESAC_NEED_DEVICE()              \
  if (tc::device_count() == 0) {           \
    GTEST_SKIP() << "needs a CUDA device"; \
  }

namespace {

/// Records mm(x, x) then relu on a CUDA tensor with the factory's timer for one block call.
struct Recorded {
  cap::OpTiming timing;
  std::string note;
  int64_t mm_ns = 0;
  int64_t relu_ns = 0;
  size_t ops = 0;
};

Recorded record_mm_relu(cap::OpTimerFactory& factory) {
  auto x = torch::randn({2048, 2048}, torch::TensorOptions().device(torch::kCUDA));
  (void)torch::relu(torch::mm(x, x));  // cuBLAS handles and lazy init outside the timed block
  torch::cuda::synchronize();
  cap::Recorder rec;
  std::string why;
  std::unique_ptr<cap::OpTimer> timer = factory.make("block", &why);
  EXPECT_TRUE(timer) << why;
  rec.set_op_timer(std::move(timer), why);
  rec.start();
  auto y = torch::mm(x, x);
  (void)torch::relu(y);
  rec.stop();
  Recorded out;
  out.timing = rec.tape().op_timing();
  out.note = rec.op_timing_note();
  out.ops = rec.tape().ops().size();
  if (out.ops >= 2) {
    out.mm_ns = rec.tape().ops()[0].duration_ns;
    out.relu_ns = rec.tape().ops()[1].duration_ns;
  }
  return out;
}

}  // namespace

TEST(CudaHostDeviceOpTimers, NoDeviceMeansNoTimerAndSaysWhy) {
  if (tc::device_count() > 0) {
    GTEST_SKIP() << "a device is visible; CudaDeviceOpTimer covers it";
  }
  std::string why;
  EXPECT_EQ(cap::device_op_timers(0)->make("block", &why), nullptr);
  EXPECT_NE(why.find("no CUDA device 0"), std::string::npos) << why;
}

TEST(CudaDeviceOpTimer, RecordedBlockGetsCuptiTimes) {
  TAPESAC_NEED_DEVICE();
  auto factory = cap::device_op_timers(0);
  const Recorded r = record_mm_relu(*factory);
  ASSERT_EQ(r.ops, 2u);
  EXPECT_EQ(r.timing, cap::OpTiming::kCupti) << r.note;
  EXPECT_GT(r.mm_ns, 0);
  EXPECT_GT(r.relu_ns, 0);
  EXPECT_GT(r.mm_ns, r.relu_ns);  // 2048^3 multiply-adds against one elementwise pass
  // The next block call claims CUPTI again: it was released when the first one's recording stopped.
  const Recorded again = record_mm_relu(*factory);
  EXPECT_EQ(again.timing, cap::OpTiming::kCupti) << again.note;
}

TEST(CudaDeviceOpTimer, FallsBackToEventsWhileCuptiIsHeld) {
  TAPESAC_NEED_DEVICE();
  std::string why;
  auto holder = tc::CuptiTimer::start(&why);
  ASSERT_TRUE(holder) << why;
  auto factory = cap::device_op_timers(0);
  const Recorded r = record_mm_relu(*factory);
  (void)holder->stop();
  ASSERT_EQ(r.ops, 2u);
  EXPECT_EQ(r.timing, cap::OpTiming::kCudaEvents);
  EXPECT_NE(r.note.find("already in use"), std::string::npos) << r.note;
  EXPECT_GT(r.mm_ns, r.relu_ns);
  EXPECT_GT(r.relu_ns, 0);
}

TEST(CudaDeviceOpTimer, CancelReleasesCupti) {
  TAPESAC_NEED_DEVICE();
  auto factory = cap::device_op_timers(0);
  std::string why;
  std::unique_ptr<cap::OpTimer> t = factory->make("block", &why);
  ASSERT_TRUE(t) << why;
  ASSERT_EQ(t->kind(), cap::OpTiming::kCupti) << t->note();
  t->begin(0);  // an open bracket (pushed correlation id) at cancel
  t->cancel();
  t.reset();
  auto next = tc::CuptiTimer::start(&why);
  EXPECT_TRUE(next) << why;
}

TEST(CudaEventOpTimer, NestedBracketsChargeTheInnermostOp) {
  TAPESAC_NEED_DEVICE();
  auto x = torch::randn({2048, 2048}, torch::TensorOptions().device(torch::kCUDA));
  (void)torch::mm(x, x);
  torch::cuda::synchronize();
  tc::EventOpTimer t;
  t.begin(0);
  auto small = x + 1;  // op 0's own work
  t.begin(1);
  auto y = torch::mm(x, x);  // op 1, nested in op 0
  t.end();
  t.end();
  const auto ns = t.collect(2);
  EXPECT_GT(ns[0], 0);
  EXPECT_GT(ns[1], ns[0]);  // the matmul is charged to op 1 only
  // The events are reused: a second round times again.
  t.begin(0);
  auto z = torch::mm(x, x);
  t.end();
  EXPECT_GT(t.collect(1)[0], 0);
}
