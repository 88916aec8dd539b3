// The dispatch hook (capture/dispatch_hook.h, Note [Dispatch hook]): which calls observers see, at what depth, what
// nested calls cost, how the key leaves a thread, and that the recorder builds the same tape through it as through
// at::RecordFunction.
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "tapesac/capture/dispatch_hook.h"
#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/recorder.h"

namespace tapesac::capture {
namespace {

/// Logs every call it is told about as "depth:name"; asks for nested calls when `nested` is set.
class LogObserver : public CallObserver {
 public:
  explicit LogObserver(bool nested) : nested_(nested) {}
  bool on_call_enter(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int depth) noexcept override {
    log.push_back(std::to_string(depth) + ":" + op.schema().name() + "." + op.schema().overload_name());
    args_seen += args.size();
    ++open;
    return nested_;
  }
  void on_call_exit(const c10::OperatorHandle& /*op*/, c10::ArrayRef<c10::IValue> returns) noexcept override {
    --open;
    returns_seen += returns.size();
  }
  std::vector<std::string> log;
  size_t args_seen = 0;
  size_t returns_seen = 0;
  int open = 0;

 private:
  bool nested_;
};

bool key_included() { return c10::impl::tls_is_dispatch_key_included(dispatch_hook::kKey); }

class DispatchHook : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!dispatch_hook::available()) GTEST_SKIP() << "the dispatch hook's key has another fallback in this process";
  }
};

TEST_F(DispatchHook, ObserversSeeTopLevelCallsAndTheKeyGoesWithTheLastOne) {
  auto a = torch::randn({4, 4}, torch::requires_grad());
  LogObserver o(/*nested=*/false);
  EXPECT_FALSE(key_included());
  dispatch_hook::attach(&o);
  EXPECT_TRUE(key_included());
  EXPECT_TRUE(dispatch_hook::attached(&o));
  auto y = torch::tanh(a).mul(2.0);
  dispatch_hook::detach(&o);
  EXPECT_FALSE(key_included());
  EXPECT_FALSE(dispatch_hook::attached(&o));
  (void)torch::tanh(y);  // after detach: not seen
  EXPECT_EQ(o.log, (std::vector<std::string>{"0:aten::tanh.", "0:aten::mul.Scalar"}));
  EXPECT_EQ(o.open, 0);
  EXPECT_EQ(o.returns_seen, 2u);
  EXPECT_EQ(o.args_seen, 3u);  // tanh(self), mul(self, other)
}

TEST_F(DispatchHook, NestedCallsAreSeenAtAutogradLevelOnly) {
  // aten::linear is CompositeImplicitAutograd on CPU: its children (t, addmm) run at autograd level. addmm's own
  // kernel runs below autograd: what it calls is never told.
  auto x = torch::randn({3, 4});
  auto w = torch::randn({5, 4}, torch::requires_grad());
  auto b = torch::randn({5}, torch::requires_grad());
  LogObserver with(/*nested=*/true);
  dispatch_hook::attach(&with);
  (void)torch::linear(x, w, b);
  dispatch_hook::detach(&with);
  EXPECT_EQ(with.log, (std::vector<std::string>{"0:aten::linear.", "1:aten::t.", "1:aten::addmm."}));

  LogObserver without(/*nested=*/false);
  dispatch_hook::attach(&without);
  (void)torch::linear(x, w, b);
  dispatch_hook::detach(&without);
  EXPECT_EQ(without.log, (std::vector<std::string>{"0:aten::linear."}));
}

TEST_F(DispatchHook, TwoObserversEachSeeTheCallsAndDetachInAnyOrder) {
  auto a = torch::randn({2, 2});
  LogObserver first(false), second(true);
  dispatch_hook::attach(&first);
  dispatch_hook::attach(&second);
  dispatch_hook::attach(&first);  // attaching twice is a no-op
  (void)torch::relu(a);
  dispatch_hook::detach(&first);
  EXPECT_TRUE(key_included());
  (void)torch::sigmoid(a);
  dispatch_hook::detach(&second);
  EXPECT_FALSE(key_included());
  EXPECT_EQ(first.log, (std::vector<std::string>{"0:aten::relu."}));
  EXPECT_EQ(second.log, (std::vector<std::string>{"0:aten::relu.", "0:aten::sigmoid."}));
  dispatch_hook::detach(&second);  // not attached: a no-op
}

TEST_F(DispatchHook, AThrowingCallStillExitsAndTheKeyStaysConsistent) {
  auto a = torch::randn({2, 3});
  auto b = torch::randn({4, 5});
  LogObserver o(false);
  dispatch_hook::attach(&o);
  EXPECT_THROW((void)torch::mm(a, b), c10::Error);
  EXPECT_EQ(o.open, 0);
  EXPECT_EQ(o.returns_seen, 0u);
  EXPECT_TRUE(key_included());
  (void)torch::relu(a);  // the depth came back to 0
  dispatch_hook::detach(&o);
  EXPECT_EQ(o.log, (std::vector<std::string>{"0:aten::mm.", "0:aten::relu."}));
}

TEST_F(DispatchHook, AThreadWithTheKeyButNoObserverDropsTheKeyAtItsFirstCall) {
  // What the autograd engine's copy of a step thread's state looks like on another thread.
  std::thread other([] {
    c10::impl::tls_set_dispatch_key_included(dispatch_hook::kKey, true);
    auto a = torch::randn({2, 2});
    (void)torch::relu(a);
    EXPECT_FALSE(key_included());
  });
  other.join();
}

TEST_F(DispatchHook, ObserversArePerThread) {
  auto a = torch::randn({2, 2});
  LogObserver mine(false);
  dispatch_hook::attach(&mine);
  std::thread other([&a] {
    EXPECT_FALSE(key_included());
    (void)torch::relu(a);
  });
  other.join();
  (void)torch::sigmoid(a);
  dispatch_hook::detach(&mine);
  EXPECT_EQ(mine.log, (std::vector<std::string>{"0:aten::sigmoid."}));
}

/// Op names and data flow of a tape, for comparing two recordings of the same code.
std::string tape_summary(const Tape& t) {
  std::ostringstream s;
  for (const OpRecord& op : t.ops()) {
    s << op_kind_name(op.kind) << "(";
    for (const ArgRef& a : op.inputs) s << a.arg << "=v" << a.value << " ";
    s << ")->";
    for (ValueId v : op.outputs) s << "v" << v << " ";
    s << "f" << op.flags << "\n";
  }
  return s.str();
}

std::string record(RecorderHook hook) {
  torch::manual_seed(0);
  auto x = torch::randn({3, 8}, torch::requires_grad());
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto b = torch::randn({8}, torch::requires_grad());
  RecorderOptions options;
  options.hook = hook;
  Recorder rec(options);
  rec.start();
  EXPECT_EQ(rec.hook(), hook);
  auto h = torch::linear(x, w, b);          // composite: t, addmm
  h = torch::dropout(h, 0.5, true);         // composite: random children
  auto g = h.clone();
  g.mul_(torch::sigmoid(x.narrow(1, 0, 8)));  // in place: its autograd kernel clones self at autograd level
  g.narrow(1, 0, 4).add_(1.0);              // in place on a view
  auto parts = g.split(4, 1);               // multiple outputs
  (void)(parts[0] * parts[1]).sum();
  rec.stop();
  EXPECT_TRUE(rec.error().empty()) << rec.error();
  return tape_summary(rec.tape());
}

TEST_F(DispatchHook, TheRecorderBuildsTheSameTapeThroughEitherHook) {
  const std::string hooked = record(RecorderHook::kDispatchKey);
  const std::string rf = record(RecorderHook::kRecordFunction);
  EXPECT_EQ(hooked, rf);
  EXPECT_NE(hooked.find("aten::clone"), std::string::npos) << "mul_'s autograd-level clone is missing:\n" << hooked;
  EXPECT_NE(hooked.find("aten::addmm"), std::string::npos) << hooked;
  EXPECT_EQ(hooked.find("aten::linear"), std::string::npos) << hooked;
}

TEST(RecorderHook, NamesRoundTripAndTheDefaultCanBeChanged) {
  for (RecorderHook h : {RecorderHook::kDefault, RecorderHook::kAuto, RecorderHook::kDispatchKey,
                         RecorderHook::kRecordFunction}) {
    EXPECT_EQ(parse_recorder_hook(recorder_hook_name(h)), h);
  }
  EXPECT_THROW(parse_recorder_hook("tls"), std::invalid_argument);
  EXPECT_THROW(set_default_recorder_hook(RecorderHook::kDefault), std::invalid_argument);
  const RecorderHook was = default_recorder_hook();
  set_default_recorder_hook(RecorderHook::kRecordFunction);
  Recorder rec;
  rec.start();
  EXPECT_EQ(rec.hook(), RecorderHook::kRecordFunction);
  EXPECT_FALSE(c10::impl::tls_is_dispatch_key_included(dispatch_hook::kKey));
  rec.stop();
  set_default_recorder_hook(was);
}

}  // namespace
}  // namespace tapesac::capture
