// GraphCapture and CudaExecGraph (see tapesac/cuda/graph_capture.h). Written against CUDA 13.0 and the
// at::cuda::CUDAGraph subset shared by torch 2.11 and 2.14 (reference/cuda.md §B1). Compiled and linked in CI;
// not yet run on a GPU.
#include "tapesac/cuda/graph_capture.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#if __has_include(<ATen/core/CachingHostAllocator.h>)
#include <ATen/core/CachingHostAllocator.h>
#endif
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/version.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include "tapesac/cuda/check.h"
#include "tapesac/cuda/cupti_timer.h"
#include "tapesac/cuda/event.h"

namespace tapesac::cuda {

using capture::NodeKind;

namespace {

NodeKind kind_of(cudaGraphNodeType t) {
  switch (t) {
    case cudaGraphNodeTypeKernel: return NodeKind::kKernel;
    case cudaGraphNodeTypeMemcpy: return NodeKind::kMemcpy;
    case cudaGraphNodeTypeMemset: return NodeKind::kMemset;
    case cudaGraphNodeTypeHost: return NodeKind::kHost;
    case cudaGraphNodeTypeGraph: return NodeKind::kChildGraph;
    case cudaGraphNodeTypeEmpty: return NodeKind::kEmpty;
    case cudaGraphNodeTypeWaitEvent: return NodeKind::kWaitEvent;
    case cudaGraphNodeTypeEventRecord: return NodeKind::kEventRecord;
    case cudaGraphNodeTypeExtSemaphoreSignal: return NodeKind::kExtSemaphoreSignal;
    case cudaGraphNodeTypeExtSemaphoreWait: return NodeKind::kExtSemaphoreWait;
    case cudaGraphNodeTypeMemAlloc: return NodeKind::kMemAlloc;
    case cudaGraphNodeTypeMemFree: return NodeKind::kMemFree;
    case cudaGraphNodeTypeConditional: return NodeKind::kConditional;
    default: return NodeKind::kOther;
  }
}

uint64_t handle_of(cudaGraphNode_t n) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(n)); }

cudaGraphNode_t node_of(uint64_t h) { return reinterpret_cast<cudaGraphNode_t>(static_cast<uintptr_t>(h)); }

/// All nodes of `g` (order unspecified).
std::vector<cudaGraphNode_t> list_nodes(cudaGraph_t g) {
  size_t n = 0;
  TAPESAC_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> out(n);
  if (n > 0) TAPESAC_CUDA_CHECK(cudaGraphGetNodes(g, out.data(), &n));
  out.resize(n);
  return out;
}

/// Work enqueued on `later` from now on waits for the work enqueued so far on `first`. (Our Event, not
/// at::cuda::CUDAEvent: that header pulls in cuSPARSE/cuBLAS headers the CI toolkit does not have.)
void order_after(cudaStream_t first, cudaStream_t later) {
  Event e(EventOptions{/*timing=*/false});
  e.record(first);
  TAPESAC_CUDA_CHECK(cudaStreamWaitEvent(later, e.get(), 0));
}

std::atomic<uint64_t> g_rng_epoch{0};

int64_t allocated_bytes(c10::DeviceIndex device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].current;
}

/// cuBLAS workspace bytes torch gives each (handle, stream) pair, from CUBLAS_WORKSPACE_CONFIG (":SIZE:COUNT"
/// pairs, SIZE in KiB, summed as torch parses it); 32 MiB when unset (an upper estimate of torch's defaults).
int64_t configured_workspace_bytes() {
  const char* env = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  if (env == nullptr || *env == '\0') return int64_t{32} << 20;
  int64_t total = 0;
  const std::string cfg(env);
  size_t pos = 0;
  while (pos < cfg.size() && cfg[pos] == ':') {
    size_t end = 0;
    try {
      const int64_t size = std::stoll(cfg.substr(pos + 1), &end);
      pos += 1 + end;
      if (pos >= cfg.size() || cfg[pos] != ':') break;
      const int64_t count = std::stoll(cfg.substr(pos + 1), &end);
      pos += 1 + end;
      total += size * 1024 * count;
    } catch (const std::exception&) {
      break;
    }
  }
  return total > 0 ? total : int64_t{32} << 20;
}

// Note [Capture stream]. cuBLAS keeps a workspace per (handle, stream); a capture on a stream cuBLAS has never
// seen allocates that workspace inside the capture, from the graph's pool, where nothing counts it (32 MiB with
// CUBLAS_WORKSPACE_CONFIG=:4096:8). So every capture on a device uses one side stream, taken from PyTorch's pool
// once per process and warmed before its first capture by a cuBLAS and a cuBLASLt call outside any capture; the
// workspace bytes that warm-up allocated (measured by the caching allocator) are what GraphDevice::
// capture_overhead_bytes() reports, counted in the graph cache's static bytes.
struct CaptureStream {
  std::optional<c10::cuda::CUDAStream> stream;
  int64_t workspace_bytes = 0;
};
std::mutex g_streams_mu;
std::unordered_map<c10::DeviceIndex, CaptureStream> g_streams;

/// The default CUDA generator of `device` still draws eagerly. Probe: one eager uniform_ draw (its state put back).
/// The generator design of torch <= 2.11 keeps a `capturing_` flag that only CUDAGraph's capture epilogue clears;
/// a capture_end() that threw before the epilogue leaves it set, and every later eager random op then raises
/// "Offset increment outside graph capture encountered unexpectedly".
bool default_generator_draws(c10::DeviceIndex device) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  c10::intrusive_ptr<c10::TensorImpl> saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.unsafeGetGeneratorImpl()->get_state();
  }
  bool ok = true;
  try {
    at::empty({4}, at::TensorOptions().device(at::kCUDA, device)).uniform_();  // locks the generator itself
  } catch (const std::exception&) {
    ok = false;
  }
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.unsafeGetGeneratorImpl()->set_state(*saved);
  return ok;
}

/// Replaces the default generator's state object of `device` by a fresh one at the same seed and offset (public
/// graphsafe_set_state), which is out of capture mode. Graphs captured before drew from the old object; the
/// epoch tells before_launch to refuse their random ops (rng_state_epoch()).
void replace_default_generator_state(c10::DeviceIndex device) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  at::Generator fresh = at::cuda::detail::createCUDAGenerator(device);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    c10::GeneratorImpl* impl = gen.unsafeGetGeneratorImpl();
    fresh.unsafeGetGeneratorImpl()->set_current_seed(impl->current_seed());
    fresh.unsafeGetGeneratorImpl()->set_offset(impl->get_offset());
    impl->graphsafe_set_state(fresh.getIntrusivePtr());
  }
  g_rng_epoch.fetch_add(1);
}

/// Ends the host (pinned) allocator's routing into `pool`, where this torch has one; false when it was not
/// routing there.
template <class A>
bool end_host_routing(A* allocator, c10::MempoolId_t pool) {
  if constexpr (requires(A* a, c10::MempoolId_t p) { a->end_allocate_to_pool(p); }) {
    try {
      allocator->end_allocate_to_pool(pool);
      return true;
    } catch (...) {
      return false;  // not routing there (ended already) or not implemented
    }
  }
  return false;
}

/// Ends capturing on `g` into `pool` (the pool id the capture began with, known: never g.pool(), which throws
/// until a capture has ended). Before torch 2.12, CUDAGraph::capture_end() checked cudaStreamEndCapture's error
/// before it ended the caching allocator's routing into the capture's pool, the host allocator's routing and the
/// RNG's capture epilogue (the routing order was fixed upstream by pytorch#180395), so a failed end left the
/// routings behind (the next arena routing of an eager replay then fails with "already recording to mempool")
/// and, with torch's older generator design, the default generator in capture mode. End the routings here then
/// and, when the default generator no longer draws eagerly, give it a fresh state. Rethrows capture_end()'s error.
void end_capture(at::cuda::CUDAGraph& g, c10::cuda::MempoolId_t pool, c10::DeviceIndex device) {
  try {
    g.capture_end();
  } catch (...) {
    (void)pool;
// TAPESAC_CHECK_OLD_TORCH_RECOVERY: compiles this branch against a newer torch (a compile check only).
#if (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12) || defined(TAPESAC_CHECK_OLD_TORCH_RECOVERY)
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
    } catch (...) {
      // Already ended (a torch with the fix backported): nothing to undo.
    }
#if __has_include(<ATen/core/CachingHostAllocator.h>)
    try {
      (void)end_host_routing(at::getHostAllocator(at::kCUDA), pool);
    } catch (...) {
      // No host allocator for CUDA here: nothing was routed.
    }
#endif
#endif
    try {
      if (!default_generator_draws(device)) replace_default_generator_state(device);
    } catch (...) {
      // The recovery must not hide capture_end()'s error.
    }
    throw;
  }
}

// The allocator's trace during a capture (Note [Staged values and captured scratch], replay/graph_block.h): one
// tracker for the process (the allocator has no detach), attached at the first capture, collecting the frees of
// the capturing device while a capture has set the sink. It runs under the allocator's lock: it only appends.
std::mutex g_trace_mu;
std::vector<capture::AddressRange>* g_trace_sink = nullptr;
c10::DeviceIndex g_trace_device = -1;

void attach_trace_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const auto& te) {
      using Entry = std::decay_t<decltype(te)>;
      if (te.action_ != Entry::FREE_REQUESTED && te.action_ != Entry::FREE_COMPLETED) return;
      std::lock_guard<std::mutex> lock(g_trace_mu);
      if (g_trace_sink == nullptr || te.device_ != g_trace_device) return;
      g_trace_sink->push_back(capture::AddressRange{static_cast<uintptr_t>(te.addr_), static_cast<size_t>(te.size_)});
    });
  });
}

void set_trace_sink(std::vector<capture::AddressRange>* sink, c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  g_trace_sink = sink;
  g_trace_device = device;
}

/// The capture stream of `device` (Note [Capture stream]), warmed on first use.
c10::cuda::CUDAStream capture_stream_for(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  CaptureStream& cs = g_streams[device];
  if (cs.stream) return *cs.stream;
  const c10::cuda::CUDAStream s = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
  order_after(c10::cuda::getCurrentCUDAStream(device).stream(), s.stream());
  const int64_t before = allocated_bytes(device);
  {
    c10::cuda::CUDAStreamGuard guard(s);
    const auto opts = at::TensorOptions().device(at::kCUDA, device);
    const at::Tensor a = at::ones({16, 16}, opts);
    (void)at::mm(a, a);                           // cuBLAS
    (void)at::addmm(at::ones({16}, opts), a, a);  // cuBLASLt (gemm with bias epilogue)
    try {
      const at::Tensor h = a.to(at::kBFloat16);
      (void)at::mm(h, h);
    } catch (const std::exception&) {
      // A device without bf16 GEMMs: its models do not run them either.
    }
  }
  TAPESAC_CUDA_CHECK(cudaStreamSynchronize(s.stream()));
  cs.workspace_bytes = std::max<int64_t>(0, allocated_bytes(device) - before);
  cs.stream = s;
  return s;
}

}  // namespace

int64_t capture_workspace_bytes(int device) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  const auto it = g_streams.find(static_cast<c10::DeviceIndex>(device));
  return it != g_streams.end() && it->second.stream ? it->second.workspace_bytes : configured_workspace_bytes();
}

struct CudaExecGraph::Impl {
  std::unique_ptr<at::cuda::CUDAGraph> graph;  // keep_graph=true: the template outlives instantiation
  uint64_t rng_epoch = 0;                      // rng_state_epoch() when the capture began
  std::vector<cudaGraphNode_t> nodes;          // NodeId -> template node
  capture::GraphTopology topo;
  bool mapped = false;
  std::unordered_map<uint64_t, capture::OpIndex> exec_owner;  // CUPTI executable-node id -> tape op
  std::string map_note;
};

CudaExecGraph::CudaExecGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaExecGraph::~CudaExecGraph() = default;

const capture::GraphTopology& CudaExecGraph::topology() const { return impl_->topo; }

void CudaExecGraph::set_enabled(capture::NodeId n, bool enabled) {
  const auto i = static_cast<size_t>(n);
  if (n < 0 || i >= impl_->nodes.size()) {
    throw std::invalid_argument("CudaExecGraph::set_enabled: node " + std::to_string(n) + " outside the graph (" +
                                std::to_string(impl_->nodes.size()) + " nodes)");
  }
  if (!capture::can_disable(impl_->topo.kinds[i])) {
    throw std::invalid_argument(std::string("CudaExecGraph::set_enabled: node ") + std::to_string(n) + " is a " +
                                capture::to_string(impl_->topo.kinds[i]) +
                                " node; only kernel, memcpy and memset nodes can be enabled or disabled");
  }
  TAPESAC_CUDA_CHECK(cudaGraphNodeSetEnabled(impl_->graph->raw_cuda_graph_exec(), impl_->nodes[i], enabled ? 1 : 0));
}

bool CudaExecGraph::enabled(capture::NodeId n) const {
  const auto i = static_cast<size_t>(n);
  if (n < 0 || i >= impl_->nodes.size()) {
    throw std::invalid_argument("CudaExecGraph::enabled: node " + std::to_string(n) + " outside the graph");
  }
  // Only kernel/memcpy/memset nodes have an enabled flag; the others always run.
  if (!capture::can_disable(impl_->topo.kinds[i])) return true;
  unsigned on = 1;
  TAPESAC_CUDA_CHECK(cudaGraphNodeGetEnabled(impl_->graph->raw_cuda_graph_exec(), impl_->nodes[i], &on));
  return on != 0;
}

void CudaExecGraph::launch() { impl_->graph->replay(); }

std::vector<uint64_t> CudaExecGraph::node_handles() const {
  std::vector<uint64_t> out;
  out.reserve(impl_->nodes.size());
  for (const cudaGraphNode_t n : impl_->nodes) out.push_back(handle_of(n));
  return out;
}

const std::unordered_map<uint64_t, capture::OpIndex>* CudaExecGraph::exec_node_owner() const {
  return impl_->mapped ? &impl_->exec_owner : nullptr;
}

const std::string& CudaExecGraph::exec_map_note() const { return impl_->map_note; }

uint64_t CudaExecGraph::rng_epoch() const { return impl_->rng_epoch; }

uint64_t rng_state_epoch() { return g_rng_epoch.load(); }

void CudaExecGraph::dump_dot(const std::string& path) const {
  TAPESAC_CUDA_CHECK(cudaGraphDebugDotPrint(impl_->graph->raw_cuda_graph(), path.c_str(),
                                            cudaGraphDebugDotFlagsVerbose));
}

struct GraphCapture::Impl {
  GraphCaptureOptions options;
  c10::cuda::CUDAStream side;
  std::optional<c10::cuda::CUDAStream> caller;
  std::optional<c10::cuda::CUDAStreamGuard> guard;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  capture::NodeAttribution attribution;
  bool capturing = false;
  c10::cuda::MempoolId_t pool{0, 0};  // the capture's pool, known before capture_begin (end_capture needs it)
  c10::DeviceIndex device = 0;
  uint64_t rng_epoch = 0;
  std::vector<capture::AddressRange> freed;  // what the allocator freed on the device during the capture
  bool tracing = false;
  std::string error;  // the first failure seen mid-capture
  std::vector<uint64_t> handles;

  explicit Impl(GraphCaptureOptions o) : options(o), side(capture_stream_for(c10::cuda::current_device())) {}

  /// Reads the nodes of the graph being built; false (and `error` set) when the capture is no longer active.
  bool snapshot() {
    if (!capturing || !error.empty()) return false;
    // Queries on a capturing stream are "potentially unsafe" calls under ThreadLocal mode; PyTorch wraps its own
    // in a Relaxed guard too.
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cudaGraph_t g = nullptr;
    const cudaError_t e = cudaStreamGetCaptureInfo(side.stream(), &st, nullptr, &g, nullptr, nullptr, nullptr);
    if (e != cudaSuccess || st != cudaStreamCaptureStatusActive || g == nullptr) {
      error = std::string("the capture is no longer active (") +
              (e != cudaSuccess ? cudaGetErrorName(e) : "status invalidated") +
              "): the block synchronised with the host or made a call that is illegal under capture";
      (void)cudaGetLastError();
      return false;
    }
    const auto nodes = list_nodes(g);
    handles.resize(nodes.size());
    for (size_t i = 0; i < nodes.size(); ++i) handles[i] = handle_of(nodes[i]);
    return true;
  }

  void stop_trace() {
    if (!tracing) return;
    set_trace_sink(nullptr, -1);
    tracing = false;
  }

  void restore_stream() {
    stop_trace();
    guard.reset();
    if (caller) {
      order_after(side.stream(), caller->stream());
      caller.reset();
    }
  }
};

GraphCapture::GraphCapture(GraphCaptureOptions options) : impl_(std::make_unique<Impl>(options)) {}

GraphCapture::~GraphCapture() {
  try {
    if (impl_->capturing) {
      impl_->capturing = false;
      end_capture(*impl_->graph, impl_->pool, impl_->device);
    }
  } catch (...) {
    // The capture was already broken; its graph is dropped below either way.
  }
  try {
    impl_->graph.reset();
    impl_->restore_stream();
  } catch (...) {
    // A destructor must not throw.
  }
}

void* GraphCapture::stream() const { return static_cast<void*>(impl_->side.stream()); }

const std::vector<capture::AddressRange>& GraphCapture::freed() const { return impl_->freed; }

void GraphCapture::begin() {
  if (impl_->capturing || impl_->graph) {
    throw std::logic_error("GraphCapture::begin: a GraphCapture captures once; this one already began");
  }
  impl_->caller = c10::cuda::getCurrentCUDAStream();
  order_after(impl_->caller->stream(), impl_->side.stream());
  impl_->guard.emplace(impl_->side);
  impl_->graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true);
  // A private pool gets a known id too (graph_pool_handle), so that a failed end can end its routing.
  impl_->pool = impl_->options.pool_first == 0 && impl_->options.pool_second == 0
                    ? at::cuda::graph_pool_handle()
                    : c10::cuda::MempoolId_t{impl_->options.pool_first, impl_->options.pool_second};
  impl_->device = c10::cuda::current_device();
  impl_->rng_epoch = rng_state_epoch();
  attach_trace_once();
  set_trace_sink(&impl_->freed, impl_->device);
  impl_->tracing = true;
  try {
    impl_->graph->capture_begin(impl_->pool, cudaStreamCaptureModeThreadLocal);
  } catch (...) {
    // CUDAGraph::capture_begin() registers the graph with the default generator and puts its state in capture mode
    // before the checks that can throw (the default-stream check, a pool another capture routes to, a stream already
    // capturing): left so, every later eager random op on the device threw (a reviewer's finding; not run on a
    // GPU). The generator gets a fresh state as after a failed end (end_capture), the trace and the stream are put
    // back. Left: whether the allocator's routing and the pool's use count were taken before the throw cannot be
    // told from here, so they are not undone (another capture's routing may share the pool id).
    try {
      if (!default_generator_draws(impl_->device)) replace_default_generator_state(impl_->device);
    } catch (...) {
      // The recovery must not hide capture_begin()'s error.
    }
    try {
      impl_->graph.reset();
      impl_->restore_stream();
    } catch (...) {
    }
    throw;
  }
  impl_->capturing = true;
}

void GraphCapture::after_op(capture::OpIndex op) {
  if (impl_->snapshot()) impl_->attribution.after_op(op, impl_->handles.data(), impl_->handles.size());
}

void GraphCapture::after_unowned() {
  if (impl_->snapshot()) impl_->attribution.after_unowned(impl_->handles.data(), impl_->handles.size());
}

CaptureOutcome GraphCapture::end() {
  if (!impl_->capturing) throw std::logic_error("GraphCapture::end: no capture in progress (call begin() first)");
  after_unowned();  // nodes after the last op
  CaptureOutcome out;
  impl_->capturing = false;
  try {
    end_capture(*impl_->graph, impl_->pool, impl_->device);  // on the capture stream: before the guard goes
  } catch (const std::exception& e) {
    if (impl_->error.empty()) impl_->error = e.what();
  }
  impl_->stop_trace();
  if (!impl_->error.empty()) {
    out.error = impl_->error;
    impl_->graph.reset();
    impl_->restore_stream();
    return out;
  }
  auto exec = std::make_unique<CudaExecGraph::Impl>();
  // Nodes that appeared only at capture end belong to no op.
  const auto final_nodes = list_nodes(impl_->graph->raw_cuda_graph());
  std::vector<uint64_t> final_handles(final_nodes.size());
  for (size_t i = 0; i < final_nodes.size(); ++i) final_handles[i] = handle_of(final_nodes[i]);
  impl_->attribution.after_unowned(final_handles.data(), final_handles.size());
  const auto& handles = impl_->attribution.handles();
  std::unique_ptr<CuptiTimer> cupti;
  if (impl_->options.map_exec_nodes && torch::profiler::impl::profilerEnabled()) {
    exec->map_note = "the executable's nodes were not mapped to ops: torch.profiler owned CUPTI when the graph was "
                     "instantiated";
  } else if (impl_->options.map_exec_nodes) {
    cupti = CuptiTimer::start(&exec->map_note);
    if (!cupti) exec->map_note = "the executable's nodes were not mapped to ops: " + exec->map_note;
  } else {
    exec->map_note = "the executable's nodes were not mapped to ops (map_exec_nodes off)";
  }
  impl_->graph->instantiate();
  if (cupti) {
    try {
      const CuptiRecords records = cupti->stop();  // the clone map arrives with the records
      exec->exec_owner = cupti->exec_node_owner(handles, impl_->attribution.owner(), records);
      exec->mapped = !exec->exec_owner.empty();
      if (!exec->mapped) exec->map_note = "CUPTI reported no cloned node for this graph's instantiation";
    } catch (const std::exception& e) {
      exec->map_note = std::string("mapping the executable's nodes failed: ") + e.what();
    }
    cupti.reset();  // releases CUPTI if stop() did not run
  }
  exec->nodes.reserve(handles.size());
  exec->topo.owner = impl_->attribution.owner();
  exec->topo.kinds.reserve(handles.size());
  for (const uint64_t h : handles) {
    cudaGraphNodeType t{};
    TAPESAC_CUDA_CHECK(cudaGraphNodeGetType(node_of(h), &t));
    exec->nodes.push_back(node_of(h));
    exec->topo.kinds.push_back(kind_of(t));
  }
  exec->graph = std::move(impl_->graph);
  exec->rng_epoch = impl_->rng_epoch;
  impl_->restore_stream();
  out.graph = std::make_unique<CudaExecGraph>(std::move(exec));
  return out;
}

}  // namespace tapesac::cuda
