// Approximate rematerialization of gated MLPs (see approx.h; the derivation is in the README).
#include "tapesac/replay/approx.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include "tapesac/capture/op_kinds.h"

namespace tapesac::replay {
namespace {

using capture::ArgRef;
using capture::kExternal;
using capture::OpIndex;
using capture::OpKind;
using capture::OpRecord;
using capture::Tape;
using capture::ValueId;

struct Kinds {
  OpKind mm, addmm, mul, silu, gelu, view, unsafe_view, reshape_alias;
};

const Kinds& kinds() {
  static const Kinds k{capture::intern_op_kind("aten::mm"),          capture::intern_op_kind("aten::addmm"),
                       capture::intern_op_kind("aten::mul.Tensor"),  capture::intern_op_kind("aten::silu"),
                       capture::intern_op_kind("aten::gelu"),        capture::intern_op_kind("aten::view"),
                       capture::intern_op_kind("aten::_unsafe_view"), capture::intern_op_kind("aten::_reshape_alias")};
  return k;
}

bool is_matmul(OpKind k) { return k == kinds().mm || k == kinds().addmm; }
bool is_reshape(OpKind k) { return k == kinds().view || k == kinds().unsafe_view || k == kinds().reshape_alias; }

// The plain-tensor argument of `op` at boxed position `arg`, or null.
const ArgRef* arg_of(const OpRecord& op, int arg) {
  for (const ArgRef& a : op.inputs) {
    if (a.arg == arg && a.elem < 0) return &a;
  }
  return nullptr;
}

int64_t last_dim(const Tape& tape, ValueId v) {
  const auto& s = tape.value(v).meta.sizes;
  return s.size() == 0 ? -1 : s[s.size() - 1];
}

// Follows `v` back through reshapes that keep the last dim (`units`) with stride 1. Appends every value visited,
// `v` first, to `chain`; returns the producer of the last one (kExternal when it is an external value).
OpIndex back_through_reshapes(const Tape& tape, ValueId v, int64_t units, std::vector<ValueId>& chain) {
  for (;;) {
    const capture::ValueInfo& info = tape.value(v);
    if (last_dim(tape, v) != units || info.meta.strides.size() == 0 ||
        info.meta.strides[info.meta.strides.size() - 1] != 1) {
      return kExternal;
    }
    chain.push_back(v);
    if (info.producer == kExternal) return kExternal;
    const OpRecord& op = tape.op(info.producer);
    if (!is_reshape(op.kind)) return info.producer;
    const ArgRef* in = arg_of(op, 0);
    if (in == nullptr || op.outputs.size() != 1) return kExternal;
    v = in->value;
  }
}

// mat1 / mat2 argument positions of mm and addmm.
int mat1_arg(const OpRecord& op) { return op.kind == kinds().addmm ? 1 : 0; }
int mat2_arg(const OpRecord& op) { return op.kind == kinds().addmm ? 2 : 1; }

// A gate/up projection: a matmul producing [T, units] whose mat2 is [H, units] (and bias, for addmm, [units]).
bool is_projection(const Tape& tape, OpIndex i, int64_t units) {
  const OpRecord& op = tape.op(i);
  if (!is_matmul(op.kind) || op.outputs.size() != 1 || op.outputs[0] < 0) return false;
  const ArgRef* m1 = arg_of(op, mat1_arg(op));
  const ArgRef* m2 = arg_of(op, mat2_arg(op));
  if (m1 == nullptr || m2 == nullptr) return false;
  const auto& out = tape.value(op.outputs[0]).meta.sizes;
  const auto& w = tape.value(m2->value).meta.sizes;
  if (out.size() != 2 || out[1] != units || w.size() != 2 || w[1] != units) return false;
  if (op.kind == kinds().addmm) {
    const ArgRef* bias = arg_of(op, 0);
    if (bias == nullptr) return false;
    const auto& b = tape.value(bias->value).meta.sizes;
    if (b.size() != 1 || b[0] != units) return false;
  }
  return true;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::vector<MlpMatch> match_gated_mlps(const Tape& tape) {
  const auto& ops = tape.ops();
  std::vector<int32_t> uses(tape.values().size(), 0);
  for (const OpRecord& op : ops) {
    for (const ArgRef& a : op.inputs) ++uses[static_cast<size_t>(a.value)];
  }
  std::vector<MlpMatch> out;
  for (OpIndex d = 0; d < static_cast<OpIndex>(ops.size()); ++d) {
    const OpRecord& down = ops[static_cast<size_t>(d)];
    if (!is_matmul(down.kind)) continue;
    const ArgRef* m1 = arg_of(down, mat1_arg(down));
    const ArgRef* m2 = arg_of(down, mat2_arg(down));
    if (m1 == nullptr || m2 == nullptr) continue;
    const auto& m1s = tape.value(m1->value).meta.sizes;
    if (m1s.size() != 2) continue;
    MlpMatch m;
    m.units = m1s[1];
    m.down_mm = d;
    m.down_in = m1->value;
    m.down_w = m2->value;
    std::vector<ValueId> h_chain;
    const OpIndex mul = back_through_reshapes(tape, m.down_in, m.units, h_chain);
    if (mul == kExternal || ops[static_cast<size_t>(mul)].kind != kinds().mul) continue;
    const ArgRef* f0 = arg_of(ops[static_cast<size_t>(mul)], 0);
    const ArgRef* f1 = arg_of(ops[static_cast<size_t>(mul)], 1);
    if (f0 == nullptr || f1 == nullptr || f0->value == f1->value) continue;
    // One factor comes from the activation of a projection (the gate), the other from a projection (the up).
    bool found = false;
    for (int order = 0; order < 2 && !found; ++order) {
      const ArgRef* fa = order == 0 ? f0 : f1;
      const ArgRef* fu = order == 0 ? f1 : f0;
      std::vector<ValueId> a_chain, u_chain, g_chain;
      const OpIndex act = back_through_reshapes(tape, fa->value, m.units, a_chain);
      if (act == kExternal) continue;
      const OpRecord& act_op = ops[static_cast<size_t>(act)];
      if ((act_op.kind != kinds().silu && act_op.kind != kinds().gelu) || act_op.outputs.size() != 1) continue;
      const OpIndex up = back_through_reshapes(tape, fu->value, m.units, u_chain);
      if (up == kExternal || !is_projection(tape, up, m.units)) continue;
      const ArgRef* act_in = arg_of(act_op, 0);
      if (act_in == nullptr) continue;
      const OpIndex gate = back_through_reshapes(tape, act_in->value, m.units, g_chain);
      if (gate == kExternal || gate == up || !is_projection(tape, gate, m.units)) continue;
      found = true;
      m.gate_mm = gate;
      m.up_mm = up;
      m.act = act;
      m.mul = mul;
      m.act_in = act_in->value;
      m.mul_act = fa->value;
      m.mul_up = fu->value;
      m.unscaled = g_chain;
      m.scaled = a_chain;
      m.scaled.insert(m.scaled.end(), u_chain.begin(), u_chain.end());
      m.scaled.insert(m.scaled.end(), h_chain.begin(), h_chain.end());
    }
    if (!found) continue;
    // Safety on the tape alone: every value of the pattern is read once (by the next op of the pattern) and its
    // storage is written once (no in-place op), so that changing it changes nothing outside the pattern.
    for (const auto* vs : {&m.scaled, &m.unscaled}) {
      for (ValueId v : *vs) {
        if (uses[static_cast<size_t>(v)] != 1) m.rejected = "a value of the MLP has a reader outside the pattern";
        if (tape.storage(tape.value(v).storage).writers.size() != 1) m.rejected = "a value of the MLP is written in place";
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

UnitSample select_units(const std::vector<double>& importance, int64_t k, ApproxMethod method, bool reweight,
                        double defensive, uint64_t seed) {
  const auto n = static_cast<int64_t>(importance.size());
  k = std::clamp<int64_t>(k, 0, n);
  UnitSample s;
  s.probabilities.assign(static_cast<size_t>(n), 0.0);
  std::vector<double> q(importance.begin(), importance.end());
  bool finite = true;
  for (double& x : q) {
    if (!std::isfinite(x)) finite = false;
    x = std::max(x, 0.0);
  }
  if (!finite) std::fill(q.begin(), q.end(), 1.0);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&q](int64_t a, int64_t b) { return q[static_cast<size_t>(a)] > q[static_cast<size_t>(b)]; });
  if (method == ApproxMethod::kGreedy) {
    s.units.assign(order.begin(), order.begin() + k);
    std::sort(s.units.begin(), s.units.end());
    s.weights.assign(s.units.size(), 1.0);
    for (int64_t j : s.units) s.probabilities[static_cast<size_t>(j)] = 1.0;
    return s;
  }
  const double mean = n > 0 ? std::accumulate(q.begin(), q.end(), 0.0) / static_cast<double>(n) : 0.0;
  for (double& x : q) x = mean > 0 ? x + defensive * mean : 1.0;
  // Water-filling: p_j = min(1, c q_j) with sum p_j = k. The m largest are capped at 1 for the smallest m at which
  // the (m+1)-th largest stays below 1.
  double rest = 0;
  for (double x : q) rest += x;
  int64_t capped = 0;
  double c = 0;
  for (; capped < k; ++capped) {
    c = static_cast<double>(k - capped) / rest;
    if (c * q[static_cast<size_t>(order[static_cast<size_t>(capped)])] <= 1.0) break;
    rest -= q[static_cast<size_t>(order[static_cast<size_t>(capped)])];
  }
  if (capped == k) c = 0;
  for (int64_t r = 0; r < n; ++r) {
    const auto j = static_cast<size_t>(order[static_cast<size_t>(r)]);
    s.probabilities[j] = r < capped ? 1.0 : std::min(1.0, c * q[j]);
  }
  // Systematic sampling over a random order: one uniform u, unit j taken when a point u + m (m = 0, 1, ...) falls in
  // its interval of length p_j on the cumulative line. Each unit is taken with probability exactly p_j, and k units
  // are taken in all (up to rounding of the sum).
  std::mt19937_64 rng(seed);
  std::vector<int64_t> random_order;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t j = order[static_cast<size_t>(r)];
    if (r < capped) {
      s.units.push_back(j);
    } else if (s.probabilities[static_cast<size_t>(j)] > 0) {
      random_order.push_back(j);
    }
  }
  std::shuffle(random_order.begin(), random_order.end(), rng);
  double next = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  double acc = 0;
  const int64_t wanted = k - capped;
  int64_t taken = 0;
  for (int64_t j : random_order) {
    acc += s.probabilities[static_cast<size_t>(j)];
    if (taken < wanted && next < acc) {
      s.units.push_back(j);
      next += 1.0;
      ++taken;
    }
  }
  std::sort(s.units.begin(), s.units.end());
  for (int64_t j : s.units) s.weights.push_back(reweight ? 1.0 / s.probabilities[static_cast<size_t>(j)] : 1.0);
  return s;
}

bool BlockApprox::run(OpIndex op, std::vector<c10::IValue>& stack) const {
  auto it = op_match_.find(op);
  if (it == op_match_.end()) return false;
  const Applied& a = applied_[it->second];
  at::Tensor part;
  at::Tensor x;
  if (stack.size() >= 5) {  // addmm(bias, mat1, mat2, beta, alpha)
    x = stack[1].toTensor();
    part = at::addmm(stack[0].toTensor().index_select(0, a.units), x, stack[2].toTensor().index_select(1, a.units),
                     stack[3].toScalar(), stack[4].toScalar());
  } else {  // mm(self, mat2)
    x = stack[0].toTensor();
    part = at::mm(x, stack[1].toTensor().index_select(1, a.units));
  }
  at::Tensor out = at::zeros({x.size(0), a.total}, part.options());
  out.index_copy_(1, a.units, part);
  stack.clear();
  stack.emplace_back(std::move(out));
  return true;
}

void BlockApprox::finish(std::unordered_map<ValueId, at::Tensor>& rebuilt) const {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (auto& [value, tensor] : rebuilt) {
    auto it = scaled_match_.find(value);
    if (it == scaled_match_.end() || !tensor.defined()) continue;
    const at::Tensor& w = applied_[it->second].weights;
    tensor = at::mul(tensor, w.scalar_type() == tensor.scalar_type() ? w : w.to(tensor.scalar_type()));
  }
}

Approx::Approx(ApproxOptions options) : options_(options) {}

void Approx::begin_step() {
  ++step_;
  call_ = 0;
}

std::unique_ptr<BlockApprox> Approx::prepare(const Tape& tape, const std::vector<int8_t>& decision,
                                             const std::vector<const at::Tensor*>& saved, ApproxStats& stats) {
  const uint64_t call = call_++;
  if (!options_.mlp) return nullptr;
  std::vector<MlpMatch> matches = match_gated_mlps(tape);
  if (matches.empty()) return nullptr;
  auto result = std::make_unique<BlockApprox>();
  auto decided = [&decision](ValueId v) {
    return static_cast<size_t>(v) < decision.size() ? decision[static_cast<size_t>(v)] : int8_t{-1};
  };
  // Values downstream of a down projection's output: if one of them is saved and dropped, replaying it would read
  // the approximated MLP, so the match is not used.
  std::vector<uint8_t> tainted(tape.values().size(), 0);
  for (size_t mi = 0; mi < matches.size(); ++mi) {
    MlpMatch& m = matches[mi];
    if (m.rejected.empty()) {
      const std::unordered_set<ValueId> readable{m.act_in, m.mul_act, m.mul_up, m.down_in};
      bool any_dropped = false;
      for (const auto* vs : {&m.scaled, &m.unscaled}) {
        for (ValueId v : *vs) {
          const int8_t d = decided(v);
          if (d == 1) m.rejected = "a value of the MLP is kept";
          if (d >= 0 && !readable.count(v)) m.rejected = "a value of the MLP is saved by an op outside the pattern";
          any_dropped = any_dropped || d == 0;
        }
      }
      if (!any_dropped && m.rejected.empty()) m.rejected = "nothing of the MLP was dropped";
    }
    if (m.rejected.empty()) {
      std::fill(tainted.begin(), tainted.end(), 0);
      for (ValueId v : tape.op(m.down_mm).outputs) {
        if (v >= 0) tainted[static_cast<size_t>(v)] = 1;
      }
      for (OpIndex i = m.down_mm + 1; i < static_cast<OpIndex>(tape.ops().size()) && m.rejected.empty(); ++i) {
        const OpRecord& op = tape.op(i);
        bool t = false;
        for (const ArgRef& a : op.inputs) t = t || tainted[static_cast<size_t>(a.value)] != 0;
        if (!t) continue;
        for (ValueId v : op.outputs) {
          if (v < 0) continue;
          tainted[static_cast<size_t>(v)] = 1;
          if (decided(v) == 0) m.rejected = "a dropped value depends on the MLP's output";
        }
      }
    }
    const at::Tensor* h = static_cast<size_t>(m.down_in) < saved.size() ? saved[static_cast<size_t>(m.down_in)] : nullptr;
    if (m.rejected.empty() && (h == nullptr || !h->defined())) m.rejected = "the down projection's input is not saved";
    if (!m.rejected.empty()) {
      ++stats.mlp_skipped;
      continue;
    }
    const int64_t n = m.units;
    const int64_t k = std::clamp<int64_t>(std::llround(options_.fraction * static_cast<double>(n)), 1, n);
    ++stats.mlp_applied;
    stats.units_total += n;
    if (k == n) {  // everything recomputed: the exact replay, bitwise
      stats.units_recomputed += n;
      continue;
    }

    // Importance of unit j: the norm of its contribution to the MLP's output, ||h[:, j]|| * ||W_down[:, j]|| (a
    // rank-one term h[:, j] W_down[:, j]^T, whose Frobenius norm is exactly this product).
    at::NoGradGuard no_grad;
    at::Tensor imp = at::linalg_vector_norm(h->reshape({-1, n}), 2, at::IntArrayRef{0}, false, at::kDouble);
    const at::Tensor* w = static_cast<size_t>(m.down_w) < saved.size() ? saved[static_cast<size_t>(m.down_w)] : nullptr;
    if (w != nullptr && w->defined() && w->dim() == 2 && w->size(0) == n) {
      imp = imp * at::linalg_vector_norm(*w, 2, at::IntArrayRef{1}, false, at::kDouble);
    }
    imp = imp.cpu().contiguous();
    std::vector<double> importance(imp.data_ptr<double>(), imp.data_ptr<double>() + n);
    const uint64_t seed = splitmix64(options_.seed ^ splitmix64(step_ * 0x100000001B3ull + call) ^ splitmix64(mi + 1));
    const UnitSample sample = select_units(importance, k, options_.method, options_.reweight, options_.defensive, seed);

    std::vector<double> weights(static_cast<size_t>(n), 0.0);
    for (size_t r = 0; r < sample.units.size(); ++r) weights[static_cast<size_t>(sample.units[r])] = sample.weights[r];
    std::vector<int64_t> units = sample.units;
    stats.units_recomputed += static_cast<int64_t>(units.size());
    BlockApprox::Applied a;
    a.total = n;
    a.units = at::from_blob(units.data(), {static_cast<int64_t>(units.size())}, at::kLong)
                  .to(h->device(), at::kLong, false, /*copy=*/true);
    a.weights = at::from_blob(weights.data(), {n}, at::kDouble).to(h->device(), h->scalar_type(), false, true);
    const size_t idx = result->applied_.size();
    result->applied_.push_back(std::move(a));
    result->op_match_[m.gate_mm] = idx;
    result->op_match_[m.up_mm] = idx;
    for (ValueId v : m.scaled) result->scaled_match_[v] = idx;
  }
  if (result->empty()) return nullptr;
  return result;
}

}  // namespace tapesac::replay
