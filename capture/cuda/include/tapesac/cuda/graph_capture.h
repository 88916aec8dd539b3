// CUDA-graph capture of one block's forward with per-op node attribution, and the executable graph it yields.
//
// Contract.
//  * GraphCapture captures through at::cuda::CUDAGraph(keep_graph=true), so PyTorch's RNG bookkeeping applies
//    (random ops draw (seed, base offset + intragraph offset) at each replay, reference/cuda.md §B6), on the
//    device's capture stream (one per device, warmed once: Note [Capture stream]), in
//    cudaStreamCaptureModeThreadLocal. The caller warms the block up eagerly
//    on stream() first (lazy cuBLAS/cuDNN init must not happen under capture), then: begin(); for each tape op, run
//    it and call after_op(op) (or after_unowned() after work that is no tape op's); end().
//  * after_op() lists the graph's nodes mid-capture (cudaStreamGetCaptureInfo + cudaGraphGetNodes under a Relaxed
//    capture-mode guard) and attributes the new ones to the op (capture::NodeAttribution, Note [Node attribution]).
//  * end() ends the capture. When it was invalidated (a host sync, an illegal call, a legacy-stream touch), the
//    outcome carries no graph and the CUDA error text; otherwise the graph is instantiated and returned as a
//    CudaExecGraph whose topology() holds every node's kind and owner. Capturability (memory/conditional/host
//    nodes) is judged by replay::check_capturable on that topology.
//  * With GraphCaptureOptions::map_exec_nodes, end() subscribes CUPTI (CuptiTimer) around the instantiation and
//    keeps the executable-node -> tape op map its clone callbacks give (Note [Graph launch times]); when CUPTI
//    cannot be had the graph is still returned, unmapped, with the reason.
//  * CudaExecGraph::set_enabled() is cudaGraphNodeSetEnabled on the executable, naming template nodes (which
//    keep_graph keeps alive); launch() is CUDAGraph::replay() on the current stream (RNG prologue included).
//  * Every method needs a CUDA device and throws std::runtime_error on CUDA failure; never call them when
//    tapesac::cuda::device_count() == 0. Not thread-safe; a capture is used by the thread that began it.
//  Including this header pulls in no CUDA or torch headers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tapesac/capture/exec_graph.h"
#include "tapesac/capture/graph_device.h"

namespace tapesac::cuda {

struct GraphCaptureOptions {
  /// Memory pool the captured allocations come from (a MempoolId_t; {0, 0}: a fresh private pool). Blocks
  /// captured into one shared pool in execution order form one replay arena (reference/cuda.md §B2).
  uint64_t pool_first = 0;
  uint64_t pool_second = 0;
  /// Map the executable's nodes to tape ops for launch timing (CudaExecGraph::exec_node_owner): CUPTI is
  /// subscribed around the instantiation to see its GRAPHNODE_CLONED callbacks (one device synchronisation).
  bool map_exec_nodes = false;
};

class CudaExecGraph final : public capture::ExecGraph {
 public:
  struct Impl;
  explicit CudaExecGraph(std::unique_ptr<Impl> impl);
  ~CudaExecGraph() override;
  CudaExecGraph(const CudaExecGraph&) = delete;
  CudaExecGraph& operator=(const CudaExecGraph&) = delete;

  const capture::GraphTopology& topology() const override;
  void set_enabled(capture::NodeId n, bool enabled) override;
  bool enabled(capture::NodeId n) const override;
  void launch() override;
  /// Template node handles (cudaGraphNode_t as uint64_t), indexed by NodeId (for CuptiTimer::exec_node_owner).
  std::vector<uint64_t> node_handles() const;
  /// CUPTI executable-node id -> tape op (capture::exec_node_owner), or null when the graph was not mapped at
  /// instantiation (GraphCaptureOptions::map_exec_nodes off, or CUPTI unavailable: exec_map_note() says why).
  const std::unordered_map<uint64_t, capture::OpIndex>* exec_node_owner() const;
  const std::string& exec_map_note() const;
  /// rng_state_epoch() when this graph's capture began: its random ops draw from the default generator's state
  /// object of that epoch.
  uint64_t rng_epoch() const;
  /// Writes the template graph as Graphviz dot (cudaGraphDebugDotPrint, verbose) for debugging.
  void dump_dot(const std::string& path) const;

 private:
  std::unique_ptr<Impl> impl_;
};

struct CaptureOutcome {
  /// Null when the capture failed; `error` then says why.
  std::unique_ptr<CudaExecGraph> graph;
  std::string error;
};

class GraphCapture {
 public:
  /// Takes a side stream from PyTorch's pool on the current device. Throws std::runtime_error without a device.
  explicit GraphCapture(GraphCaptureOptions options = {});
  /// Ends a capture still in progress (dropping its graph) and restores the caller's stream.
  ~GraphCapture();
  GraphCapture(const GraphCapture&) = delete;
  GraphCapture& operator=(const GraphCapture&) = delete;

  /// The side stream (a cudaStream_t) the warm-up and the capture run on.
  void* stream() const;
  /// The memory the device's allocator freed while this capture ran (its allocator trace; Note [Staged values and
  /// captured scratch] in replay/graph_block.h). Complete once end() returned.
  const std::vector<capture::AddressRange>& freed() const;
  /// Makes the side stream current (after the caller's stream's work) and begins capturing.
  void begin();
  /// Attributes the nodes added since the last call to tape op `op` (ops in tape order).
  void after_op(capture::OpIndex op);
  /// Marks the nodes added since the last call as launched by no tape op.
  void after_unowned();
  /// Ends the capture, instantiates the graph, restores the caller's stream (which then waits for the side stream).
  CaptureOutcome end();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// How many times a failed capture left the default CUDA generator in capture mode (torch's older generator design:
/// capture_end() threw before its RNG epilogue) and GraphCapture gave it a fresh state object at the same seed and
/// offset. Graphs captured in an earlier epoch drew from the replaced object: their random ops cannot reproduce a
/// forward any more (CudaGraphDevice::before_launch refuses them).
uint64_t rng_state_epoch();

/// Bytes of the cuBLAS workspaces the capture stream of `device` holds (Note [Capture stream] in
/// graph_capture.cpp): measured when the stream was warmed before its first capture; until then the size
/// CUBLAS_WORKSPACE_CONFIG gives each (handle, stream) pair.
int64_t capture_workspace_bytes(int device);

}  // namespace tapesac::cuda
