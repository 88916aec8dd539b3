// What the graph replayer (replay/graph_block.h) asks of the device that captures and launches executable graphs.
// Two implementations: tapesac::cuda::CudaGraphDevice (capture/cuda/graph_device.h: at::cuda::CUDAGraph capture with
// per-op node attribution, CUDA builds only) and replay::EmulatedGraphDevice (replay/graph_emulation.h: an
// executable graph emulated with eager ops over static tensors, on any device, so the graph replayer's logic —
// static buffers, staging, node disabling, relaunch liveness, RNG — is exercised end to end on CPU).
//
// Contract (one capture at a time per device object; all calls on the thread that replays):
//  * begin_capture(): from now on, work issued on this thread is captured (CUDA: a side stream under
//    cudaStreamCaptureModeThreadLocal; allocations come from the graph's pool, the replay arena when the device was
//    given one). The static input tensors were allocated before; every tensor allocated until end_capture() lives
//    at a fixed address for the graph's lifetime as long as the caller holds it.
//  * after_op(op, args, outputs): tape op `op` was just issued with the boxed arguments `args` (tensors filled in,
//    before the call) and returned `outputs` (flattened in return order; undefined for a None output). Ops are
//    issued in tape order. The CUDA device attributes the nodes added since the previous op to `op`.
//  * end_capture(): the executable graph, or null with `*error` saying why the capture failed (then nothing of it
//    is left behind). abort_capture() ends a capture that the caller abandons (an exception mid-run); never throws.
//  * before_launch(exec, random_ops, captured, current): make the graph's random ops (`random_ops`, ascending tape
//    order, all of them enabled or not) draw exactly the numbers the forward of the block call being replayed drew.
//    `captured` are the payloads of the block call the graph was captured from, `current` those of the call being
//    replayed (both indexed by OpIndex). Returns "" when the launch may go ahead (then after_launch() must follow,
//    also when the launch throws), or why it cannot (the caller replays eagerly; nothing to undo).
//  * stage(dst, src): copies `src` into the static tensor `dst` on the stream the graph launches on.
//  * time_launch(exec, why): Note [Graph launch times]. Null, with `why`, when this device or this graph cannot be
//    timed per op.
//
// Note [Graph launch times]. A launch is one call; its kernels run without the host. The per-op device time of a
// launch comes from the device: the CUDA device subscribes CUPTI around the launch and attributes each kernel,
// memcpy and memset record to a tape op through the executable-node ids the instantiation cloned (Note [Kernel
// time attribution]); a graph instantiated while CUPTI was held elsewhere has no such map and is not timed. The
// emulation charges each enabled node's eager run on the CPU clock. A timed launch costs the device one
// synchronisation (LaunchTimer::finish), which is why the replayer times only the first launch of each graph
// unless asked otherwise (GraphOptions::time_launches).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include "tapesac/capture/exec_graph.h"
#include "tapesac/capture/kernel_times.h"
#include "tapesac/capture/op_payload.h"

namespace tapesac::capture {

/// Times one launch of one executable graph (Note [Graph launch times]). Made right before the launch; finish()
/// right after it.
class LaunchTimer {
 public:
  virtual ~LaunchTimer() = default;
  /// What the figures are: kCupti (device time of the nodes' kernels) or kCpuClock (the emulation).
  virtual OpTiming kind() const = 0;
  /// Waits for the launch and returns the time of each tape op [0, n_ops) (ops whose nodes were disabled: 0) and
  /// of the records no op owns. Called once. May throw std::exception (the launch itself has happened).
  virtual OpKernelTimes finish(size_t n_ops) = 0;
};

/// A byte range of device memory.
struct AddressRange {
  uintptr_t begin = 0;
  size_t bytes = 0;
};

class GraphDevice {
 public:
  virtual ~GraphDevice() = default;
  /// "cuda_graph" or "emulated".
  virtual const char* name() const = 0;
  /// True when the capture run really executes the ops (the emulation): it then draws random numbers like an
  /// eager replay (each random op at its recorded state, the live generators untouched). A CUDA capture executes
  /// nothing and must leave the generators alone: its random kernels take their offsets from the launch.
  virtual bool capture_executes() const { return false; }
  /// The device type whose memory the graph's nodes read and write (CUDA: kCUDA), or none when a capture runs every
  /// op as it is, on any device (the emulation's default). A graph bound to a device type is captured only when
  /// every captured op reads and makes tensors there (Note [Host tensors under capture], replay/graph_block.h).
  virtual std::optional<c10::DeviceType> graph_device_type() const { return std::nullopt; }
  /// The index of the device the graph is captured on (CUDA: the capture stream's device), or -1 when any index of
  /// graph_device_type() will do (the emulation). Stream capture is per stream: the ops of a block that runs on
  /// another CUDA device would execute on that device's current stream, uncaptured, and the graph would come out
  /// empty (a reviewer's finding), so a key whose captured ops read another index is refused like a host tensor.
  virtual int graph_device_index() const { return -1; }
  /// Bytes the device holds for capturing at all, once, whatever the number of graphs (CUDA: the cuBLAS workspace
  /// of its capture stream); the graph cache counts them in its static bytes.
  virtual int64_t capture_overhead_bytes() const { return 0; }
  /// The memory the last capture freed while it ran (an op's scratch, which a later op of the same capture may have
  /// been given: Note [Staged values and captured scratch], replay/graph_block.h). Empty when this device cannot
  /// tell (the emulation runs every op on its own static tensors: no such reuse).
  virtual std::vector<AddressRange> freed_during_capture() const { return {}; }
  virtual void begin_capture() = 0;
  virtual void after_op(OpIndex op, const torch::jit::Stack& args, const std::vector<at::Tensor>& outputs) = 0;
  virtual std::unique_ptr<ExecGraph> end_capture(std::string* error) = 0;
  virtual void abort_capture() noexcept = 0;
  virtual std::string before_launch(ExecGraph& exec, const std::vector<OpIndex>& random_ops,
                                    const std::vector<OpPayload>& captured, const std::vector<OpPayload>& current) = 0;
  virtual void after_launch(ExecGraph& exec) noexcept = 0;
  virtual void stage(const at::Tensor& dst, const at::Tensor& src) = 0;
  /// A timer for the next launch of `exec` (call before_launch() first), or null with `*why` set.
  virtual std::unique_ptr<LaunchTimer> time_launch(ExecGraph& /*exec*/, std::string* why) {
    *why = std::string("the ") + name() + " graph device does not time launches";
    return nullptr;
  }
};

}  // namespace tapesac::capture
