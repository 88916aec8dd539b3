// The pruning pass: from the values autograd still needs and the values replay can use as they are, the minimal
// set of tape ops to re-run. Torch-free; works on the structural tape only.
//
// Note [Live reads]. Replay serves a read of value v at storage state k from a *live* tensor (an external input or
// a kept value, whose storage holds its final contents) when v is available and k is the storage's final state;
// a view op (kView) reads its inputs' metadata, not their bytes, so its read of an external value is live at any
// state. Every other read is served by replay: v's producer, and for a read of bytes (not a view's) every writer of
// v's storage up to state k — except when v's final bytes can be reached from live values through view ops alone.
// External storages are never rebuilt: a byte read of one at a state other than its final one cannot be replayed,
// and neither can an op that writes one. classify_read() is the single place that decides, so that the pruning
// pass and the replayer agree. One more refusal lives in the pruning pass alone, because it depends on the reader:
// a byte read (not ArgRef::overwritten) of an internal storage whose last writer before the read is kUninitialized
// reads bytes no recorded op wrote and cannot be replayed (Note [Bytes no recorded op wrote], tape.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tapesac/capture/tape.h"

namespace tapesac::replay {

using capture::OpIndex;
using capture::Tape;
using capture::ValueId;

/// A value wanted at a given state of its storage (the state when autograd saved it).
struct Read {
  ValueId value = -1;
  int32_t state = 0;
};

enum class ReadSource : uint8_t { kLive, kReplay, kFail };

/// How replay serves reading `value` at `state` (content_free: the reader is a view op). `available[v] != 0` when
/// replay holds a live tensor for v (externals always, kept values). See Note [Live reads].
ReadSource classify_read(const Tape& tape, const std::vector<uint8_t>& available, ValueId value, int32_t state,
                         bool content_free);

struct PruneResult {
  /// Ops to run, ascending tape order (the order they must run in).
  std::vector<OpIndex> ops;
  bool ok = true;
  /// When !ok: the op that cannot be replayed (or -1), the value read at an unavailable state (or -1), and why.
  OpIndex blocking_op = -1;
  ValueId blocking_value = -1;
  std::string reason;
};

/// Minimal producer closure of `targets`, stopping at live reads. `available` is indexed by ValueId and may be
/// shorter than the value table (missing entries count as not available, except externals, which are always live).
/// Pure function; O(ops + reads) per call.
PruneResult prune(const Tape& tape, const std::vector<Read>& targets, const std::vector<uint8_t>& available);

/// Answers prune(tape, {r}, available).ok for many reads against one `available` vector that only grows between
/// calls (values are made available, never withdrawn), in O(ops + reads) over all calls instead of O(ops) per call.
/// Note [Rebuildable closures stay rebuildable]: making a value available only turns replayed reads into live ones,
/// which cuts a producer closure and never adds to it; so an op whose whole closure was rebuildable once stays so,
/// and its closure is not walked again. `available` is held by reference: grow it between calls as the caller
/// decides; shrinking it (or changing `tape`) breaks the contract.
class RebuildCheck {
 public:
  RebuildCheck(const Tape& tape, const std::vector<uint8_t>& available);
  ~RebuildCheck();
  RebuildCheck(const RebuildCheck&) = delete;
  RebuildCheck& operator=(const RebuildCheck&) = delete;

  /// Whether replay can rebuild `r` from the values available now.
  bool ok(Read r);
  /// Ops walked over all calls so far (each op at most once per failed read, once in all for accepted ones).
  int64_t ops_walked() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tapesac::replay
