// The graph replayer as the session uses it: per block key, an eager warm-up, then one capture of the block's
// replayable ops from static tensors, then pruned launches of that one executable for every later replay of any
// block call with the same key. Device-agnostic: the device (capture::GraphDevice) is CUDA graphs or the emulation.
//
// Note [Graph keys]. Block calls share a graph when their tapes have the same signature (ops, flags, data flow,
// sizes), the same constant arguments and the same set of live values the capture reads. Identical transformer
// layers therefore share one graph: its static memory is one block's worth, not one per layer. Parameters differ
// per layer, so they are inputs of the graph like the block's activations: staged (copied into the graph's static
// buffers) before each launch when they live elsewhere.
//
// Note [What a graph captures]. Every op of the tape except the *tainted* ones: ops that must not re-run (they write
// external state or are not replayable) and ops that read their results or bytes they wrote — unless that result is
// kept (available), in which case the capture reads it from a static buffer like an input. So one capture serves
// every plan: a replay's needed ops are a subset of the captured ops whatever was kept, and what a plan kept is
// staged into the static buffer of that value before the launch. A replay needing a tainted op falls back.
//
// Note [Static memory]. The capture keeps every tensor it made alive (the graph's outputs at fixed addresses, never
// reused inside the capture), so a launch with any subset of nodes enabled writes each value where the next enabled
// reader expects it. Checks before a launch (each a fallback to eager with its reason, nothing changed):
//  * every needed op was captured (not_in_graph);
//  * no needed op writes the storage of a value staged for it (staging_conflict: the op would overwrite the staged
//    bytes before a reader saw them) and no needed op writes a target's storage past the state the target is read at;
//  * the tensors earlier launches handed out are dead (outputs_live; Note [Handed-out storages], graph_block.cpp)
//    when this launch writes their storage: through a needed op, or by staging another tensor into that static
//    buffer (one graph serving two calls of a block: one call's kept value staged over what the other call's launch
//    handed out and a later segment or a double backward still reads — silently wrong gradients before this check);
//  * the device can make the random ops draw the forward's numbers (rng_mismatch).
// Launched targets are the static tensors' bytes (no copy): autograd reads them before the next launch of
// the same graph writes them, which the liveness check enforces. With a replay schedule (schedule.h) a block call
// launches once per segment with that segment's nodes enabled: the values an earlier launch handed out and a later
// segment reads live are its static tensors (nothing is staged), and a launch is refused only when it would write
// the storage of a handed-out value that is still referenced.
//
// Note [Host tensors under capture]. A graph bound to a device type (GraphDevice::graph_device_type(): CUDA) holds
// only that device's work. An op that reads a tensor elsewhere (a CPU scalar tensor multiplying a CUDA tensor, an
// index on the host) is captured with the host value it saw *at capture* baked into its kernel's arguments or a
// copy node, and an op whose output is on the host ran once, on the host, during the capture: later launches would
// compute with stale values. So a key whose captured ops read a tensor the forward had off the graph's device is
// never captured (host_tensors; its replays are eager), and after a capture every captured output is compared with
// the forward's metadata (check_captured_outputs()): dtype or layout differing refuses the graph
// (output_mismatch), an output made off the graph's device refuses it (host_tensors), and an output on the graph's
// device that the forward made elsewhere (memory-efficient attention's philox seed and offset: CPU tensors when run
// eagerly, CUDA tensors under capture; its backward reads them on the host) is handed out as a copy on the
// forward's device, never as the static tensor.
//
// Note [Staged values and captured scratch]. Inside one capture the caching allocator hands a block freed by an
// earlier captured op (its scratch, freed before the capture ended) to a later captured allocation, such as op B's
// output. At launch op A's kernels write that scratch again: with A enabled and B disabled, B's output kept and
// staged into its static buffer before the launch, A overwrites the staged bytes. The device reports what the
// capture freed (GraphDevice::freed_during_capture(); CUDA: the allocator's trace during the capture), the values
// whose static storage overlaps it are unstageable (values_over_freed()), and a launch that would stage one falls
// back (staging_conflict). Static inputs are allocated before the capture, outside its pool: never affected.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tapesac/capture/graph_device.h"
#include "tapesac/capture/op_payload.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/graph_prune.h"
#include "tapesac/replay/prune.h"

namespace tapesac::replay {

/// Which launches are timed per op (Note [Graph launch times] in capture/graph_device.h).
enum class LaunchTiming : uint8_t {
  kOff,    ///< none
  kFirst,  ///< the first launch of each graph (one device synchronisation per graph)
  kEvery,  ///< every launch (one synchronisation per launch)
};

struct GraphOptions {
  /// Eager replays of a key before it is captured (lazy library initialisation must not happen under capture).
  int warmup = 1;
  /// Most graphs a session captures; replays of further keys run eagerly (graph_limit).
  size_t max_graphs = 8;
  LaunchTiming time_launches = LaunchTiming::kFirst;
};

/// The replaying block call, as a graph replay reads it (all borrowed).
struct GraphCall {
  const capture::Tape* tape = nullptr;
  const std::vector<capture::OpPayload>* payloads = nullptr;
  /// Live tensors by ValueId (externals and kept values, snapshot substitutions applied; with a replay schedule
  /// also the values the call holds between segments).
  const std::vector<at::Tensor>* live = nullptr;
  const std::vector<uint8_t>* available = nullptr;
  /// What the call keeps for the whole backward (externals and kept values), from which the graph key is computed
  /// (Note [Graph keys]); null: `available`. Segments of a schedule read more live (held values) with the same key.
  const std::vector<uint8_t>* key_available = nullptr;
  uint64_t signature = 0;
  /// Step-peak limit (0: none), the step's peak so far and the last step's measured peak (0: none yet). Under a
  /// limit, a graph is captured only once a step was measured, and only when its static memory fits on top of both
  /// peaks (the statics stay for every later step); until then replays are eager (counted as warm-ups).
  int64_t memory_limit = 0;
  int64_t in_use = 0;
  int64_t last_peak = 0;
};

/// What one replay did on the graph path (summed into BlockStats).
struct GraphReplayOutcome {
  bool launched = false;
  bool captured = false;  ///< this replay captured the key's graph before launching it
  bool warmup = false;    ///< an eager warm-up replay (not a fallback)
  GraphFallback reason = GraphFallback::kNone;
  std::string detail;
  int64_t staged_bytes = 0;
  size_t enabled_nodes = 0;
  size_t disabled_nodes = 0;
  size_t ops = 0;  ///< tape ops whose nodes ran
  /// A timed launch (GraphOptions::time_launches): the source, each tape op's time and the time of records no op
  /// owns. `timing_note` says why a launch that was to be timed was not (the launch itself went ahead).
  bool timed = false;
  capture::OpTiming timing = capture::OpTiming::kUntimed;
  std::vector<int64_t> op_ns;
  int64_t unattributed_ns = 0;
  std::string timing_note;
};

/// The tainted ops of `tape` given the values a call holds live (Note [What a graph captures]): 1 per op that a
/// capture leaves out. `capture_live` receives, per value, 1 when the capture reads it from a static buffer.
std::vector<uint8_t> tainted_ops(const capture::Tape& tape, const std::vector<uint8_t>& available,
                                 std::vector<uint8_t>* capture_live);

/// Why `graph_ops` must not be captured into a graph bound to `graph_device` (none: the emulation's default, any
/// device) (Note [Host tensors under capture]):
/// a captured op reads a value the forward had on another device type, or on another index of it than
/// `device_index` (-1: any index; GraphDevice::graph_device_index()), or a value that is not a strided tensor
/// (sparse, mkldnn: a capture's static inputs are strided buffers). "" when none does.
std::string host_tensor_read(const capture::Tape& tape, const std::vector<capture::OpIndex>& graph_ops,
                             std::optional<c10::DeviceType> graph_device, int device_index = -1);

/// Compares the tensors a capture run made (`env`, by ValueId) for the outputs of `graph_ops` with the forward's
/// metadata (Note [Host tensors under capture]). "" when the graph may be used; then `copy_out` (by ValueId) holds
/// 1 for the outputs to hand out as a copy on the forward's device. Otherwise why not, and `*reason` says which
/// fallback (kOutputMismatch or kHostTensors). `graph_device` none: only dtype and layout are compared.
std::string check_captured_outputs(const capture::Tape& tape, const std::vector<capture::OpIndex>& graph_ops,
                                   const std::vector<at::Tensor>& env, std::optional<c10::DeviceType> graph_device,
                                   std::vector<uint8_t>* copy_out, GraphFallback* reason);

/// Per ValueId, 1 for the outputs of `graph_ops` whose tensor in `env` (what the capture made) has its storage
/// overlap a range of `freed` (Note [Staged values and captured scratch]).
std::vector<uint8_t> values_over_freed(const capture::Tape& tape, const std::vector<capture::OpIndex>& graph_ops,
                                       const std::vector<at::Tensor>& env,
                                       const std::vector<capture::AddressRange>& freed);

/// Hash of the constant (non-tensor) arguments of `ops`; false when one cannot be hashed (unsupported_args).
bool hash_constants(const std::vector<capture::OpPayload>& payloads, const std::vector<capture::OpIndex>& ops,
                    uint64_t* hash);

/// The graphs of one session, by key (Note [Graph keys]). Thread-safe (one replay at a time).
class GraphCache {
 public:
  GraphCache(std::shared_ptr<capture::GraphDevice> device, GraphOptions options);
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  /// Replays `targets` of `call` (`plan` = prune(targets) over call.available) on the key's graph: captures it
  /// after the warm-up, then stages, prunes and launches. Returns the targets' tensors when launched, and those of
  /// `extras` (values a later segment holds; may be null) the launch computed; otherwise an empty map and `outcome`
  /// says why (warm-up or a fallback): the caller replays eagerly. Throws only what the device or the capture run
  /// throws (the capture is then abandoned and the key marked failed).
  std::unordered_map<capture::ValueId, at::Tensor> replay(const GraphCall& call, const std::vector<Read>& targets,
                                                          const PruneResult& plan, GraphReplayOutcome* outcome,
                                                          const std::vector<capture::ValueId>* extras = nullptr);

  const capture::GraphDevice& device() const { return *device_; }
  size_t graphs() const;
  /// Bytes of the static tensors the captured graphs hold (their memory cost between steps).
  int64_t static_bytes() const;
  /// Bytes the keys warmed up but not captured yet will hold once captured (what a planner must leave room for).
  int64_t pending_bytes() const;
  /// Whether new keys may be captured (a planner that found no room for pending_bytes() turns it off: those
  /// blocks then replay eagerly, fallback memory_limit). Already captured graphs keep launching.
  void set_capture_enabled(bool enabled);

 private:
  struct Entry;
  Entry* find_or_add(uint64_t key);
  bool ready_to_capture(Entry& e, const GraphCall& call, GraphReplayOutcome& out);
  bool capture(Entry& e, const GraphCall& call, const std::vector<capture::OpIndex>& graph_ops,
               const std::vector<uint8_t>& capture_live, GraphReplayOutcome& out);
  std::unordered_map<capture::ValueId, at::Tensor> launch(Entry& e, const GraphCall& call,
                                                          const std::vector<Read>& targets, const PruneResult& plan,
                                                          const std::vector<capture::ValueId>* extras,
                                                          GraphReplayOutcome& out);

  std::shared_ptr<capture::GraphDevice> device_;
  GraphOptions options_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::unique_ptr<Entry>> entries_;
  size_t captured_ = 0;
  bool capture_enabled_ = true;
};

}  // namespace tapesac::replay
