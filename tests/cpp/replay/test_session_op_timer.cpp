// The Session's device-timing hook (SessionOptions::op_timers): every block call gets a timer from the factory
// (named after its block), the tape the planner observes at close of the forward carries the timer's figures,
// and BlockStats says where the times came from — or why they are the CPU clock.
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tapesac/capture/op_timer.h"
#include "tapesac/replay/session.h"

namespace tapesac::replay {
namespace {

using capture::OpIndex;
using capture::OpTiming;

/// Device-timer stand-in: every op costs 500 ns per op index + 1 (events kind); refuses blocks named "cpu".
class FixedTimer final : public capture::OpTimer {
 public:
  OpTiming kind() const override { return OpTiming::kCudaEvents; }
  std::string note() const override { return "fixed"; }
  void begin(OpIndex /*op*/) override {}
  void end() override {}
  std::vector<int64_t> finish(size_t n_ops) override {
    std::vector<int64_t> ns(n_ops);
    for (size_t i = 0; i < n_ops; ++i) ns[i] = 500 * static_cast<int64_t>(i + 1);
    return ns;
  }
  void cancel() noexcept override {}
};

class FixedFactory final : public capture::OpTimerFactory {
 public:
  std::unique_ptr<capture::OpTimer> make(const std::string& block, std::string* why) override {
    blocks.push_back(block);
    if (block == "cpu") {
      *why = "refused for the test";
      return nullptr;
    }
    return std::make_unique<FixedTimer>();
  }
  std::vector<std::string> blocks;
};

TEST(SessionOpTimer, BlockCallsGetTheFactorysTimesAndSayWhere) {
  auto factory = std::make_shared<FixedFactory>();
  SessionOptions o;
  o.policy = PolicyKind::kFull;
  o.op_timers = factory;
  Session s(o);
  std::vector<std::vector<int64_t>> observed;
  std::vector<OpTiming> timings;
  s.set_tape_observer([&](const BlockTapeView& v) {
    std::vector<int64_t> d;
    for (const auto& op : v.tape.ops()) d.push_back(op.duration_ns);
    observed.push_back(d);
    timings.push_back(v.tape.op_timing());
  });
  auto w = torch::randn({64, 64});
  auto x = torch::randn({64, 64});
  s.begin_step({w});
  for (const char* name : {"dev", "cpu"}) {
    ASSERT_NE(s.begin_block(name), nullptr);
    auto y = torch::relu(torch::mm(x, w));
    s.end_block();
  }
  s.end_step();
  EXPECT_EQ(factory->blocks, (std::vector<std::string>{"dev", "cpu"}));
  ASSERT_EQ(observed.size(), 2u);
  EXPECT_EQ(timings[0], OpTiming::kCudaEvents);
  EXPECT_EQ(observed[0], (std::vector<int64_t>{500, 1000}));
  EXPECT_EQ(timings[1], OpTiming::kCpuClock);
  ASSERT_EQ(observed[1].size(), 2u);
  EXPECT_GT(observed[1][0], 0);  // the CPU clock timed the matmul
  const auto& st = s.last_stats();
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(st[0].op_timing, "cuda_events");
  EXPECT_EQ(st[0].op_timing_note, "fixed");
  EXPECT_EQ(st[1].op_timing, "cpu_clock");
  EXPECT_EQ(st[1].op_timing_note, "refused for the test");
  s.shutdown();
}

TEST(SessionOpTimer, WithoutAFactoryTheCpuClockIsUsed) {
  SessionOptions o;
  o.policy = PolicyKind::kNone;
  Session s(o);
  auto x = torch::randn({64, 64});
  s.begin_step({});
  ASSERT_NE(s.begin_block("b"), nullptr);
  auto y = torch::mm(x, x);
  s.end_block();
  s.end_step();
  ASSERT_EQ(s.last_stats().size(), 1u);
  EXPECT_EQ(s.last_stats()[0].op_timing, "cpu_clock");
  EXPECT_EQ(s.last_stats()[0].op_timing_note, "");
  s.shutdown();
}

}  // namespace
}  // namespace tapesac::replay
