// The emulated graph device (see graph_emulation.h).
#include "tapesac/replay/graph_emulation.h"

#include "tapesac/replay/eager_replayer.h"
#include "tapesac/common/clock.h"
#include "replay_guard.h"

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace tapesac::replay {
namespace {

using capture::NodeId;
using capture::NodeKind;
using capture::OpIndex;
using capture::OpPayload;

struct Node {
  OpIndex op = capture::kUnowned;
  std::vector<c10::IValue> args;
  std::vector<at::Tensor> outputs;
};

class EmulatedExec final : public capture::ExecGraph {
 public:
  explicit EmulatedExec(std::vector<Node> nodes) : nodes_(std::move(nodes)) {
    topo_.kinds.reserve(nodes_.size());
    for (const Node& n : nodes_) {
      topo_.kinds.push_back(n.op == capture::kUnowned ? NodeKind::kEmpty : NodeKind::kKernel);
      topo_.owner.push_back(n.op);
    }
    enabled_.assign(nodes_.size(), 1);
  }

  const capture::GraphTopology& topology() const override { return topo_; }

  void set_enabled(NodeId n, bool on) override {
    check(n, "set_enabled");
    if (!capture::can_disable(topo_.kinds[static_cast<size_t>(n)])) {
      throw std::invalid_argument(std::string("EmulatedExec::set_enabled: node ") + std::to_string(n) + " is a " +
                                  capture::to_string(topo_.kinds[static_cast<size_t>(n)]) +
                                  " node; only kernel, memcpy and memset nodes can be enabled or disabled");
    }
    enabled_[static_cast<size_t>(n)] = on ? 1 : 0;
  }

  bool enabled(NodeId n) const override {
    check(n, "enabled");
    return enabled_[static_cast<size_t>(n)] != 0;
  }

  void launch() override {
    if (current_ == nullptr) throw std::logic_error("EmulatedExec::launch: before_launch() was not called");
    ReplayDispatchGuard guard;  // Note [Replay outside the backward's transforms]
    GeneratorRestorer restorer;
    std::vector<at::Tensor> outs;
    for (size_t n = 0; n < nodes_.size(); ++n) {
      const Node& node = nodes_[n];
      if (node.op == capture::kUnowned || !enabled_[n]) continue;
      const common::Stopwatch clock;
      const OpPayload& p = current_->at(static_cast<size_t>(node.op));
      torch::jit::Stack stack(node.args.begin(), node.args.end());
      use_recorded_rng(p, stack, restorer);
      p.handle->callBoxed(stack);
      outs.clear();
      flatten_outputs(stack, outs);
      for (size_t j = 0; j < outs.size() && j < node.outputs.size(); ++j) {
        const at::Tensor& dst = node.outputs[j];
        const at::Tensor& src = outs[j];
        if (!dst.defined() || !src.defined()) continue;
        if (dst.data_ptr() == src.data_ptr() && dst.strides().equals(src.strides())) continue;  // view / in place
        dst.copy_(src);
      }
      if (timing_ != nullptr) {
        const auto i = static_cast<size_t>(node.op);
        if (i >= timing_->ns.size()) {
          timing_->ns.resize(i + 1, 0);
          timing_->records.resize(i + 1, 0);
        }
        timing_->ns[i] += clock.elapsed_ns();
        timing_->records[i] += 1;
      }
    }
  }

  /// While set, launch() charges each enabled node's run (the CPU clock) to its op in `*t`.
  void set_timing(capture::OpKernelTimes* t) { timing_ = t; }

  void set_current(const std::vector<OpPayload>* current) { current_ = current; }

 private:
  void check(NodeId n, const char* what) const {
    if (n < 0 || static_cast<size_t>(n) >= nodes_.size()) {
      throw std::invalid_argument(std::string("EmulatedExec::") + what + ": node " + std::to_string(n) +
                                  " outside the graph (" + std::to_string(nodes_.size()) + " nodes)");
    }
  }

  std::vector<Node> nodes_;
  capture::GraphTopology topo_;
  std::vector<uint8_t> enabled_;
  const std::vector<OpPayload>* current_ = nullptr;
  capture::OpKernelTimes* timing_ = nullptr;
};

class EmulatedLaunchTimer final : public capture::LaunchTimer {
 public:
  explicit EmulatedLaunchTimer(EmulatedExec& exec) : exec_(exec) { exec_.set_timing(&times_); }
  ~EmulatedLaunchTimer() override { exec_.set_timing(nullptr); }
  EmulatedLaunchTimer(const EmulatedLaunchTimer&) = delete;
  EmulatedLaunchTimer& operator=(const EmulatedLaunchTimer&) = delete;

  capture::OpTiming kind() const override { return capture::OpTiming::kCpuClock; }
  capture::OpKernelTimes finish(size_t n_ops) override {
    exec_.set_timing(nullptr);
    capture::OpKernelTimes out = std::move(times_);
    out.ns.resize(n_ops, 0);  // ops past the last enabled node ran nothing
    out.records.resize(n_ops, 0);
    return out;
  }

 private:
  EmulatedExec& exec_;
  capture::OpKernelTimes times_;
};

class EmulatedGraphDevice final : public capture::GraphDevice {
 public:
  explicit EmulatedGraphDevice(std::optional<c10::DeviceType> bound) : bound_(bound) {}
  const char* name() const override { return "emulated"; }
  bool capture_executes() const override { return true; }
  std::optional<c10::DeviceType> graph_device_type() const override { return bound_; }

  void begin_capture() override {
    if (capturing_) throw std::logic_error("EmulatedGraphDevice::begin_capture: a capture is already in progress");
    capturing_ = true;
    nodes_.clear();
    nodes_.push_back(Node{});  // the unowned entry node
  }

  void after_op(OpIndex op, const torch::jit::Stack& args, const std::vector<at::Tensor>& outputs) override {
    if (!capturing_) throw std::logic_error("EmulatedGraphDevice::after_op: no capture in progress");
    nodes_.push_back(Node{op, args, outputs});
  }

  std::unique_ptr<capture::ExecGraph> end_capture(std::string* error) override {
    if (!capturing_) {
      if (error != nullptr) *error = "no capture in progress";
      return nullptr;
    }
    capturing_ = false;
    return std::make_unique<EmulatedExec>(std::exchange(nodes_, {}));
  }

  void abort_capture() noexcept override {
    capturing_ = false;
    nodes_.clear();
  }

  std::string before_launch(capture::ExecGraph& exec, const std::vector<OpIndex>& random_ops,
                            const std::vector<OpPayload>& /*captured*/,
                            const std::vector<OpPayload>& current) override {
    for (OpIndex op : random_ops) {
      const OpPayload& p = current.at(static_cast<size_t>(op));
      if (!p.generator.has_value() || !p.generator_state) {
        return "random op #" + std::to_string(op) + " has no recorded generator state";
      }
    }
    static_cast<EmulatedExec&>(exec).set_current(&current);
    return "";
  }

  void after_launch(capture::ExecGraph& exec) noexcept override { static_cast<EmulatedExec&>(exec).set_current(nullptr); }

  void stage(const at::Tensor& dst, const at::Tensor& src) override { dst.copy_(src); }

  std::unique_ptr<capture::LaunchTimer> time_launch(capture::ExecGraph& exec, std::string* /*why*/) override {
    return std::make_unique<EmulatedLaunchTimer>(static_cast<EmulatedExec&>(exec));
  }

 private:
  std::optional<c10::DeviceType> bound_;
  bool capturing_ = false;
  std::vector<Node> nodes_;
};

}  // namespace

std::shared_ptr<capture::GraphDevice> make_emulated_graph_device(std::optional<c10::DeviceType> graph_device_type) {
  return std::make_shared<EmulatedGraphDevice>(graph_device_type);
}

}  // namespace tapesac::replay
