// Graph pruning and the graph replayer's decisions, over the CUDA-free capture::ExecGraph interface.
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
//
// Note [Relaunch liveness]. A graph writes its outputs into the same static buffers at every launch. Before a
// relaunch, every output of the previous launch must be dead (no tensor handed out still refers to it): otherwise
// the launch would overwrite bytes autograd still reads. RelaunchGuard tracks this per output slot; a live output
// is copied out of the static buffer when the live bytes fit the copy budget, else the replay falls back to eager.
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
  kNoDevice,            ///< no CUDA device
  kCaptureInvalidated,  ///< the capture was invalidated: a host sync or a call that is illegal under capture
  kShapesChanged,       ///< the captured op sequence or shapes differ from the warm-up (data-dependent shapes)
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

/// Compares the tape recorded while capturing with the warm-up tape of the same block: same ops (kind, flags,
/// inputs and their states, outputs) with the same output views. A difference means the block's op sequence or
/// shapes depend on data: kShapesChanged, with the first differing op in `where`.
GraphVerdict compare_tapes(const Tape& warmup, const Tape& captured);

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

/// Note [Relaunch liveness]. Slots are the graph's static outputs with their byte sizes. Not thread-safe.
class RelaunchGuard {
 public:
  enum class Action : uint8_t { kLaunch, kCopyLive, kFallBack };
  struct Decision {
    Action action = Action::kLaunch;
    std::vector<size_t> live;  ///< slots still holding a referenced result of the previous launch
    int64_t live_bytes = 0;
  };

  explicit RelaunchGuard(std::vector<int64_t> slot_bytes);

  /// What must happen before the next launch: nothing live -> kLaunch; live bytes <= copy_budget_bytes ->
  /// kCopyLive (copy those slots out, then call released()); else kFallBack.
  Decision before_launch(int64_t copy_budget_bytes) const;
  /// A launch wrote every slot: all of them now hold live results.
  void launched();
  /// The result in `slot` is dead (its last reference went, or it was copied out). Idempotent. Throws
  /// std::out_of_range for a bad slot.
  void released(size_t slot);
  /// Marks dead every slot whose entry in `referenced` is 0 (the CUDA side derives it from storage use counts).
  void sync(const std::vector<uint8_t>& referenced);

  bool live(size_t slot) const { return live_.at(slot) != 0; }
  size_t slot_count() const { return bytes_.size(); }
  int64_t launches() const { return launches_; }

 private:
  std::vector<int64_t> bytes_;
  std::vector<uint8_t> live_;
  int64_t launches_ = 0;
};

/// One static input of a captured graph: the address the graph reads and how many bytes.
struct StaticInput {
  uint64_t captured_ptr = 0;
  int64_t nbytes = 0;
};

/// Slots whose current tensor is not at the captured address: their bytes must be copied into the static buffer
/// before the launch. Throws std::invalid_argument when the counts or a byte size differ (that is a new shape:
/// the block must be re-captured, not staged).
std::vector<size_t> inputs_to_stage(const std::vector<StaticInput>& captured, const std::vector<uint64_t>& ptrs,
                                    const std::vector<int64_t>& nbytes);

/// Runs pruned replays of one captured block: prunes, toggles only the nodes whose state changes, checks
/// relaunch liveness, stages inputs, launches. Borrows `tape` and `exec` (both must outlive it). Not thread-safe.
class GraphReplayer {
 public:
  /// What the replayer asks of the tensors around a launch (the CUDA side copies tensors; tests record calls).
  class Io {
   public:
    virtual ~Io() = default;
    /// Copy the current input of `slot` into its static buffer (on the launch stream).
    virtual void stage_input(size_t slot) = 0;
    /// Copy the live result in output `slot` out of its static buffer, so the next launch may overwrite it.
    virtual void copy_out(size_t slot) = 0;
  };

  struct Options {
    /// Live outputs of the previous launch up to this many bytes are copied out before a relaunch; above it the
    /// replay falls back to eager.
    int64_t copy_budget_bytes = 0;
  };

  struct Result {
    bool launched = false;
    GraphVerdict verdict;  ///< why not launched
    size_t toggled = 0;    ///< set_enabled calls made for this replay
    size_t enabled_nodes = 0;
    std::vector<size_t> staged;
    std::vector<size_t> copied;
  };

  GraphReplayer(const Tape& tape, ExecGraph& exec, std::vector<StaticInput> inputs, std::vector<int64_t> output_bytes,
                Options options);

  /// Replays `needed_ops` with the inputs now at `input_ptrs` / `input_nbytes` (one per static input). Refusals
  /// (Result::launched false, verdict says why: not_prunable, outputs_live, shapes_changed for an input of another
  /// size or count) leave the executable and the liveness state untouched; the caller replays eagerly.
  Result replay(const std::vector<OpIndex>& needed_ops, const std::vector<uint64_t>& input_ptrs,
                const std::vector<int64_t>& input_nbytes, Io& io);

  RelaunchGuard& outputs() { return guard_; }

 private:
  const Tape* tape_;
  ExecGraph* exec_;
  std::vector<StaticInput> inputs_;
  RelaunchGuard guard_;
  Options options_;
  std::vector<uint8_t> applied_;  // the mask the executable currently has
};

}  // namespace tapesac::replay
