// problem_from_tape() and CostModel (see from_tape.h).
#include "tapesac/planner/from_tape.h"

#include <algorithm>

#include "tapesac/common/errors.h"
#include "tapesac/capture/op_kinds.h"

namespace tapesac::planner {

BlockProblem problem_from_tape(const capture::Tape& tape, const std::vector<int32_t>& candidates,
                               const std::vector<uint8_t>& must_keep, const std::vector<double>& op_costs_ns,
                               std::string signature) {
  TAPESAC_CHECK(op_costs_ns.size() == tape.ops().size(), kConfig, "problem_from_tape: ", op_costs_ns.size(),
                " costs for ", tape.ops().size(), " ops");
  TAPESAC_CHECK(must_keep.size() == candidates.size(), kConfig, "problem_from_tape: must_keep has ",
                must_keep.size(), " entries for ", candidates.size(), " candidates");
  BlockProblem p;
  p.signature = std::move(signature);
  p.ops.reserve(tape.ops().size());
  for (size_t i = 0; i < tape.ops().size(); ++i) {
    const capture::OpRecord& rec = tape.ops()[i];
    PlanOp op;
    op.cost_ns = std::max(0.0, op_costs_ns[i]);
    for (const capture::ArgRef& a : rec.inputs) {
      if (std::find(op.inputs.begin(), op.inputs.end(), a.value) == op.inputs.end()) op.inputs.push_back(a.value);
    }
    for (capture::ValueId v : rec.outputs) {
      // An output on a storage the block did not create has the external producer's semantics (below).
      if (v >= 0 && !tape.storage(tape.value(v).storage).external) op.outputs.push_back(v);
    }
    op.replayable = !rec.has(capture::kWritesExternal) && !rec.has(capture::kNonReplayable);
    op.name = capture::op_kind_name(rec.kind);
    p.ops.push_back(std::move(op));
  }
  p.values.reserve(tape.values().size());
  for (const capture::ValueInfo& v : tape.values()) {
    PlanValue pv;
    pv.bytes = std::max<int64_t>(0, tape.storage(v.storage).nbytes);
    // A value on a storage the block did not create is resident anyway: replay reads it live (Note [Live reads] in
    // replay/prune.h: a saved one is kept and available; another is at most a view op away), so it gets the external
    // producer's semantics — rebuilding a candidate stops there, as replay's does. Its producer may be an op replay
    // never runs (aten::lift_fresh over numpy's bytes in a custom Function): a candidate that truly needs it is
    // must_keep. The planner never counts such a storage.
    pv.producer = tape.storage(v.storage).external ? kExternalProducer : v.producer;
    pv.storage = v.storage;
    p.values.push_back(pv);
  }
  p.candidates = candidates;
  p.must_keep = must_keep;
  return p;
}

std::vector<double> measured_costs(const capture::Tape& tape) {
  std::vector<double> c;
  c.reserve(tape.ops().size());
  for (const capture::OpRecord& op : tape.ops()) c.push_back(static_cast<double>(op.duration_ns));
  return c;
}

void CostModel::observe(const std::string& signature, std::vector<double> op_costs_ns) {
  auto& q = samples_[signature];
  if (!q.empty() && q.front().size() != op_costs_ns.size()) q.clear();  // cannot happen for an equal signature
  q.push_back(std::move(op_costs_ns));
  while (q.size() > window_) q.pop_front();
}

std::vector<double> CostModel::costs(const std::string& signature) const {
  auto it = samples_.find(signature);
  if (it == samples_.end() || it->second.empty()) return {};
  const auto& q = it->second;
  const size_t n = q.front().size();
  std::vector<double> out(n);
  std::vector<double> col(q.size());
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < q.size(); ++k) col[k] = q[k][i];
    std::nth_element(col.begin(), col.begin() + static_cast<std::ptrdiff_t>(col.size() / 2), col.end());
    out[i] = col[col.size() / 2];
  }
  return out;
}

size_t CostModel::samples(const std::string& signature) const {
  auto it = samples_.find(signature);
  return it == samples_.end() ? 0 : it->second.size();
}

}  // namespace tapesac::planner
