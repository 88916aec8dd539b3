// The eager replayer: runs the pruned producer closure of some tape values below autograd through the boxed
// dispatcher, restoring each random op's generator state (and the generators' states afterwards, so replay never
// advances them), and frees every replayed intermediate as soon as its last consumer in the closure has run.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

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

struct ReplayOptions {
  /// Check each replayed output's sizes, strides and dtype against the tape (the cheap part of the contract).
  bool check_metadata = true;
  /// Borrowed; null: every op runs as recorded.
  const OpOverride* op_override = nullptr;
};

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

}  // namespace tapesac::replay
