// Validation of planning problems (problem.h).
#include "tapesac/planner/problem.h"

#include <cmath>
#include <unordered_set>

#include "tapesac/common/errors.h"

namespace tapesac::planner {
namespace {

std::string op_label(const BlockProblem& p, size_t i) {
  const std::string& name = p.ops[i].name;
  return "op #" + std::to_string(i) + (name.empty() ? std::string() : " (" + name + ")");
}

}  // namespace

void validate_problem(const BlockProblem& p) {
  const int64_t n_values = static_cast<int64_t>(p.values.size());
  const int64_t n_ops = static_cast<int64_t>(p.ops.size());
  TAPESAC_CHECK(p.signature.find('\n') == std::string::npos, kConfig,
                "planning problem: the signature must not contain a newline, got '", p.signature, "'");
  for (int64_t v = 0; v < n_values; ++v) {
    const PlanValue& val = p.values[static_cast<size_t>(v)];
    TAPESAC_CHECK(val.bytes >= 0, kConfig, "planning problem '", p.signature, "': value v", v,
                  " has bytes >= 0 expected, got ", val.bytes);
    TAPESAC_CHECK(val.producer >= kExternalProducer && val.producer < n_ops, kConfig, "planning problem '",
                  p.signature, "': value v", v, " has producer ", val.producer,
                  ", expected -1 (external) or an op in [0, ", n_ops, ")");
    TAPESAC_CHECK(val.storage >= kOwnStorage, kConfig, "planning problem '", p.signature, "': value v", v,
                  " has storage ", val.storage, ", expected -1 (own storage) or a storage id >= 0");
  }
  std::vector<int32_t> produced_by(static_cast<size_t>(n_values), kExternalProducer);
  for (int64_t i = 0; i < n_ops; ++i) {
    const PlanOp& op = p.ops[static_cast<size_t>(i)];
    TAPESAC_CHECK(std::isfinite(op.cost_ns) && op.cost_ns >= 0, kConfig, "planning problem '", p.signature, "': ",
                  op_label(p, static_cast<size_t>(i)), " has cost_ns ", op.cost_ns, ", expected a finite value >= 0");
    for (int32_t v : op.inputs) {
      TAPESAC_CHECK(v >= 0 && v < n_values, kConfig, "planning problem '", p.signature, "': ",
                    op_label(p, static_cast<size_t>(i)), " reads value v", v, ", expected an id in [0, ", n_values,
                    ")");
      const int32_t producer = p.values[static_cast<size_t>(v)].producer;
      TAPESAC_CHECK(producer < i, kConfig, "planning problem '", p.signature, "': ",
                    op_label(p, static_cast<size_t>(i)), " reads value v", v, " produced by op #", producer,
                    "; an op may only read values produced by earlier ops or external ones (tape order)");
    }
    for (int32_t v : op.outputs) {
      TAPESAC_CHECK(v >= 0 && v < n_values, kConfig, "planning problem '", p.signature, "': ",
                    op_label(p, static_cast<size_t>(i)), " produces value v", v, ", expected an id in [0, ",
                    n_values, ")");
      TAPESAC_CHECK(produced_by[static_cast<size_t>(v)] == kExternalProducer, kConfig, "planning problem '",
                    p.signature, "': value v", v, " is produced by op #", produced_by[static_cast<size_t>(v)],
                    " and by op #", i, "; data flow must be SSA (model an in-place write as a new value)");
      produced_by[static_cast<size_t>(v)] = static_cast<int32_t>(i);
      TAPESAC_CHECK(p.values[static_cast<size_t>(v)].producer == i, kConfig, "planning problem '", p.signature,
                    "': ", op_label(p, static_cast<size_t>(i)), " lists v", v,
                    " as an output but the value's producer is ", p.values[static_cast<size_t>(v)].producer);
    }
  }
  for (int64_t v = 0; v < n_values; ++v) {
    const int32_t producer = p.values[static_cast<size_t>(v)].producer;
    TAPESAC_CHECK(producer == produced_by[static_cast<size_t>(v)], kConfig, "planning problem '", p.signature,
                  "': value v", v, " names op #", producer,
                  " as its producer but that op does not list it as an output");
  }
  TAPESAC_CHECK(p.must_keep.size() == p.candidates.size(), kConfig, "planning problem '", p.signature,
                "': must_keep has ", p.must_keep.size(), " entries, expected one per candidate (", p.candidates.size(),
                ")");
  std::unordered_set<int32_t> seen;
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    const int32_t v = p.candidates[c];
    TAPESAC_CHECK(v >= 0 && v < n_values, kConfig, "planning problem '", p.signature, "': candidate ", c,
                  " is value v", v, ", expected an id in [0, ", n_values, ")");
    TAPESAC_CHECK(seen.insert(v).second, kConfig, "planning problem '", p.signature, "': value v", v,
                  " is listed twice as a candidate (candidate ", c, "); list each saved value once");
  }
}

void validate_mask(const BlockProblem& p, const KeepMask& keep) {
  TAPESAC_CHECK(keep.size() == p.candidates.size(), kConfig, "keep mask for '", p.signature, "' has ", keep.size(),
                " entries, expected one per candidate (", p.candidates.size(), ")");
  for (size_t c = 0; c < keep.size(); ++c) {
    TAPESAC_CHECK(keep[c] || !p.must_keep[c], kConfig, "keep mask for '", p.signature, "' drops candidate ", c,
                  " (value v", p.candidates[c], ") which is must_keep");
  }
}

}  // namespace tapesac::planner
