// Approximate rematerialization of gated MLPs (see approx.h; the derivation is in the README).
#include "tapesac/replay/approx.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include "tapesac/capture/errors.h"
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
  OpKind sdpa_cpu, transpose, unsqueeze, slice, cat, mean_dim, sum_dim, clone, to_copy;
  std::unordered_set<OpKind> elementwise;
};

const Kinds& kinds() {
  static const Kinds k = [] {
    auto id = [](const char* n) { return capture::intern_op_kind(n); };
    Kinds r{id("aten::mm"), id("aten::addmm"), id("aten::mul.Tensor"), id("aten::silu"), id("aten::gelu"),
            id("aten::view"), id("aten::_unsafe_view"), id("aten::_reshape_alias"),
            id("aten::_scaled_dot_product_flash_attention_for_cpu"), id("aten::transpose.int"), id("aten::unsqueeze"),
            id("aten::slice.Tensor"), id("aten::cat"), id("aten::mean.dim"), id("aten::sum.dim_IntList"),
            id("aten::clone"), id("aten::_to_copy"), {}};
    // Elementwise ops (with broadcasting): they never mix heads.
    for (const char* n : {"aten::mul.Tensor", "aten::add.Tensor", "aten::sub.Tensor", "aten::div.Tensor", "aten::neg",
                          "aten::rsqrt", "aten::sqrt", "aten::pow.Tensor_Scalar", "aten::mul.Scalar", "aten::add.Scalar",
                          "aten::div.Scalar", "aten::clone", "aten::_to_copy", "aten::silu", "aten::tanh", "aten::sigmoid",
                          "aten::exp", "aten::sin", "aten::cos"}) {
      r.elementwise.insert(id(n));
    }
    return r;
  }();
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


namespace {

int64_t norm_dim(int64_t d, int64_t ndim) { return d < 0 ? d + ndim : d; }

std::vector<int64_t> sizes_of(const Tape& tape, ValueId v) { return tape.value(v).meta.sizes.vec(); }

// The layout of `op`'s output from the layout of its head-carrying input(s), for the head-local ops an attention
// branch may contain; false when the op could mix heads (or is unknown). `lay` holds the layouts of the branch's
// values so far; `cols` = heads * head_dim.
bool propagate_layout(const Tape& tape, const capture::OpPayload& payload, const OpRecord& op,
                      const std::unordered_map<ValueId, HeadLayout>& lay, int64_t heads, int64_t head_dim,
                      HeadLayout& out) {
  const Kinds& K = kinds();
  if (op.outputs.size() != 1 || op.outputs[0] < 0) return false;
  const std::vector<int64_t> os = sizes_of(tape, op.outputs[0]);
  const auto on = static_cast<int64_t>(os.size());
  const int64_t cols = heads * head_dim;
  auto int_arg = [&payload](size_t i, int64_t& v) {
    if (i >= payload.args.size() || !payload.args[i].isInt()) return false;
    v = payload.args[i].toInt();
    return true;
  };
  // Every input on the branch, aligned to the output's dims, must agree.
  bool first = true;
  for (const ArgRef& a : op.inputs) {
    auto it = lay.find(a.value);
    if (it == lay.end()) continue;
    const HeadLayout in = it->second;
    const std::vector<int64_t> is = sizes_of(tape, a.value);
    const auto in_n = static_cast<int64_t>(is.size());
    HeadLayout r;
    if (is_reshape(op.kind)) {
      if (a.arg != 0) return false;
      if (in.merged) {
        if (on >= 1 && os[on - 1] == cols) {
          r = HeadLayout{true, -1};
        } else if (on >= 2 && os[on - 2] == heads && os[on - 1] == head_dim) {
          r = HeadLayout{false, static_cast<int>(on - 2)};
        } else {
          return false;
        }
      } else if (os == is) {
        r = in;
      } else if (in.axis == in_n - 2 && is[in_n - 1] == head_dim && on >= 1 && os[on - 1] == cols) {
        r = HeadLayout{true, -1};
      } else {
        return false;
      }
    } else if (op.kind == K.transpose) {
      int64_t d0 = 0, d1 = 0;
      if (!int_arg(1, d0) || !int_arg(2, d1)) return false;
      d0 = norm_dim(d0, on);
      d1 = norm_dim(d1, on);
      if (in.merged) {
        if (d0 == on - 1 || d1 == on - 1) return false;
        r = in;
      } else {
        r = in;
        if (in.axis == d0) r.axis = static_cast<int>(d1);
        else if (in.axis == d1) r.axis = static_cast<int>(d0);
      }
    } else if (op.kind == K.unsqueeze) {
      int64_t d = 0;
      if (!int_arg(1, d)) return false;
      d = norm_dim(d, on);
      if (in.merged) {
        if (d == on - 1) return false;
        r = in;
      } else {
        r = HeadLayout{false, static_cast<int>(in.axis + (d <= in.axis ? 1 : 0))};
      }
    } else if (op.kind == K.slice || op.kind == K.cat) {
      int64_t d = 0;
      if (in.merged || !int_arg(1, d) || norm_dim(d, on) == in.axis) return false;
      if (op.kind == K.cat) {
        for (const ArgRef& b : op.inputs) {
          if (!lay.count(b.value)) return false;  // a piece from outside the branch
        }
      }
      r = in;
    } else if (op.kind == K.mean_dim || op.kind == K.sum_dim) {
      if (payload.args.size() < 3 || !payload.args[1].isIntList() || !payload.args[2].isBool()) return false;
      const std::vector<int64_t> dims = payload.args[1].toIntVector();
      if (dims.empty()) return false;
      const bool keepdim = payload.args[2].toBool();
      int shift = 0;
      for (int64_t d : dims) {
        d = norm_dim(d, in_n);
        if (in.merged ? d == in_n - 1 : d == in.axis) return false;
        if (!in.merged && d < in.axis) ++shift;
      }
      r = in;
      if (!in.merged && !keepdim) r.axis -= shift;
    } else if (K.elementwise.count(op.kind)) {
      if (in.merged) {
        if (on < 1 || os[on - 1] != cols) return false;
        r = in;
      } else {
        r = HeadLayout{false, static_cast<int>(in.axis + (on - in_n))};
      }
    } else {
      return false;
    }
    if (!first && (r.merged != out.merged || r.axis != out.axis)) return false;
    out = r;
    first = false;
  }
  if (!out.merged && (out.axis < 0 || out.axis >= on || os[static_cast<size_t>(out.axis)] != heads)) return false;
  return !first;
}

// The one matmul producing [T, cols] that `v` is computed from through non-matmul ops (searched backwards over at
// most 64 ops); -1 when there is none or more than one.
OpIndex find_projection(const Tape& tape, ValueId v, int64_t cols) {
  std::vector<ValueId> stack{v};
  std::unordered_set<OpIndex> seen;
  OpIndex found = -1;
  while (!stack.empty()) {
    const ValueId u = stack.back();
    stack.pop_back();
    const OpIndex p = tape.value(u).producer;
    if (p == kExternal || !seen.insert(p).second) continue;
    if (seen.size() > 64) return -1;
    const OpRecord& op = tape.op(p);
    if (is_matmul(op.kind)) {
      const auto s = sizes_of(tape, op.outputs[0]);
      if (s.size() != 2 || s[1] != cols) continue;  // another matmul (e.g. a mask): not this branch's projection
      if (found >= 0 && found != p) return -1;
      found = p;
      continue;
    }
    for (const ArgRef& a : op.inputs) stack.push_back(a.value);
  }
  return found;
}

// One branch: from the projection `proj` to argument `arg` of the SDPA op, through head-local ops only, read by
// nothing else. Appends the branch's values to `values`; returns an empty string when it holds.
std::string check_branch(const Tape& tape, const std::vector<capture::OpPayload>& payloads,
                         const std::vector<int32_t>& uses, OpIndex proj, OpIndex sdpa, int arg, int64_t heads,
                         int64_t head_dim, std::vector<ValueId>& values) {
  const ValueId root = tape.op(proj).outputs[0];
  std::unordered_map<ValueId, HeadLayout> lay{{root, HeadLayout{true, -1}}};
  std::unordered_map<ValueId, int32_t> reads;  // reads of branch values by branch ops and the SDPA's `arg`
  std::vector<ValueId> branch{root};
  for (OpIndex i = proj + 1; i < sdpa; ++i) {
    const OpRecord& op = tape.op(i);
    bool on_branch = false;
    for (const ArgRef& a : op.inputs) on_branch = on_branch || lay.count(a.value) != 0;
    if (!on_branch) continue;
    HeadLayout out;
    if (!propagate_layout(tape, payloads.at(static_cast<size_t>(i)), op, lay, heads, head_dim, out)) {
      return "an op between a projection and the attention may mix heads (" + capture::op_kind_name(op.kind) + ")";
    }
    for (const ArgRef& a : op.inputs) {
      if (lay.count(a.value)) ++reads[a.value];
    }
    lay[op.outputs[0]] = out;
    branch.push_back(op.outputs[0]);
  }
  const ArgRef* in = arg_of(tape.op(sdpa), arg);
  if (in == nullptr) return "the attention's input is not a tensor";
  auto it = lay.find(in->value);
  if (it == lay.end() || it->second.merged || it->second.axis != 1) return "the attention's input is not [B, heads, T, d]";
  ++reads[in->value];
  for (ValueId v : branch) {
    if (uses[static_cast<size_t>(v)] != reads[v]) return "a value of the attention has a reader outside the pattern";
    if (tape.storage(tape.value(v).storage).writers.size() != 1) return "a value of the attention is written in place";
  }
  values.insert(values.end(), branch.begin(), branch.end());
  return {};
}

}  // namespace

std::vector<AttnMatch> match_attention(const Tape& tape, const std::vector<capture::OpPayload>& payloads) {
  const Kinds& K = kinds();
  const auto& ops = tape.ops();
  std::vector<int32_t> uses(tape.values().size(), 0);
  std::vector<OpIndex> reader(tape.values().size(), -1);
  for (OpIndex i = 0; i < static_cast<OpIndex>(ops.size()); ++i) {
    for (const ArgRef& a : ops[static_cast<size_t>(i)].inputs) {
      ++uses[static_cast<size_t>(a.value)];
      reader[static_cast<size_t>(a.value)] = i;
    }
  }
  std::vector<AttnMatch> out;
  for (OpIndex s = 0; s < static_cast<OpIndex>(ops.size()); ++s) {
    const OpRecord& op = ops[static_cast<size_t>(s)];
    if (op.kind != K.sdpa_cpu || op.outputs.size() != 2) continue;
    const capture::OpPayload& payload = payloads.at(static_cast<size_t>(s));
    const ArgRef* q = arg_of(op, 0);
    const ArgRef* k = arg_of(op, 1);
    const ArgRef* v = arg_of(op, 2);
    if (q == nullptr || k == nullptr || v == nullptr) continue;
    AttnMatch m;
    m.sdpa = s;
    const auto qs = sizes_of(tape, q->value);
    const auto ks = sizes_of(tape, k->value);
    if (qs.size() != 4 || ks.size() != 4 || ks[1] <= 0 || qs[1] % ks[1] != 0 || qs[3] != ks[3]) continue;
    m.heads = qs[1];
    m.kv_heads = ks[1];
    m.head_dim = qs[3];
    m.out = op.outputs[0];
    m.lse = op.outputs[1];
    if (payload.args.size() < 4 || !payload.args[3].isDouble() || payload.args[3].toDouble() != 0.0) {
      m.rejected = "attention dropout is on";
    }
    const int64_t cols[3] = {m.heads * m.head_dim, m.kv_heads * m.head_dim, m.kv_heads * m.head_dim};
    const ArgRef* in[3] = {q, k, v};
    for (int r = 0; r < 3 && m.rejected.empty(); ++r) {
      m.proj[r] = find_projection(tape, in[r]->value, cols[r]);
      if (m.proj[r] < 0 || !is_projection(tape, m.proj[r], cols[r])) {
        m.rejected = "q, k or v does not come from one projection";
        break;
      }
      if (r > 0 && (m.proj[r] == m.proj[0] || (r == 2 && m.proj[2] == m.proj[1]))) m.rejected = "a projection is shared";
      if (m.rejected.empty()) {
        m.rejected = check_branch(tape, payloads, uses, m.proj[r], s, r, r == 0 ? m.heads : m.kv_heads, m.head_dim,
                                  m.values);
      }
    }
    // The o branch: out -> reshapes/transposes -> the o projection's input.
    if (m.rejected.empty()) {
      if (m.lse < 0 || uses[static_cast<size_t>(m.lse)] != 0) m.rejected = "the attention's logsumexp is read";
      std::unordered_map<ValueId, HeadLayout> lay{{m.out, HeadLayout{false, 1}}};
      ValueId cur = m.out;
      m.values.push_back(m.out);
      m.values.push_back(m.lse);
      while (m.rejected.empty()) {
        if (uses[static_cast<size_t>(cur)] != 1) {
          m.rejected = "the attention's output has a reader outside the pattern";
          break;
        }
        if (tape.storage(tape.value(cur).storage).writers.size() != 1) {
          m.rejected = "the attention's output is written in place";
          break;
        }
        const OpIndex c = reader[static_cast<size_t>(cur)];
        const OpRecord& cop = ops[static_cast<size_t>(c)];
        if (is_matmul(cop.kind)) {
          const ArgRef* m1 = arg_of(cop, mat1_arg(cop));
          const HeadLayout l = lay[cur];
          if (m1 == nullptr || m1->value != cur || !l.merged || sizes_of(tape, cur).size() != 2 ||
              sizes_of(tape, cur)[1] != m.heads * m.head_dim) {
            m.rejected = "the o projection does not read the attention's output as [T, heads * d]";
            break;
          }
          m.o_mm = c;
          m.o_in = cur;
          const ArgRef* m2 = arg_of(cop, mat2_arg(cop));
          m.o_w = m2 != nullptr ? m2->value : -1;
          break;
        }
        const bool reshaping = is_reshape(cop.kind) || cop.kind == K.transpose || cop.kind == K.clone;
        HeadLayout l;
        if (!reshaping ||
            !propagate_layout(tape, payloads.at(static_cast<size_t>(c)), cop, lay, m.heads, m.head_dim, l)) {
          m.rejected = "an op between the attention and the o projection is not a reshape";
          break;
        }
        cur = cop.outputs[0];
        lay[cur] = l;
        m.scaled.emplace_back(cur, l);
        m.values.push_back(cur);
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

bool BlockApprox::run(OpIndex op, std::vector<c10::IValue>& stack) const {
  auto it = op_match_.find(op);
  if (it == op_match_.end()) return false;
  const Applied& a = applied_[it->second.applied];
  const Role role = it->second.role;
  if (role == Role::kSdpa) {
    // SDPA over the selected heads, each with its kv head (so grouped-query attention needs no head grouping).
    at::Tensor q = stack.at(0).toTensor(), k = stack.at(1).toTensor(), v = stack.at(2).toTensor();
    std::vector<c10::IValue> sub(stack.begin(), stack.end());
    sub[0] = q.index_select(1, a.units);
    sub[1] = k.index_select(1, a.kv_of_head);
    sub[2] = v.index_select(1, a.kv_of_head);
    if (sub.size() > 5 && sub[5].isTensor()) {
      const at::Tensor mask = sub[5].toTensor();
      if (mask.dim() == 4 && mask.size(1) == a.heads) sub[5] = mask.index_select(1, a.units);
    }
    a.sdpa->callBoxed(sub);
    TAPESAC_INTERNAL_ASSERT(sub.size() == 2, "approximate attention: the SDPA kernel returned ", sub.size(), " values");
    const at::Tensor o_sel = sub[0].toTensor(), lse_sel = sub[1].toTensor();
    at::Tensor out = at::empty_strided(a.out_sizes, a.out_strides, o_sel.options()).zero_();
    out.index_copy_(1, a.units, o_sel);
    // Unselected heads: any finite value (finish() turns them into +inf with w = 0).
    at::Tensor lse = at::empty_strided(a.lse_sizes, a.lse_strides, lse_sel.options()).zero_();
    lse.index_copy_(1, a.units, lse_sel);
    stack.clear();
    stack.emplace_back(std::move(out));
    stack.emplace_back(std::move(lse));
    return true;
  }
  const at::Tensor& cols = role == Role::kQ ? a.q_cols : role == Role::kKv ? a.kv_cols : a.units;
  // Columns not recomputed: 0 for an MLP (its reweighting multiplies them by 0 anyway); 1 for attention, a finite
  // value that per-head norms (rsqrt of a mean square) cannot turn into inf.
  const double fill = role == Role::kColumns ? 0.0 : 1.0;
  at::Tensor part;
  at::Tensor x;
  if (it->second.addmm) {  // addmm(bias, mat1, mat2, beta, alpha)
    x = stack.at(1).toTensor();
    part = at::addmm(stack[0].toTensor().index_select(0, cols), x, stack[2].toTensor().index_select(1, cols),
                     stack[3].toScalar(), stack[4].toScalar());
  } else {  // mm(self, mat2)
    x = stack.at(0).toTensor();
    part = at::mm(x, stack[1].toTensor().index_select(1, cols));
  }
  const int64_t total_cols = it->second.addmm ? stack[2].toTensor().size(1) : stack[1].toTensor().size(1);
  at::Tensor out = at::full({x.size(0), total_cols}, fill, part.options());
  out.index_copy_(1, cols, part);
  stack.clear();
  stack.emplace_back(std::move(out));
  return true;
}

void BlockApprox::finish(std::unordered_map<ValueId, at::Tensor>& rebuilt) const {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (auto& [value, tensor] : rebuilt) {
    auto it = scaled_match_.find(value);
    if (it == scaled_match_.end() || !tensor.defined()) continue;
    const Scale& sc = it->second;
    at::Tensor w = applied_[sc.applied].weights;
    if (w.scalar_type() != tensor.scalar_type()) w = w.to(tensor.scalar_type());
    if (sc.layout.merged) {
      if (sc.group > 1) w = w.repeat_interleave(sc.group);
    } else {
      std::vector<int64_t> shape(static_cast<size_t>(tensor.dim() - sc.layout.axis), 1);
      shape[0] = w.numel();
      w = w.view(shape);
    }
    tensor = sc.log_shift ? at::sub(tensor, at::log(w)) : at::mul(tensor, w);
  }
}

Approx::Approx(ApproxOptions options) : options_(options) {}

void Approx::begin_step() {
  ++step_;
  call_ = 0;
}

namespace {

// Copies a host vector to a tensor on `device` (always a copy: the vector dies with the caller).
template <typename T>
at::Tensor to_device(std::vector<T> v, at::ScalarType host_type, const at::Device& device, at::ScalarType type) {
  return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, host_type).to(device, type, false, true);
}

const at::Tensor* saved_of(const ApproxInput& in, ValueId v) {
  if (v < 0 || static_cast<size_t>(v) >= in.saved.size()) return nullptr;
  const at::Tensor* t = in.saved[static_cast<size_t>(v)];
  return t != nullptr && t->defined() ? t : nullptr;
}

int8_t decided(const ApproxInput& in, ValueId v) {
  return static_cast<size_t>(v) < in.decision.size() ? in.decision[static_cast<size_t>(v)] : int8_t{-1};
}

// Empty when every value of a component is dropped or not saved (some dropped), only `readable` ones saved.
std::string check_saved(const ApproxInput& in, const std::vector<ValueId>& values,
                        const std::unordered_set<ValueId>* readable) {
  bool any_dropped = false;
  for (ValueId v : values) {
    const int8_t d = decided(in, v);
    if (d == 1) return "a value of the component is kept";
    if (d >= 0 && readable != nullptr && !readable->count(v)) return "a value is saved by an op outside the pattern";
    any_dropped = any_dropped || d == 0;
  }
  return any_dropped ? std::string() : std::string("nothing of the component was dropped");
}

std::vector<double> to_host(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU, at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

}  // namespace

std::unique_ptr<BlockApprox> Approx::prepare(const ApproxInput& in, std::vector<ValueId>& keep, ApproxStats& stats) {
  const uint64_t call = call_++;
  const Tape& tape = in.tape;
  auto result = std::make_unique<BlockApprox>();
  std::vector<OpIndex> outputs;  // output ops of the approximated components
  at::NoGradGuard no_grad;
  uint64_t component = 0;
  auto seed_for = [&](uint64_t c) { return splitmix64(options_.seed ^ splitmix64(step_ * 0x100000001B3ull + call) ^ splitmix64(c + 1)); };
  auto k_of = [this](int64_t n) { return std::clamp<int64_t>(std::llround(options_.fraction * static_cast<double>(n)), 1, n); };

  if (options_.mlp) {
    for (MlpMatch& m : match_gated_mlps(tape)) {
      ++component;
      if (m.rejected.empty()) {
        const std::unordered_set<ValueId> readable{m.act_in, m.mul_act, m.mul_up, m.down_in};
        std::vector<ValueId> values = m.scaled;
        values.insert(values.end(), m.unscaled.begin(), m.unscaled.end());
        m.rejected = check_saved(in, values, &readable);
      }
      const at::Tensor* h = saved_of(in, m.down_in);
      if (m.rejected.empty() && h == nullptr) m.rejected = "the down projection's input is not saved";
      if (!m.rejected.empty()) {
        ++stats.mlp_skipped;
        continue;
      }
      const int64_t n = m.units;
      const int64_t k = k_of(n);
      ++stats.mlp;
      stats.units_total += n;
      if (k == n) {  // everything recomputed: the exact replay, bitwise
        stats.units_recomputed += n;
        continue;
      }
      // Importance of unit j: the norm of its contribution to the MLP's output, ||h[:, j]|| * ||W_down[:, j]|| (a
      // rank-one term h[:, j] W_down[:, j]^T, whose Frobenius norm is exactly this product).
      at::Tensor imp = at::linalg_vector_norm(h->reshape({-1, n}), 2, at::IntArrayRef{0}, false, at::kDouble);
      const at::Tensor* w = saved_of(in, m.down_w);
      if (w != nullptr && w->dim() == 2 && w->size(0) == n) {
        imp = imp * at::linalg_vector_norm(*w, 2, at::IntArrayRef{1}, false, at::kDouble);
      }
      const UnitSample sample =
          select_units(to_host(imp), k, options_.method, options_.reweight, options_.defensive, seed_for(component));
      stats.units_recomputed += static_cast<int64_t>(sample.units.size());
      std::vector<double> weights(static_cast<size_t>(n), 0.0);
      for (size_t r = 0; r < sample.units.size(); ++r) weights[static_cast<size_t>(sample.units[r])] = sample.weights[r];
      BlockApprox::Applied a;
      a.total = n;
      a.units = to_device(sample.units, at::kLong, h->device(), at::kLong);
      a.weights = to_device(weights, at::kDouble, h->device(), h->scalar_type());
      const size_t idx = result->applied_.size();
      result->applied_.push_back(std::move(a));
      for (OpIndex p : {m.gate_mm, m.up_mm}) {
        result->op_match_[p] = BlockApprox::OpUse{idx, BlockApprox::Role::kColumns, tape.op(p).kind == kinds().addmm};
      }
      for (ValueId v : m.scaled) result->scaled_match_[v] = BlockApprox::Scale{idx, HeadLayout{true, -1}, 1, false};
      result->approximated_.insert(m.scaled.begin(), m.scaled.end());
      result->approximated_.insert(m.unscaled.begin(), m.unscaled.end());
      outputs.push_back(m.down_mm);
    }
  }

  if (options_.attn) {
    for (AttnMatch& m : match_attention(tape, in.payloads)) {
      ++component;
      if (m.rejected.empty()) m.rejected = check_saved(in, m.values, nullptr);
      const at::Tensor* o_in = saved_of(in, m.o_in);
      if (m.rejected.empty() && o_in == nullptr) m.rejected = "the o projection's input is not saved";
      if (!m.rejected.empty()) {
        ++stats.attn_skipped;
        continue;
      }
      const int64_t n = m.heads, hd = m.head_dim;
      const int64_t k = k_of(n);
      ++stats.attn;
      stats.heads_total += n;
      stats.kv_heads_total += m.kv_heads;
      if (k == n) {
        stats.heads_recomputed += n;
        stats.kv_heads_recomputed += m.kv_heads;
        continue;
      }
      outputs.push_back(m.o_mm);
      // Importance of head h: ||A_h||_F * ||W_o[:, h]||_F, A_h the head's columns of the o projection's input (an
      // upper bound of the norm of its contribution A_h W_o[:, h]^T to the output).
      at::Tensor imp = at::linalg_vector_norm(o_in->reshape({-1, n, hd}), 2, at::IntArrayRef{0, 2}, false, at::kDouble);
      const at::Tensor* w = saved_of(in, m.o_w);
      if (w != nullptr && w->dim() == 2 && w->size(0) == n * hd) {
        imp = imp * at::linalg_vector_norm(w->reshape({n, hd, -1}), 2, at::IntArrayRef{1, 2}, false, at::kDouble);
      }
      const UnitSample sample =
          select_units(to_host(imp), k, options_.method, options_.reweight, options_.defensive, seed_for(component));
      stats.heads_recomputed += static_cast<int64_t>(sample.units.size());
      const int64_t group = n / m.kv_heads;
      std::vector<double> weights(static_cast<size_t>(n), 0.0);
      std::vector<int64_t> q_cols, kv_cols, kv_of_head;
      std::vector<uint8_t> kv_used(static_cast<size_t>(m.kv_heads), 0);
      for (size_t r = 0; r < sample.units.size(); ++r) {
        const int64_t h = sample.units[r];
        weights[static_cast<size_t>(h)] = sample.weights[r];
        for (int64_t d = 0; d < hd; ++d) q_cols.push_back(h * hd + d);
        kv_of_head.push_back(h / group);
        kv_used[static_cast<size_t>(h / group)] = 1;
      }
      for (int64_t g = 0; g < m.kv_heads; ++g) {
        if (!kv_used[static_cast<size_t>(g)]) continue;
        ++stats.kv_heads_recomputed;
        for (int64_t d = 0; d < hd; ++d) kv_cols.push_back(g * hd + d);
      }
      const at::Device dev = o_in->device();
      BlockApprox::Applied a;
      a.total = n;
      a.heads = n;
      a.units = to_device(sample.units, at::kLong, dev, at::kLong);
      a.weights = to_device(weights, at::kDouble, dev, o_in->scalar_type());
      a.q_cols = to_device(q_cols, at::kLong, dev, at::kLong);
      a.kv_cols = to_device(kv_cols, at::kLong, dev, at::kLong);
      a.kv_of_head = to_device(kv_of_head, at::kLong, dev, at::kLong);
      a.sdpa = in.payloads.at(static_cast<size_t>(m.sdpa)).handle;
      a.out_sizes = tape.value(m.out).meta.sizes.vec();
      a.out_strides = tape.value(m.out).meta.strides.vec();
      a.lse_sizes = tape.value(m.lse).meta.sizes.vec();
      a.lse_strides = tape.value(m.lse).meta.strides.vec();
      const size_t idx = result->applied_.size();
      result->applied_.push_back(std::move(a));
      const BlockApprox::Role roles[3] = {BlockApprox::Role::kQ, BlockApprox::Role::kKv, BlockApprox::Role::kKv};
      for (int r = 0; r < 3; ++r) {
        result->op_match_[m.proj[r]] = BlockApprox::OpUse{idx, roles[r], tape.op(m.proj[r]).kind == kinds().addmm};
      }
      result->op_match_[m.sdpa] = BlockApprox::OpUse{idx, BlockApprox::Role::kSdpa, false};
      for (const auto& [v, layout] : m.scaled) {
        result->scaled_match_[v] = BlockApprox::Scale{idx, layout, layout.merged ? hd : 1, false};
      }
      result->scaled_match_[m.lse] = BlockApprox::Scale{idx, HeadLayout{false, 1}, 1, true};
      result->approximated_.insert(m.values.begin(), m.values.end());
    }
  }

  // Dropped values whose replay would run an approximated component's output op (e.g. the residual stream after
  // attention, which the next norm saves) are kept: in tape order, so that one kept value (the residual) cuts the
  // closures of everything after it.
  if (!outputs.empty()) {
    std::vector<uint8_t> available(tape.values().size(), 0);
    for (size_t v = 0; v < available.size() && v < in.decision.size(); ++v) available[v] = in.decision[v] == 1 ? 1 : 0;
    const std::unordered_set<OpIndex> outs(outputs.begin(), outputs.end());
    for (ValueId v = 0; v < static_cast<ValueId>(in.decision.size()); ++v) {
      if (in.decision[static_cast<size_t>(v)] != 0 || saved_of(in, v) == nullptr) continue;
      const int32_t state = static_cast<size_t>(v) < in.state.size() ? in.state[static_cast<size_t>(v)] : 0;
      const PruneResult r = prune(tape, {Read{v, state}}, available);
      bool reads_output = false;
      for (OpIndex i : r.ops) reads_output = reads_output || outs.count(i) != 0;
      if (!reads_output) continue;
      keep.push_back(v);
      available[static_cast<size_t>(v)] = 1;
      ++stats.kept_values;
    }
  }
  if (result->empty()) return nullptr;
  return result;
}

}  // namespace tapesac::replay
