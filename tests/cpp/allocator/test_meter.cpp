// Tests of MemoryMeter (allocator/meter.h): what tapesac.MemoryMeter counts on CPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tapesac/allocator/meter.h"
#include "tapesac/common/errors.h"

namespace tapesac::allocator {
namespace {

TEST(MemoryMeter, CountsTheTensorsAllocatedWhileStartedAndTheirFrees) {
  MemoryMeter m;
  EXPECT_EQ(m.gauge().peak, 0);
  m.start();
  {
    at::Tensor t = at::empty({1024}, at::kFloat);  // 4 KiB
    EXPECT_GE(m.gauge().current, 4096);
  }
  m.stop();
  const Gauge g = m.gauge();
  EXPECT_GE(g.peak, 4096);
  EXPECT_GE(g.allocations, 1);
  EXPECT_EQ(g.current, 0);  // the tensor was freed
  at::Tensor after = at::empty({1024}, at::kFloat);
  EXPECT_EQ(m.gauge().allocated, g.allocated);  // stopped: no longer counting
}

TEST(MemoryMeter, StartingTwiceIsAnError) {
  MemoryMeter m;
  m.start();
  EXPECT_THROW(m.start(), Error);
  m.stop();
  m.stop();  // idempotent
}

}  // namespace
}  // namespace tapesac::allocator
