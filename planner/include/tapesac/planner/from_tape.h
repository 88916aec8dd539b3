// Building a planning problem from a recorded tape, and the per-signature cost model fed by measured op times.
//
// Contract.
//  * problem_from_tape(): one PlanOp per tape op (cost from `op_costs_ns`, replayable unless the op writes
//    external state or is flagged non-replayable), one PlanValue per tape value (bytes = its storage's bytes;
//    values on one storage share it, so views and in-place versions are counted once), the candidates and
//    must_keep exactly as the replay session decided them (replay/session.h, BlockTapeView). Throws
//    tapesac::Error (kConfig) when the sizes disagree.
//  * CostModel: per block signature, the last `window` measured cost vectors (one per block call); costs() is the
//    per-op median, so one slow call (a page fault, a noisy neighbour) does not move the plan. Not thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "tapesac/capture/tape.h"
#include "tapesac/planner/problem.h"

namespace tapesac::planner {

BlockProblem problem_from_tape(const capture::Tape& tape, const std::vector<int32_t>& candidates,
                               const std::vector<uint8_t>& must_keep, const std::vector<double>& op_costs_ns,
                               std::string signature);

/// The tape's measured forward duration of every op (ns), in tape order.
std::vector<double> measured_costs(const capture::Tape& tape);

class CostModel {
 public:
  explicit CostModel(size_t window = 7) : window_(window == 0 ? 1 : window) {}
  void observe(const std::string& signature, std::vector<double> op_costs_ns);
  /// Per-op median over the observed calls of `signature`; empty when none was observed.
  std::vector<double> costs(const std::string& signature) const;
  size_t samples(const std::string& signature) const;

 private:
  size_t window_;
  std::unordered_map<std::string, std::deque<std::vector<double>>> samples_;
};

}  // namespace tapesac::planner
