// CudaGraphDevice (see tapesac/cuda/graph_device.h). Written against the at::cuda::CUDAGraph and generator subset
// shared by torch 2.11 and 2.14 (reference/cuda.md §B1, §B6): no CUDAGeneratorImpl internals, only the public
// GeneratorImpl get_state()/set_state() of the default CUDA generator.
//
// Note [Graph RNG]. A graph captured through at::cuda::CUDAGraph bakes each random op's *intragraph* offset g_i
// (the sum of the rounded increments of the random ops captured before it) into its kernel; at each launch the
// replay prologue reads the default generator's host (seed, offset) = (s, base) and the op draws (s, base + g_i),
// then the host offset advances by the whole-graph increment. The forward of the call being replayed drew op i at
// (s_i, o_i), recorded in OpPayload::generator_state (get_state(): 8 bytes seed, 8 bytes offset). Setting the
// generator to (s_0, o_0) of the first random op before the launch makes op i draw (s_0, o_0 + g_i), which is
// (s_i, o_i) exactly when every forward op drew from this generator, the seed did not change between them, and
// o_i - o_0 = g_i. The capture re-ran the captured call's ops from a fresh intragraph offset without drawing
// anything else, so its g_i - g_0 are the captured call's o_i - o_0 when that call drew nothing in between either;
// requiring the current call's offset deltas to equal the captured call's detects a gap (something outside the
// tape drew in between) in the current call. Anything else is refused and the block replays eagerly.
#include "tapesac/cuda/graph_device.h"

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>

#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include "tapesac/common/errors.h"
#include "tapesac/cuda/device.h"
#include "tapesac/cuda/event.h"
#include "tapesac/cuda/cupti_timer.h"
#include "tapesac/cuda/graph_capture.h"

namespace tapesac::cuda {

namespace {

/// Where one random op drew: (seed, offset) of the generator just before it ran.
struct RngPoint {
  uint64_t seed = 0;
  int64_t offset = 0;
};

std::string op_name(capture::OpIndex op) { return "random op #" + std::to_string(op); }

/// Reads the payload of random op `op`; "" on success, else why the graph cannot reproduce it.
std::string read_point(const std::vector<capture::OpPayload>& payloads, capture::OpIndex op, const char* which,
                       const c10::GeneratorImpl* default_impl, int device, RngPoint* out) {
  if (op < 0 || static_cast<size_t>(op) >= payloads.size()) {
    return op_name(op) + " is outside the " + which + " call's " + std::to_string(payloads.size()) + " payloads";
  }
  const capture::OpPayload& p = payloads[static_cast<size_t>(op)];
  if (!p.generator.has_value() || !p.generator->defined() || !p.generator_state) {
    return op_name(op) + " of the " + which + " call has no recorded generator state";
  }
  const c10::GeneratorImpl* impl = p.generator->unsafeGetGeneratorImpl();
  if (!impl->device().is_cuda()) {
    return op_name(op) + " of the " + which + " call drew from a " + impl->device().str() +
           " generator; a CUDA graph's random ops draw from the default CUDA generator only";
  }
  if (impl != default_impl) {
    return op_name(op) + " of the " + which + " call drew from a non-default generator on " + impl->device().str() +
           "; a CUDA graph's random ops draw from the default CUDA generator of cuda:" + std::to_string(device) +
           " only";
  }
  const at::Tensor state(p.generator_state);
  if (!state.device().is_cpu() || state.scalar_type() != at::kByte || state.numel() != 16 || !state.is_contiguous()) {
    return op_name(op) + " of the " + which + " call has a generator state of " + std::to_string(state.numel()) +
           " " + std::string(c10::toString(state.scalar_type())) +
           " elements; expected the CUDA generator's 16 contiguous CPU bytes (seed, offset)";
  }
  const auto* bytes = state.const_data_ptr<uint8_t>();
  std::memcpy(&out->seed, bytes, sizeof(uint64_t));
  std::memcpy(&out->offset, bytes + sizeof(uint64_t), sizeof(int64_t));
  return "";
}

}  // namespace

struct CudaGraphDevice::DeviceGuard {
  explicit DeviceGuard(int device) : guard(static_cast<c10::DeviceIndex>(device)) {}
  c10::cuda::CUDAGuard guard;
};

CudaGraphDevice::CudaGraphDevice(int device, uint64_t pool_first, uint64_t pool_second, bool map_exec_nodes)
    : device_(device), pool_first_(pool_first), pool_second_(pool_second), map_exec_nodes_(map_exec_nodes) {
  const int n = device_count();
  TAPESAC_CHECK(device >= 0 && device < n, kConfig, "cuda_graph device: expected a CUDA device index in [0, ", n,
                "), got ", device, n == 0 ? "; this process sees no CUDA device (use backend=\"eager\")" : "");
  TAPESAC_CHECK(pool_first == 0 || pool_second == 0, kConfig,
                "cuda_graph device: a memory pool id has exactly one non-zero half ({0, 0}: a private pool), got {",
                pool_first, ", ", pool_second, "}");
  if (map_exec_nodes_ && !torch::profiler::impl::profilerEnabled()) {
    // CUPTI initialised for the first time while CUDA graphs exist can hang or fault (pytorch#75504; torch's
    // profiler initialises it before graphs for that reason): claim and release it once now, before any capture
    // of ours. Failure here only means that launches will not be timed; the reason shows then.
    std::string why;
    if (std::unique_ptr<CuptiTimer> t = CuptiTimer::start(&why)) {
      try {
        (void)t->stop();
      } catch (const std::exception&) {
        // A failed flush at start-up loses nothing; the timer's destructor has released CUPTI.
      }
    }
  }
}

CudaGraphDevice::~CudaGraphDevice() {
  release_capture();
  restore_generator();
}

void CudaGraphDevice::release_capture() noexcept {
  // Order matters: the capture restores the caller's stream on the capture device first, then the device guard
  // restores the caller's device.
  capture_.reset();
  device_guard_.reset();
}

void CudaGraphDevice::begin_capture() {
  if (capture_) {
    throw std::logic_error("CudaGraphDevice::begin_capture: a capture is already in progress; call end_capture() or "
                           "abort_capture() first");
  }
  device_guard_ = std::make_unique<DeviceGuard>(device_);
  last_freed_.clear();
  try {
    capture_ = std::make_unique<GraphCapture>(GraphCaptureOptions{pool_first_, pool_second_, map_exec_nodes_});
    capture_->begin();
  } catch (...) {
    release_capture();
    throw;
  }
}

void CudaGraphDevice::after_op(capture::OpIndex op, const torch::jit::Stack& /*args*/,
                               const std::vector<at::Tensor>& /*outputs*/) {
  if (!capture_) {
    throw std::logic_error("CudaGraphDevice::after_op: no capture in progress (call begin_capture() first)");
  }
  capture_->after_op(op);
}

std::unique_ptr<capture::ExecGraph> CudaGraphDevice::end_capture(std::string* error) {
  auto fail = [&](std::string why) -> std::unique_ptr<capture::ExecGraph> {
    if (error != nullptr) *error = std::move(why);
    return nullptr;
  };
  if (!capture_) return fail("CudaGraphDevice::end_capture: no capture in progress (call begin_capture() first)");
  CaptureOutcome outcome;
  try {
    outcome = capture_->end();
  } catch (const std::exception& e) {
    outcome.graph.reset();
    outcome.error = e.what();
  }
  last_freed_ = capture_->freed();
  release_capture();
  if (!outcome.graph) {
    return fail(outcome.error.empty() ? std::string("the CUDA graph capture failed without an error message")
                                      : outcome.error);
  }
  if (error != nullptr) error->clear();
  return std::move(outcome.graph);
}

void CudaGraphDevice::abort_capture() noexcept { release_capture(); }

int64_t CudaGraphDevice::capture_overhead_bytes() const { return capture_workspace_bytes(device_); }

void CudaGraphDevice::order_after_last_launch(const capture::ExecGraph& exec) {
  // The static buffers never go back to the allocator, so nothing orders their reuse across streams: when this
  // launch (and its staging) runs on another stream than the graph's previous one, it first waits for everything
  // queued on that stream so far — the previous launch and the kernels that read its outputs.
  const auto it = last_stream_.find(&exec);
  if (it == last_stream_.end()) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const cudaStream_t now = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
  const auto before = static_cast<cudaStream_t>(it->second);
  if (before == now) return;
  Event done(EventOptions{/*timing=*/false});
  done.record(before);
  TAPESAC_CUDA_CHECK(cudaStreamWaitEvent(now, done.get(), 0));
}

std::string CudaGraphDevice::before_launch(capture::ExecGraph& exec, const std::vector<capture::OpIndex>& random_ops,
                                           const std::vector<capture::OpPayload>& captured,
                                           const std::vector<capture::OpPayload>& current) {
  TAPESAC_INTERNAL_ASSERT(!saved_generator_.has_value(),
                          "CudaGraphDevice::before_launch called again before after_launch()");
  order_after_last_launch(exec);
  if (random_ops.empty()) return "";
  if (static_cast<const CudaExecGraph&>(exec).rng_epoch() != rng_state_epoch()) {
    return "the default CUDA generator was given a fresh state after a failed capture left it in capture mode; "
           "this graph's random ops draw from the replaced state";
  }
  const at::Generator& dflt = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA,
                                                                               static_cast<c10::DeviceIndex>(device_)));
  const c10::GeneratorImpl* dflt_impl = dflt.unsafeGetGeneratorImpl();
  std::vector<RngPoint> cap(random_ops.size()), cur(random_ops.size());
  for (size_t j = 0; j < random_ops.size(); ++j) {
    std::string why = read_point(captured, random_ops[j], "captured", dflt_impl, device_, &cap[j]);
    if (why.empty()) why = read_point(current, random_ops[j], "replayed", dflt_impl, device_, &cur[j]);
    if (!why.empty()) return why;
    if (j == 0) continue;
    if (cur[j].seed != cur[0].seed || cap[j].seed != cap[0].seed) {
      return "the default CUDA generator was reseeded between " + op_name(random_ops[0]) + " and " +
             op_name(random_ops[j]) + " in the " + (cur[j].seed != cur[0].seed ? "replayed" : "captured") +
             " call's forward; a CUDA graph draws all its random ops from one seed";
    }
    const int64_t d_cur = cur[j].offset - cur[j - 1].offset;
    const int64_t d_cap = cap[j].offset - cap[j - 1].offset;
    if (d_cur != d_cap) {
      return "the replayed call's forward drew " + op_name(random_ops[j]) + " " + std::to_string(d_cur) +
             " offsets after " + op_name(random_ops[j - 1]) + ", the captured call " + std::to_string(d_cap) +
             "; something outside the block's tape drew from the default CUDA generator in between, so the graph's "
             "intragraph offsets do not match";
    }
  }
  at::Generator gen = dflt;  // shares the impl; mutex() is non-const
  std::lock_guard<std::mutex> lock(gen.mutex());
  c10::GeneratorImpl* impl = gen.unsafeGetGeneratorImpl();
  saved_state_ = impl->get_state();
  impl->set_state(*current[static_cast<size_t>(random_ops[0])].generator_state);
  saved_generator_ = std::move(gen);
  return "";
}

void CudaGraphDevice::after_launch(capture::ExecGraph& exec) noexcept {
  restore_generator();
  try {
    last_stream_[&exec] = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
  } catch (...) {
    last_stream_.erase(&exec);  // unknown: the next launch on another stream is then not ordered (documented)
  }
}

void CudaGraphDevice::restore_generator() noexcept {
  if (!saved_generator_.has_value()) return;
  try {
    std::lock_guard<std::mutex> lock(saved_generator_->mutex());
    saved_generator_->unsafeGetGeneratorImpl()->set_state(*saved_state_);
  } catch (...) {
    // set_state of a state get_state produced does not fail; nothing sensible to do if it did.
  }
  saved_generator_.reset();
  saved_state_.reset();
}

void CudaGraphDevice::stage(const at::Tensor& dst, const at::Tensor& src) {
  TAPESAC_INTERNAL_ASSERT(dst.defined() && src.defined() && dst.sizes() == src.sizes() &&
                              dst.scalar_type() == src.scalar_type(),
                          "CudaGraphDevice::stage: the static input and the live input must have the same shape and "
                          "dtype, got ",
                          dst.defined() ? dst.sizes() : at::IntArrayRef{}, " ",
                          dst.defined() ? c10::toString(dst.scalar_type()) : "undefined", " vs ",
                          src.defined() ? src.sizes() : at::IntArrayRef{}, " ",
                          src.defined() ? c10::toString(src.scalar_type()) : "undefined");
  dst.copy_(src, /*non_blocking=*/true);
}

namespace {

class CuptiLaunchTimer final : public capture::LaunchTimer {
 public:
  CuptiLaunchTimer(std::unique_ptr<CuptiTimer> timer, const std::unordered_map<uint64_t, capture::OpIndex>* owner)
      : timer_(std::move(timer)), owner_(owner) {}

  capture::OpTiming kind() const override { return capture::OpTiming::kCupti; }

  capture::OpKernelTimes finish(size_t n_ops) override {
    const CuptiRecords records = timer_->stop();  // synchronises the device
    if (records.dropped > 0) {
      throw std::runtime_error("CUPTI dropped " + std::to_string(records.dropped) +
                               " activity records (buffers full); the launch's op times would be short");
    }
    // Graph records are attributed by node id alone; no external correlations are needed (block -1 matches none).
    capture::OpKernelTimes t = capture::attribute_kernel_times(records.activities, {}, -1, n_ops, *owner_);
    int64_t attributed = 0;
    for (const int32_t r : t.records) attributed += r;
    if (attributed == 0) {
      // All zeros would read as "free"; say what CUPTI delivered instead.
      size_t graph_records = 0;
      for (const auto& a : records.activities) graph_records += a.graph_node_id != 0 ? 1 : 0;
      throw std::runtime_error("no device record of the launch mapped to an op (" +
                               std::to_string(records.activities.size()) + " records, " +
                               std::to_string(graph_records) + " from graph nodes, " +
                               std::to_string(owner_->size()) + " nodes mapped at instantiation)");
    }
    return t;
  }

 private:
  std::unique_ptr<CuptiTimer> timer_;  // its destructor releases CUPTI when finish() never ran
  const std::unordered_map<uint64_t, capture::OpIndex>* owner_;
};

}  // namespace

std::unique_ptr<capture::LaunchTimer> CudaGraphDevice::time_launch(capture::ExecGraph& exec, std::string* why) {
  const auto& graph = static_cast<const CudaExecGraph&>(exec);
  const auto* owner = graph.exec_node_owner();
  if (owner == nullptr) {
    *why = graph.exec_map_note();
    return nullptr;
  }
  // Kineto holds CUPTI's activity buffers while torch.profiler runs, and its subscriber is not always registered:
  // ask torch, as the eager op timer does, rather than claim the buffers and break the user's trace.
  if (torch::profiler::impl::profilerEnabled()) {
    *why = "torch.profiler is active and owns CUPTI; the launch is not timed";
    return nullptr;
  }
  std::unique_ptr<CuptiTimer> timer = CuptiTimer::start(why);
  if (!timer) return nullptr;
  return std::make_unique<CuptiLaunchTimer>(std::move(timer), owner);
}

std::shared_ptr<capture::GraphDevice> make_cuda_graph_device(int device, uint64_t pool_first, uint64_t pool_second,
                                                             bool map_exec_nodes) {
  return std::make_shared<CudaGraphDevice>(device, pool_first, pool_second, map_exec_nodes);
}

}  // namespace tapesac::cuda
