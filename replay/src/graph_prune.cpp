// Graph pruning and capturability checks (see graph_prune.h).
#include "tapesac/replay/graph_prune.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace tapesac::replay {

using capture::can_disable;
using capture::kUnowned;
using capture::OpRecord;

const char* to_string(GraphFallback reason) {
  switch (reason) {
    case GraphFallback::kNone: return "none";
    case GraphFallback::kCaptureInvalidated: return "capture_invalidated";
    case GraphFallback::kMemoryNodes: return "memory_nodes";
    case GraphFallback::kConditionalNodes: return "conditional_nodes";
    case GraphFallback::kHostNodes: return "host_nodes";
    case GraphFallback::kNotPrunable: return "not_prunable";
    case GraphFallback::kOutputsLive: return "outputs_live";
    case GraphFallback::kNotInGraph: return "not_in_graph";
    case GraphFallback::kStagingConflict: return "staging_conflict";
    case GraphFallback::kRngMismatch: return "rng_mismatch";
    case GraphFallback::kUnsupportedArgs: return "unsupported_args";
    case GraphFallback::kGraphLimit: return "graph_limit";
    case GraphFallback::kMemoryLimit: return "memory_limit";
    case GraphFallback::kHostTensors: return "host_tensors";
    case GraphFallback::kOutputMismatch: return "output_mismatch";
  }
  return "unknown";
}

namespace {

GraphVerdict refuse(GraphFallback reason, int32_t where, std::string detail) {
  GraphVerdict v;
  v.reason = reason;
  v.where = where;
  v.detail = std::move(detail);
  return v;
}

}  // namespace

GraphVerdict check_capturable(const GraphTopology& topo) {
  for (size_t i = 0; i < topo.node_count(); ++i) {
    const NodeKind k = topo.kinds[i];
    const auto n = static_cast<int32_t>(i);
    const std::string where = "node " + std::to_string(i) + " (" + capture::to_string(k) + ", op " +
                              std::to_string(i < topo.owner.size() ? topo.owner[i] : kUnowned) + ")";
    if (k == NodeKind::kMemAlloc || k == NodeKind::kMemFree) {
      return refuse(GraphFallback::kMemoryNodes, n,
                    where + ": graphs with memory nodes cannot be pruned safely; expected PyTorch's native caching "
                            "allocator, found a cudaMallocAsync allocation (PYTORCH_CUDA_ALLOC_CONF="
                            "backend:cudaMallocAsync?); the block replays eagerly");
    }
    if (k == NodeKind::kConditional) {
      return refuse(GraphFallback::kConditionalNodes, n,
                    where + ": conditional nodes (torch.cond under capture) are not supported; the block replays "
                            "eagerly");
    }
    if (k == NodeKind::kHost) {
      return refuse(GraphFallback::kHostNodes, n,
                    where + ": a host-function node would repeat its side effect at every launch; the block "
                            "replays eagerly");
    }
  }
  return {};
}

GraphPrune prune_graph(const Tape& tape, const GraphTopology& topo, const std::vector<OpIndex>& needed_ops) {
  const size_t n_ops = tape.ops().size();
  if (topo.owner.size() != topo.kinds.size()) {
    throw std::invalid_argument("prune_graph: topology has " + std::to_string(topo.kinds.size()) + " kinds but " +
                                std::to_string(topo.owner.size()) + " owners");
  }
  std::vector<uint8_t> needed(n_ops, 0);
  for (const OpIndex op : needed_ops) {
    if (op < 0 || static_cast<size_t>(op) >= n_ops) {
      throw std::invalid_argument("prune_graph: needed op " + std::to_string(op) + " is outside the tape (" +
                                  std::to_string(n_ops) + " ops)");
    }
    needed[static_cast<size_t>(op)] = 1;
  }
  GraphPrune out;
  out.enabled.assign(topo.node_count(), 1);
  for (size_t i = 0; i < topo.node_count(); ++i) {
    const OpIndex owner = topo.owner[i];
    if (owner == kUnowned) {
      ++out.enabled_nodes;
      continue;
    }
    if (owner < 0 || static_cast<size_t>(owner) >= n_ops) {
      throw std::invalid_argument("prune_graph: node " + std::to_string(i) + " is attributed to op " +
                                  std::to_string(owner) + ", outside the tape (" + std::to_string(n_ops) + " ops)");
    }
    if (needed[static_cast<size_t>(owner)]) {
      ++out.enabled_nodes;
      continue;
    }
    const NodeKind k = topo.kinds[i];
    if (can_disable(k)) {
      out.enabled[i] = 0;
      ++out.disabled_nodes;
      continue;
    }
    const OpRecord& rec = tape.op(owner);
    if (k != NodeKind::kEmpty && (rec.has(capture::kWritesExternal) || rec.has(capture::kNonReplayable))) {
      out.verdict = refuse(GraphFallback::kNotPrunable, static_cast<int32_t>(i),
                           "node " + std::to_string(i) + " (" + capture::to_string(k) + ") of op " +
                               std::to_string(owner) + " cannot be disabled, and that op must not run again (it "
                               "writes external state or is not replayable); the block replays eagerly");
      return out;
    }
    ++out.enabled_nodes;
    if (k != NodeKind::kEmpty) ++out.forced_nodes;
  }
  return out;
}

}  // namespace tapesac::replay
