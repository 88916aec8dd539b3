// Graph pruning and capturability, over the CUDA-free capture::ExecGraph interface (the session's graph replayer,
// graph_block.h, applies them).
//
// Note [Graph pruning]. A single-stream capture is a chain, so graph topology alone prunes nothing: the needed set
// comes from the tape's data flow (prune() in prune.h). prune_graph() turns that op set into an enabled mask over
// the graph's nodes, and the replayer applies it with set_enabled() on the one executable instantiated from the full
// capture (cudaGraphNodeSetEnabled): disabled nodes keep their edges, so the enabled nodes run in capture order and
// random kernels keep the Philox offsets baked at capture (a pruned replay draws the same numbers as a full one).
// The rules:
//  * a node launched by a needed op is enabled;
//  * a node launched by an unneeded op is disabled when its kind can be (kernel, memcpy, memset); other kinds
//    (empty, event, child graph) cannot be disabled and stay enabled ("forced"): extra work, still correct,
//    unless the op must never be re-run (it writes external state or is not replayable): then pruning fails;
//  * a node no tape op launched (static-input copies, work between ops) stays enabled. Deciding it from the
//    node dependencies would need the edges, and in a chain every later node depends on it anyway.

#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tapesac/capture/exec_graph.h"
#include "tapesac/capture/tape.h"

namespace tapesac::replay {

using capture::ExecGraph;
using capture::GraphTopology;
using capture::NodeId;
using capture::NodeKind;
using capture::OpIndex;
using capture::Tape;

/// Why a block runs eager instead of as a graph (reported in telemetry as to_string()).
enum class GraphFallback : uint8_t {
  kNone,
  kCaptureInvalidated,  ///< the capture was invalidated: a host sync or a call that is illegal under capture
  kMemoryNodes,         ///< the graph has memalloc/memfree nodes (cudaMallocAsync allocator backend)
  kConditionalNodes,    ///< the graph has conditional nodes
  kHostNodes,           ///< the graph has host-function nodes (a host side effect would repeat at each launch)
  kNotPrunable,         ///< an op that must not re-run owns a node that cannot be disabled, or prune() failed
  kOutputsLive,         ///< outputs of the previous launch are still referenced and too large to copy out
  kNotInGraph,          ///< the replay needs an op the capture left out (it reads state the graph cannot hold)
  kStagingConflict,     ///< a value the replay reads live lives in memory that an op of the replay writes
  kRngMismatch,         ///< the graph's random ops cannot draw what this call's forward drew
  kUnsupportedArgs,     ///< an op's constant arguments cannot be compared across block calls
  kGraphLimit,          ///< the session already holds its maximum number of captured graphs
  kMemoryLimit,         ///< capturing the block would not fit under the memory limit
  kHostTensors,         ///< a captured op reads or makes a tensor off the graph's device (baked in at capture)
  kOutputMismatch,      ///< a captured output has another dtype, layout or device than the forward's
};

/// Stable snake_case name ("memory_nodes", ...) for telemetry.
const char* to_string(GraphFallback reason);

struct GraphVerdict {
  GraphFallback reason = GraphFallback::kNone;
  /// The node (or op, for tape comparisons) that decided the verdict, or -1.
  int32_t where = -1;
  std::string detail;

  bool ok() const { return reason == GraphFallback::kNone; }
};

/// Refuses graphs with memalloc/memfree, conditional or host nodes (first offending node in `where`).
GraphVerdict check_capturable(const GraphTopology& topo);

struct GraphPrune {
  /// One entry per node: 1 enabled, 0 disabled (Note [Graph pruning]).
  std::vector<uint8_t> enabled;
  size_t enabled_nodes = 0;
  size_t disabled_nodes = 0;
  /// Nodes of unneeded ops that stay enabled because their kind cannot be disabled (empty nodes not counted).
  size_t forced_nodes = 0;
  GraphVerdict verdict;

  bool ok() const { return verdict.ok(); }
};

/// The enabled mask for running `needed_ops` (any order, duplicates allowed) of `tape` on a graph captured from
/// it. Throws std::invalid_argument when a node owner or a needed op is outside the tape. Pure; O(nodes + ops).
GraphPrune prune_graph(const Tape& tape, const GraphTopology& topo, const std::vector<OpIndex>& needed_ops);

}  // namespace tapesac::replay
