// The planning problem of ONE block call, independent of torch: the ops of the block's tape with their measured
// costs, the values they read and write with their sizes, and the candidates (values autograd saved for backward),
// each of which the planner keeps or drops. Blocks with an equal signature have identical problems.
//
// Data flow is SSA: every value is produced by at most one op (or is external), an op only reads values produced
// by earlier ops or external ones. An in-place op is modelled as producing a new value that shares the storage of
// the value it overwrites (PlanValue::storage), so memory is counted once per storage.
//
// Note [Replay closure]. Dropping candidate d requires replaying the ops reachable backwards from d through values
// that replay does not hold: non-candidate intermediates (they were freed after the forward) and dropped
// candidates. Kept candidates and external values stop the walk. Equivalently, with M(d) = the ops reachable
// backwards from d through non-candidate values only (every candidate stops the walk), the ops replayed for a keep
// mask are the union of M(d) over the dropped d. A candidate whose M(d) holds a non-replayable op can never be
// dropped. The evaluation functions (evaluate.h) walk the tape; the solvers (select.h) use the union form.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tapesac::planner {

/// External producer: block inputs, parameters, values the recorder could not attribute. Always available.
constexpr int32_t kExternalProducer = -1;
/// PlanValue::storage of a value with a storage of its own.
constexpr int32_t kOwnStorage = -1;

struct PlanOp {
  /// Measured cost of running the op once during replay (ns, >= 0).
  double cost_ns = 0;
  /// Value ids read / produced. Each output's PlanValue::producer is this op's index.
  std::vector<int32_t> inputs;
  std::vector<int32_t> outputs;
  /// false: the op cannot be re-run (writes external state, ...); candidates that need it are never dropped.
  bool replayable = true;
  /// Optional label for dumps and messages (no whitespace).
  std::string name;
};

struct PlanValue {
  /// Bytes of the value's storage (>= 0).
  int64_t bytes = 0;
  /// Index of the producing op, or kExternalProducer.
  int32_t producer = kExternalProducer;
  /// Values with the same storage >= 0 share memory (views, in-place versions); a storage's memory is the largest
  /// `bytes` of its members, so give members the storage's full size. A storage with an external member is never
  /// counted (it is resident anyway). kOwnStorage: the value has its own storage.
  int32_t storage = kOwnStorage;
};

struct BlockProblem {
  /// Blocks with an equal signature have identical problems (they share a frontier). No newline.
  std::string signature;
  /// In tape (execution) order.
  std::vector<PlanOp> ops;
  std::vector<PlanValue> values;
  /// Values autograd saved for backward; each is kept or dropped. No duplicates.
  std::vector<int32_t> candidates;
  /// Per candidate: 1 = cannot be dropped. Same size as `candidates`.
  std::vector<uint8_t> must_keep;
};

/// A keep mask: per candidate (same order as BlockProblem::candidates), 1 = kept.
using KeepMask = std::vector<uint8_t>;

/// Checks that `problem` is well formed: ids in range, every op reads only earlier or external values, producer
/// links consistent both ways, each value produced at most once, no duplicate candidate, finite non-negative costs
/// and sizes, must_keep sized like candidates. Throws tapesac::Error (kConfig) naming the first defect.
void validate_problem(const BlockProblem& problem);

/// Checks that `keep` is a mask over `problem`'s candidates (size). Throws tapesac::Error (kConfig).
void validate_mask(const BlockProblem& problem, const KeepMask& keep);

}  // namespace tapesac::planner
