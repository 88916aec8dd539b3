// The eager replayer: runs the pruned producer closure of some tape values below autograd through the boxed
// dispatcher, restoring each random op's generator state (and the generators' states afterwards, so replay never
// advances them), and frees every replayed intermediate as soon as its last consumer in the closure has run.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include "tapesac/capture/op_payload.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/prune.h"

namespace tapesac::replay {

/// What a replay reads; all borrowed, indexed by ValueId / OpIndex.
struct ReplaySource {
  const Tape* tape = nullptr;
  const std::vector<capture::OpPayload>* payloads = nullptr;
  /// Live tensors (externals and kept values), as classify_read() decides.
  const std::vector<at::Tensor>* live = nullptr;
  const std::vector<uint8_t>* available = nullptr;
};

struct ReplayStats {
  int64_t ops = 0;
  int64_t ns = 0;
  /// Replayed op count per OpKind.
  std::unordered_map<capture::OpKind, int64_t> ops_by_kind;
};

/// Replaces how some tape ops run in a replay (approximate rematerialization, approx.h). run() receives the op's
/// boxed arguments, tensors filled in; it returns false to let the replayer call the op, or true after leaving the
/// op's outputs on `stack`.
class OpOverride {
 public:
  virtual ~OpOverride() = default;
  virtual bool run(OpIndex op, std::vector<c10::IValue>& stack) const = 0;
};

/// Sees every op a replay runs, after it ran (the graph replayer captures a block this way).
class ReplayObserver {
 public:
  virtual ~ReplayObserver() = default;
  /// `args`: the op's boxed arguments with tensors filled in, as passed to the call; `outputs`: its returned
  /// tensors flattened in return order.
  virtual void after_op(OpIndex op, const std::vector<c10::IValue>& args, const std::vector<at::Tensor>& outputs) = 0;
};

struct ReplayOptions {
  /// Check each replayed output's sizes, strides, dtype, layout and device against the tape (the cheap part of
  /// the contract).
  bool check_metadata = true;
  /// With check_metadata: compare the device too. Off for a capture run on a graph device, whose outputs may sit on
  /// the graph's device where the forward's were on the host (GraphCache checks them: check_captured_outputs()).
  bool check_device = true;
  /// Borrowed; null: every op runs as recorded.
  const OpOverride* op_override = nullptr;
  /// Put each random op's generator at its recorded state for the call (false under graph capture: the captured
  /// kernels take their offsets from the graph's launch, see graph_block.h).
  bool set_rng = true;
  /// Borrowed; null: none.
  ReplayObserver* observer = nullptr;
};

/// Whether `t` has the layout (strided or not) the forward recorded in `m`.
bool same_layout(const capture::TensorMeta& m, const at::Tensor& t);
/// The device the forward recorded in `m`.
c10::Device device_of(const capture::TensorMeta& m);
/// Whether `t` is on the device (type and index) the forward recorded in `m`.
bool same_device(const capture::TensorMeta& m, const at::Tensor& t);

/// Predicted peak bytes a replay of `plan` (the pruned closure of `targets`) allocates, from the tape's sizes:
/// every storage an op in the plan creates is allocated when the op runs (while its inputs are alive) and freed
/// after the last op of the plan reading it, except storages holding a target, which stay alive to the end. View
/// and in-place ops allocate nothing. Kernel workspaces are not modelled (telemetry measures the real figure).
int64_t predict_working_set(const Tape& tape, const PruneResult& plan, const std::vector<Read>& targets);

/// Replays the closure of `targets` and returns their tensors by value id. Throws tapesac::Error (kReplayContract)
/// when the closure cannot be replayed or a replayed output diverges from the tape's metadata. Not thread-safe for
/// the same source; generator states are restored even when it throws.
std::unordered_map<ValueId, at::Tensor> replay(const ReplaySource& source, const std::vector<Read>& targets,
                                               const ReplayOptions& options, ReplayStats* stats);

/// Saves the state of every generator a replay touches and puts it back on destruction: replay must leave the
/// generators exactly as the forward and backward left them.
class GeneratorRestorer {
 public:
  GeneratorRestorer() = default;
  GeneratorRestorer(const GeneratorRestorer&) = delete;
  GeneratorRestorer& operator=(const GeneratorRestorer&) = delete;
  ~GeneratorRestorer();
  /// Remembers `gen`'s state now (first call per generator only).
  void remember(at::Generator gen);

 private:
  std::map<c10::GeneratorImpl*, std::pair<at::Generator, c10::intrusive_ptr<c10::TensorImpl>>> saved_;
};

/// Makes a random op about to run from `stack` draw what its forward drew (no-op for other ops): a private generator
/// at the recorded state in its generator argument, or, without one, the shared generator set to that state
/// (`restorer` puts it back).
void use_recorded_rng(const capture::OpPayload& payload, torch::jit::Stack& stack, GeneratorRestorer& restorer);

/// Appends the tensors an op left on `stack` to `out`, flattened in return order (Tensor[] expanded; an undefined
/// tensor for a None element of Tensor?[]).
void flatten_outputs(const torch::jit::Stack& stack, std::vector<at::Tensor>& out);

/// Runs `ops` (ascending tape order; every input must be live or produced by an earlier op of the list) and keeps
/// every value they produce: returns the tensors indexed by ValueId (live values the ops read included, undefined
/// for the rest). Used to capture a block as a graph. Same errors as replay().
std::vector<at::Tensor> run_ops(const ReplaySource& source, const std::vector<OpIndex>& ops,
                                const ReplayOptions& options);

}  // namespace tapesac::replay
