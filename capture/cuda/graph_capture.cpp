// GraphCapture and CudaExecGraph (see tapesac/cuda/graph_capture.h). Written against CUDA 13.0 and the
// at::cuda::CUDAGraph subset shared by torch 2.11 and 2.14 (reference/cuda.md §B1). Compiled and linked in CI;
// not yet run on a GPU.
#include "tapesac/cuda/graph_capture.h"

#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <ATen/cuda/CUDAGraph.h>
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

/// Ends capturing on `g` when the capture may have been invalidated. Before torch 2.12, CUDAGraph::capture_end()
/// checked cudaStreamEndCapture's error before it ended the caching allocator's routing into the capture's pool
/// (fixed upstream by pytorch#180395), so a failed end left that routing behind — a filter pointing into the
/// graph, and a "capture underway" that later trips the allocator's synchronisation. End the routing here then.
/// Rethrows capture_end()'s error.
void end_capture(at::cuda::CUDAGraph& g) {
  try {
    g.capture_end();
  } catch (...) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(c10::cuda::current_device(), g.pool());
    } catch (...) {
      // Already ended (a torch with the fix backported): nothing to undo.
    }
#endif
    throw;
  }
}

}  // namespace

struct CudaExecGraph::Impl {
  std::unique_ptr<at::cuda::CUDAGraph> graph;  // keep_graph=true: the template outlives instantiation
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
  std::string error;  // the first failure seen mid-capture
  std::vector<uint64_t> handles;

  explicit Impl(GraphCaptureOptions o) : options(o), side(c10::cuda::getStreamFromPool(/*isHighPriority=*/false)) {}

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

  void restore_stream() {
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
      end_capture(*impl_->graph);
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

void GraphCapture::begin() {
  if (impl_->capturing || impl_->graph) {
    throw std::logic_error("GraphCapture::begin: a GraphCapture captures once; this one already began");
  }
  impl_->caller = c10::cuda::getCurrentCUDAStream();
  order_after(impl_->caller->stream(), impl_->side.stream());
  impl_->guard.emplace(impl_->side);
  impl_->graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true);
  impl_->graph->capture_begin({impl_->options.pool_first, impl_->options.pool_second},
                              cudaStreamCaptureModeThreadLocal);
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
    end_capture(*impl_->graph);  // must run on the capture stream: before the guard goes
  } catch (const std::exception& e) {
    if (impl_->error.empty()) impl_->error = e.what();
  }
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
  impl_->restore_stream();
  out.graph = std::make_unique<CudaExecGraph>(std::move(exec));
  return out;
}

}  // namespace tapesac::cuda
