// CudaGraphDevice: the CUDA implementation of capture::GraphDevice (its contract is in
// tapesac/capture/graph_device.h). Captures with GraphCapture (at::cuda::CUDAGraph, keep_graph=true, a side stream,
// cudaStreamCaptureModeThreadLocal, per-op node attribution) into the pool it was given, hands out CudaExecGraphs,
// makes a graph's random ops draw what the replayed forward drew, and stages inputs on the launch stream.
//
// Contract (beyond capture::GraphDevice).
//  * One device object per CUDA device index; the pool {first, second} is a MempoolId_t ({0, 0}: each capture gets
//    a fresh private pool; the replay arena's id: every capture of this device allocates from the arena).
//  * begin_capture() makes the capture's side stream current on the device (after the caller's stream's work);
//    end_capture() and abort_capture() restore the caller's device and current stream (which then waits for the
//    side stream), also when the capture failed. The thread's capture interaction mode is never changed.
//  * before_launch() first orders the launch after the graph's previous one when the current stream differs from
//    the stream that one ran on (an event on the old stream, waited for on the new one): the static buffers are
//    reused across launches with no allocator stream tracking. Then Note [Graph RNG] in graph_device.cpp. It refuses (returns why) when a random op drew from a
//    generator other than this device's default CUDA generator, when a payload has no generator state, or when the
//    offsets the replayed forward drew at are not spaced as in the call the graph was captured from. Otherwise it
//    sets the default generator to the state the forward's first random op saw; after_launch() puts back the state
//    it saved. Both lock the generator's mutex while they touch it.
//  * time_launch(): a CUPTI session from right before the launch to finish(), which synchronises the device and
//    charges each kernel/memcpy/memset record to the op owning its executable node; records of no node (the
//    launch's RNG prologue, staging copies still running) are unattributed.
//  * stage(dst, src): dst.copy_(src, non_blocking) on the current stream; shapes and dtypes must match (no
//    broadcasting).
//  * Every method needs a CUDA device; begin_capture/after_op/stage throw (std::runtime_error / tapesac::Error) on
//    failure; end_capture reports failures through `error`; abort_capture and after_launch never throw.
//  Not thread-safe: one capture at a time, all calls on the replaying thread. Includes no CUDA headers.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <string>
#include <vector>

#include "tapesac/capture/graph_device.h"

namespace tapesac::cuda {

class GraphCapture;

class CudaGraphDevice final : public capture::GraphDevice {
 public:
  /// `device`: a CUDA device index (< device_count()); throws tapesac::Error (kConfig) otherwise.
  /// `map_exec_nodes`: map each capture's executable nodes to tape ops (GraphCaptureOptions::map_exec_nodes), so
  /// that its launches can be timed per op.
  CudaGraphDevice(int device, uint64_t pool_first, uint64_t pool_second, bool map_exec_nodes = true);
  ~CudaGraphDevice() override;
  CudaGraphDevice(const CudaGraphDevice&) = delete;
  CudaGraphDevice& operator=(const CudaGraphDevice&) = delete;

  const char* name() const override { return "cuda_graph"; }
  std::optional<c10::DeviceType> graph_device_type() const override { return c10::DeviceType::CUDA; }
  int graph_device_index() const override { return device_; }
  /// The cuBLAS workspace of this device's capture stream (capture_workspace_bytes()).
  int64_t capture_overhead_bytes() const override;
  /// What the allocator freed on this device during the last capture (GraphCapture::freed()).
  std::vector<capture::AddressRange> freed_during_capture() const override { return last_freed_; }
  void begin_capture() override;
  void after_op(capture::OpIndex op, const torch::jit::Stack& args, const std::vector<at::Tensor>& outputs) override;
  std::unique_ptr<capture::ExecGraph> end_capture(std::string* error) override;
  void abort_capture() noexcept override;
  std::string before_launch(capture::ExecGraph& exec, const std::vector<capture::OpIndex>& random_ops,
                            const std::vector<capture::OpPayload>& captured,
                            const std::vector<capture::OpPayload>& current) override;
  void after_launch(capture::ExecGraph& exec) noexcept override;
  void stage(const at::Tensor& dst, const at::Tensor& src) override;
  /// CUPTI around the launch, attributed through the executable's node map (Note [Graph launch times]); null when
  /// the graph was not mapped at instantiation or CUPTI cannot be claimed now (a profiler holds it).
  std::unique_ptr<capture::LaunchTimer> time_launch(capture::ExecGraph& exec, std::string* why) override;

  int device() const { return device_; }
  /// True between begin_capture() and end_capture()/abort_capture().
  bool capturing() const { return capture_ != nullptr; }

 private:
  struct DeviceGuard;
  void release_capture() noexcept;
  void restore_generator() noexcept;
  void order_after_last_launch(const capture::ExecGraph& exec);

  int device_;
  uint64_t pool_first_, pool_second_;
  bool map_exec_nodes_;
  std::unique_ptr<GraphCapture> capture_;
  std::vector<capture::AddressRange> last_freed_;
  std::unique_ptr<DeviceGuard> device_guard_;  // the caller's device, restored after the capture's stream
  /// The default generator's state saved by before_launch(), put back by after_launch().
  std::optional<at::Generator> saved_generator_;
  c10::intrusive_ptr<c10::TensorImpl> saved_state_;
  /// The stream (a cudaStream_t) each graph last launched on.
  std::unordered_map<const capture::ExecGraph*, void*> last_stream_;
};

/// A CudaGraphDevice as the replayer holds it (the binding's `tapesac._C.cuda_graph_device`).
std::shared_ptr<capture::GraphDevice> make_cuda_graph_device(int device, uint64_t pool_first, uint64_t pool_second,
                                                             bool map_exec_nodes = true);

}  // namespace tapesac::cuda
