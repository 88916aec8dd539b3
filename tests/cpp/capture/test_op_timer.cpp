// The recorder's op-timer hook (capture/op_timer.h, Note [Op times]) through a fake OpTimer: with a timer the
// tape's durations are the timer's figures for every op and every bracket balances (composite ops nest); without
// one the CPU clock stays; a timer that throws or returns the wrong number of figures is cancelled once, leaves
// the CPU-clock figures and a note, and the next recorder on the thread is unaffected.
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tapesac/capture/op_timer.h"
#include "tapesac/capture/recorder.h"

namespace tapesac::capture {
namespace {

struct FakeLog {
  int begins = 0;
  int ends = 0;
  int finishes = 0;
  int cancels = 0;
  int depth = 0;
  int max_depth = 0;
  int calls_after_cancel = 0;
  size_t finish_n = 0;
  std::vector<OpIndex> begun;
};

int64_t fake_ns(size_t op) { return 1000 * static_cast<int64_t>(op + 1) + 7; }

class FakeTimer final : public OpTimer {
 public:
  struct Faults {
    int throw_at_begin = -1;  // the begin() call (0-based) that throws
    int throw_at_end = -1;
    bool throw_at_finish = false;
    int size_delta = 0;  // finish() returns n_ops + size_delta figures
  };
  FakeTimer(FakeLog* log, Faults faults, std::string note = {}) : log_(log), faults_(faults), note_(std::move(note)) {}
  ~FakeTimer() override = default;

  OpTiming kind() const override { return OpTiming::kCupti; }
  std::string note() const override { return note_; }
  void begin(OpIndex op) override {
    if (log_->cancels > 0) ++log_->calls_after_cancel;
    if (log_->begins++ == faults_.throw_at_begin) throw std::runtime_error("fake begin failure");
    log_->begun.push_back(op);
    log_->max_depth = std::max(log_->max_depth, ++log_->depth);
  }
  void end() override {
    if (log_->cancels > 0) ++log_->calls_after_cancel;
    if (log_->ends++ == faults_.throw_at_end) throw std::runtime_error("fake end failure");
    if (--log_->depth < 0) throw std::logic_error("end without begin");
  }
  std::vector<int64_t> finish(size_t n_ops) override {
    if (log_->cancels > 0) ++log_->calls_after_cancel;
    ++log_->finishes;
    log_->finish_n = n_ops;
    if (faults_.throw_at_finish) throw std::runtime_error("fake finish failure");
    std::vector<int64_t> ns(static_cast<size_t>(static_cast<int64_t>(n_ops) + faults_.size_delta));
    for (size_t i = 0; i < ns.size(); ++i) ns[i] = fake_ns(i);
    return ns;
  }
  void cancel() noexcept override { ++log_->cancels; }

 private:
  FakeLog* log_;
  Faults faults_;
  std::string note_;
};

struct Inputs {
  at::Tensor a = torch::randn({128, 128});
  at::Tensor w = torch::randn({64, 128});
  at::Tensor bias = torch::randn({64});
};

/// mm, relu, add: three ops recorded at autograd level.
void run_ops(const Inputs& in) {
  auto b = torch::mm(in.a, in.a);
  auto c = torch::relu(b);
  (void)(c + in.a);
}

std::vector<int64_t> durations(const Tape& t) {
  std::vector<int64_t> out;
  for (const OpRecord& op : t.ops()) out.push_back(op.duration_ns);
  return out;
}

TEST(OpTimer, RecorderUsesTheTimersFiguresForEveryOp) {
  Inputs in;
  FakeLog log;
  Recorder rec;
  rec.set_op_timer(std::make_unique<FakeTimer>(&log, FakeTimer::Faults{}, "fake note"));
  rec.start();
  run_ops(in);
  rec.stop();
  const Tape& t = rec.tape();
  ASSERT_EQ(t.ops().size(), 3u) << t.to_string();
  EXPECT_EQ(t.op_timing(), OpTiming::kCupti);
  EXPECT_EQ(rec.op_timing_note(), "fake note");
  for (size_t i = 0; i < t.ops().size(); ++i) EXPECT_EQ(t.ops()[i].duration_ns, fake_ns(i)) << "op " << i;
  EXPECT_EQ(log.finishes, 1);
  EXPECT_EQ(log.finish_n, 3u);
  EXPECT_EQ(log.begins, log.ends);
  EXPECT_EQ(log.depth, 0);
  EXPECT_EQ(log.cancels, 0);
  EXPECT_EQ(log.begun, (std::vector<OpIndex>{0, 1, 2}));
}

TEST(OpTimer, CompositeOpsNestAndEveryRecordedOpIsBracketed) {
  Inputs in;
  FakeLog log;
  Recorder rec;
  rec.set_op_timer(std::make_unique<FakeTimer>(&log, FakeTimer::Faults{}));
  rec.start();
  // aten::linear is CompositeImplicitAutograd on CPU: it decomposes (t, addmm) inside its own bracket.
  auto y = torch::linear(in.a, in.w, in.bias);
  (void)torch::relu(y);
  rec.stop();
  const Tape& t = rec.tape();
  ASSERT_GE(t.ops().size(), 2u) << t.to_string();
  EXPECT_GE(log.max_depth, 2);
  EXPECT_EQ(log.begins, log.ends);
  EXPECT_EQ(log.depth, 0);
  for (OpIndex i = 0; i < static_cast<OpIndex>(t.ops().size()); ++i) {
    EXPECT_NE(std::find(log.begun.begin(), log.begun.end(), i), log.begun.end()) << "op " << i << " not bracketed";
  }
  EXPECT_EQ(t.op_timing(), OpTiming::kCupti);
  for (size_t i = 0; i < t.ops().size(); ++i) EXPECT_EQ(t.ops()[i].duration_ns, fake_ns(i));
}

TEST(OpTimer, WithoutATimerTheCpuClockStays) {
  Inputs in;
  Recorder rec;
  rec.set_op_timer(nullptr, "no device here");
  rec.start();
  run_ops(in);
  rec.stop();
  EXPECT_EQ(rec.tape().op_timing(), OpTiming::kCpuClock);
  EXPECT_EQ(rec.op_timing_note(), "no device here");
  ASSERT_EQ(rec.tape().ops().size(), 3u);
  EXPECT_GT(rec.tape().ops()[0].duration_ns, 0);  // a 128^3 matmul takes measurable time

  RecorderOptions off;
  off.time_ops = false;
  Recorder untimed(off);
  untimed.start();
  run_ops(in);
  untimed.stop();
  EXPECT_EQ(untimed.tape().op_timing(), OpTiming::kUntimed);
  EXPECT_EQ(durations(untimed.tape()), std::vector<int64_t>(3, 0));
}

/// Runs the three ops with a faulty timer, checks the CPU fallback, then a healthy timer on the same thread.
void expect_clean_fallback(FakeTimer::Faults faults, const std::string& note_part, int expected_finishes) {
  Inputs in;
  FakeLog log;
  {
    Recorder rec;
    rec.set_op_timer(std::make_unique<FakeTimer>(&log, faults));
    rec.start();
    run_ops(in);
    rec.stop();
    const Tape& t = rec.tape();
    ASSERT_EQ(t.ops().size(), 3u) << t.to_string();
    EXPECT_TRUE(rec.error().empty()) << rec.error();  // the tape itself is complete
    EXPECT_EQ(t.op_timing(), OpTiming::kCpuClock);
    EXPECT_NE(rec.op_timing_note().find(note_part), std::string::npos) << rec.op_timing_note();
    EXPECT_NE(rec.op_timing_note().find("cupti"), std::string::npos) << rec.op_timing_note();
    for (size_t i = 0; i < t.ops().size(); ++i) EXPECT_NE(t.ops()[i].duration_ns, fake_ns(i));
    EXPECT_GT(t.ops()[0].duration_ns, 0);  // the CPU clock's figure for the matmul
    EXPECT_EQ(log.cancels, 1);
    EXPECT_EQ(log.calls_after_cancel, 0);
    EXPECT_EQ(log.finishes, expected_finishes);
  }
  EXPECT_EQ(Recorder::current(), nullptr);
  FakeLog ok;
  Recorder next;
  next.set_op_timer(std::make_unique<FakeTimer>(&ok, FakeTimer::Faults{}));
  next.start();
  run_ops(in);
  next.stop();
  EXPECT_EQ(next.tape().op_timing(), OpTiming::kCupti);
  EXPECT_EQ(durations(next.tape()), (std::vector<int64_t>{fake_ns(0), fake_ns(1), fake_ns(2)}));
  EXPECT_TRUE(next.op_timing_note().empty());
}

TEST(OpTimer, BeginFailureFallsBackToCpuClock) {
  FakeTimer::Faults f;
  f.throw_at_begin = 1;
  expect_clean_fallback(f, "fake begin failure", 0);
}

TEST(OpTimer, EndFailureFallsBackToCpuClock) {
  FakeTimer::Faults f;
  f.throw_at_end = 2;
  expect_clean_fallback(f, "fake end failure", 0);
}

TEST(OpTimer, FinishFailureFallsBackToCpuClock) {
  FakeTimer::Faults f;
  f.throw_at_finish = true;
  expect_clean_fallback(f, "fake finish failure", 1);
}

TEST(OpTimer, WrongNumberOfFiguresIsRejected) {
  FakeTimer::Faults f;
  f.size_delta = -1;
  expect_clean_fallback(f, "expected 3 op times, got 2", 1);
}

TEST(OpTimer, TimerIsSetBeforeStart) {
  Recorder rec;
  rec.start();
  FakeLog log;
  EXPECT_THROW(rec.set_op_timer(std::make_unique<FakeTimer>(&log, FakeTimer::Faults{})), std::logic_error);
  rec.stop();
}

TEST(OpTimer, DeviceTimersWithoutADeviceSayWhy) {
  std::string why;
  std::unique_ptr<OpTimer> t = device_op_timers(0)->make("block", &why);
  if (t) {
    // A machine with a device: the timer is one of the device kinds.
    EXPECT_TRUE(t->kind() == OpTiming::kCupti || t->kind() == OpTiming::kCudaEvents);
    t->cancel();
    return;
  }
  EXPECT_NE(why.find("CPU clock"), std::string::npos) << why;
  std::string why_bad;
  EXPECT_EQ(device_op_timers(-1)->make("block", &why_bad), nullptr);
  EXPECT_FALSE(why_bad.empty());
}

TEST(OpTimer, TapeSetOpTimesChecksTheSize) {
  Tape t;
  t.add_storage(true, 4);
  EXPECT_THROW(t.set_op_times(OpTiming::kCudaEvents, {1}), std::invalid_argument);
  EXPECT_EQ(t.op_timing(), OpTiming::kUntimed);
  t.set_op_times(OpTiming::kCudaEvents, {});
  EXPECT_EQ(t.op_timing(), OpTiming::kCudaEvents);
  EXPECT_STREQ(op_timing_name(OpTiming::kCudaEvents), "cuda_events");
  EXPECT_STREQ(op_timing_name(OpTiming::kCpuClock), "cpu_clock");
  EXPECT_STREQ(op_timing_name(OpTiming::kCupti), "cupti");
}

}  // namespace
}  // namespace tapesac::capture
