// What the rest of tapesac sees of a captured CUDA graph: its nodes (dense ids in capture order), each node's kind,
// the tape op that launched it, and an executable whose nodes can be enabled and disabled between launches.
// Torch-free and CUDA-free on purpose: the pruning pass (replay/graph_prune.h) and the graph replayer work on this
// interface, so their logic is tested on CPU with a fake (tests/cpp/replay/test_graph_prune.cpp); the CUDA
// implementation lives in capture/cuda/graph_capture.h (built only with the GPU backend).
//
// Note [Node attribution]. During capture, after each tape op, the capture lists every node of the graph being
// built and hands them to NodeAttribution::after_op(op, nodes): every node not seen before is attributed to that
// op. Nodes present before the first op or added between ops by non-tape work (static-input copies, PyTorch's own
// bookkeeping) are given to after_unowned() and stay unowned (kUnowned). The order in which the driver lists nodes
// is not documented to be creation order, so attribution never slices the list; it uses a seen-set (O(N) per op,
// capture is one-off). The node ids handed out are dense, in order of first sight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "tapesac/capture/tape.h"

namespace tapesac::capture {

/// A graph node's kind, mirroring cudaGraphNodeType (the CUDA implementation maps one to the other).
enum class NodeKind : uint8_t {
  kKernel,
  kMemcpy,
  kMemset,
  kHost,
  kChildGraph,
  kEmpty,
  kWaitEvent,
  kEventRecord,
  kExtSemaphoreSignal,
  kExtSemaphoreWait,
  kMemAlloc,
  kMemFree,
  kConditional,
  kOther,
};


/// Only kernel, memcpy and memset nodes can be disabled on an executable graph (cudaGraphNodeSetEnabled).
inline bool can_disable(NodeKind kind) {
  return kind == NodeKind::kKernel || kind == NodeKind::kMemcpy || kind == NodeKind::kMemset;
}

/// Dense index of a node in one captured graph (order of first sight during capture).
using NodeId = int32_t;
/// Owner of a node that no tape op launched.
constexpr OpIndex kUnowned = -1;

/// The structure of one captured graph as the pruning pass needs it. `kinds` and `owner` have one entry per node.
struct GraphTopology {
  std::vector<NodeKind> kinds;
  /// node -> tape op that launched it, or kUnowned.
  std::vector<OpIndex> owner;

  size_t node_count() const { return kinds.size(); }
};

/// Builds GraphTopology::owner during capture from snapshots of the graph's node handles (Note [Node
/// attribution]). Handles are opaque (cudaGraphNode_t cast to uint64_t in the CUDA implementation). Not
/// thread-safe; one per capture.
class NodeAttribution {
 public:
  using Handle = uint64_t;

  /// Every node in `nodes` not seen before was launched by tape op `op` (ops must be observed in tape order).
  /// Returns how many new nodes were attributed. Throws std::invalid_argument if `op` is negative or smaller than
  /// the previous op.
  size_t after_op(OpIndex op, const Handle* nodes, size_t n);
  /// Every node in `nodes` not seen before belongs to no tape op (work outside the tape's ops).
  size_t after_unowned(const Handle* nodes, size_t n);

  size_t node_count() const { return handles_.size(); }
  const std::vector<Handle>& handles() const { return handles_; }
  const std::vector<OpIndex>& owner() const { return owner_; }
  /// NodeId of `h`, or -1 if it was never seen.
  NodeId find(Handle h) const;

 private:
  size_t add_new(OpIndex owner, const Handle* nodes, size_t n);

  std::unordered_map<Handle, NodeId> index_;
  std::vector<Handle> handles_;
  std::vector<OpIndex> owner_;
  OpIndex last_op_ = -1;
};

/// An instantiated graph whose nodes can be switched on and off between launches. Implemented by the CUDA
/// backend (capture/cuda/graph_capture.h) and by fakes in tests. Not thread-safe.
class ExecGraph {
 public:
  virtual ~ExecGraph() = default;
  virtual const GraphTopology& topology() const = 0;
  /// Enables or disables node `n` for future launches. Only nodes with can_disable(kind) may be disabled;
  /// implementations throw std::invalid_argument otherwise.
  virtual void set_enabled(NodeId n, bool enabled) = 0;
  virtual bool enabled(NodeId n) const = 0;
  /// Launches the graph (the enabled nodes, in capture order) on the implementation's stream; asynchronous.
  virtual void launch() = 0;
};

// Inline, not in capture/src: the CUDA backend (tapesac::cuda, linked *by* tapesac::capture) uses them too.

/// Stable name ("kernel", "memalloc", ...) for messages and telemetry.
inline const char* to_string(NodeKind kind) {
  switch (kind) {
    case NodeKind::kKernel: return "kernel";
    case NodeKind::kMemcpy: return "memcpy";
    case NodeKind::kMemset: return "memset";
    case NodeKind::kHost: return "host";
    case NodeKind::kChildGraph: return "child_graph";
    case NodeKind::kEmpty: return "empty";
    case NodeKind::kWaitEvent: return "wait_event";
    case NodeKind::kEventRecord: return "event_record";
    case NodeKind::kExtSemaphoreSignal: return "ext_semaphore_signal";
    case NodeKind::kExtSemaphoreWait: return "ext_semaphore_wait";
    case NodeKind::kMemAlloc: return "memalloc";
    case NodeKind::kMemFree: return "memfree";
    case NodeKind::kConditional: return "conditional";
    case NodeKind::kOther: return "other";
  }
  return "other";
}

inline size_t NodeAttribution::add_new(OpIndex owner, const Handle* nodes, size_t n) {
  size_t added = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<NodeId>(handles_.size());
    if (index_.emplace(nodes[i], id).second) {
      handles_.push_back(nodes[i]);
      owner_.push_back(owner);
      ++added;
    }
  }
  return added;
}

inline size_t NodeAttribution::after_op(OpIndex op, const Handle* nodes, size_t n) {
  if (op < 0 || op < last_op_) {
    throw std::invalid_argument("NodeAttribution::after_op: ops must be observed in tape order with indices >= 0; "
                                "got op " + std::to_string(op) + " after op " + std::to_string(last_op_));
  }
  last_op_ = op;
  return add_new(op, nodes, n);
}

inline size_t NodeAttribution::after_unowned(const Handle* nodes, size_t n) { return add_new(kUnowned, nodes, n); }

inline NodeId NodeAttribution::find(Handle h) const {
  const auto it = index_.find(h);
  return it == index_.end() ? -1 : it->second;
}

}  // namespace tapesac::capture
