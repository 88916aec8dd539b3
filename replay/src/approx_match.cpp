// Approximate rematerialization, tape matching (approx.h): finds the components prepare() may approximate, gated MLPs
// (match_gated_mlps) and attention (match_attention), from the tape's ops, shapes and data flow alone, and says why
// a candidate is unsafe (a reader outside the pattern, an in-place write, an op that may mix heads, ...). Pure
// functions of the tape (and the ops' constant arguments); thread-compatible.
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "approx_internal.h"
#include "tapesac/capture/op_kinds.h"
#include "tapesac/replay/approx.h"

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

// The SDPA kernels whose backward reads the forward's logsumexp to rebuild the attention probabilities as
// exp(scores - logsumexp) (Note [Approximate attention] in approx.h): boxed positions of dropout_p and of the
// attention mask / bias (-1: none). CPU flash: (q, k, v, dropout_p, is_causal, attn_mask?, *, scale?); CUDA flash:
// (q, k, v, dropout_p, is_causal, return_debug_mask, *, scale?); memory-efficient: (q, k, v, attn_bias?,
// compute_log_sumexp, dropout_p, is_causal, *, scale?); cuDNN: (q, k, v, attn_bias?, compute_log_sumexp, dropout_p,
// is_causal, return_debug_mask, *, scale?). Outputs 0 and 1 are the attention and its logsumexp ([B, heads, ...]);
// the others (sequence offsets, the philox state, the debug mask) are read by the backward only.
struct SdpaSpec {
  OpKind kind;
  int dropout_arg;
  int mask_arg;
};

const std::vector<SdpaSpec>& sdpa_specs() {
  static const std::vector<SdpaSpec> specs = [] {
    auto id = [](const char* n) { return capture::intern_op_kind(n); };
    return std::vector<SdpaSpec>{{id("aten::_scaled_dot_product_flash_attention_for_cpu"), 3, 5},
                                 {id("aten::_scaled_dot_product_flash_attention"), 3, -1},
                                 {id("aten::_scaled_dot_product_efficient_attention"), 5, 3},
                                 {id("aten::_scaled_dot_product_cudnn_attention"), 5, 3}};
  }();
  return specs;
}

const SdpaSpec* sdpa_spec(OpKind k) {
  for (const SdpaSpec& s : sdpa_specs()) {
    if (s.kind == k) return &s;
  }
  return nullptr;
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


// Per value, how many op inputs read it; `last_reader` (optional) receives the last op reading each (-1: none).
std::vector<int32_t> count_uses(const Tape& tape, std::vector<OpIndex>* last_reader) {
  const auto& ops = tape.ops();
  std::vector<int32_t> uses(tape.values().size(), 0);
  if (last_reader != nullptr) last_reader->assign(tape.values().size(), -1);
  for (OpIndex i = 0; i < static_cast<OpIndex>(ops.size()); ++i) {
    for (const ArgRef& a : ops[static_cast<size_t>(i)].inputs) {
      ++uses[static_cast<size_t>(a.value)];
      if (last_reader != nullptr) (*last_reader)[static_cast<size_t>(a.value)] = i;
    }
  }
  return uses;
}

}  // namespace

bool is_addmm(const capture::OpRecord& op) { return op.kind == kinds().addmm; }

namespace {

// The gate and up branches of the product `mul` (h_chain: from the down projection's input back to it), taking
// factor `fa` as the activation of a projection (the gate) and `fu` as a projection (the up). Fills `m`'s ops and
// value chains; false when the factors do not fit that way round.
bool match_gate_up(const Tape& tape, OpIndex mul, const ArgRef& fa, const ArgRef& fu,
                   const std::vector<ValueId>& h_chain, MlpMatch& m) {
  std::vector<ValueId> a_chain, u_chain, g_chain;
  const OpIndex act = back_through_reshapes(tape, fa.value, m.units, a_chain);
  if (act == kExternal) return false;
  const OpRecord& act_op = tape.op(act);
  if ((act_op.kind != kinds().silu && act_op.kind != kinds().gelu) || act_op.outputs.size() != 1) return false;
  const OpIndex up = back_through_reshapes(tape, fu.value, m.units, u_chain);
  if (up == kExternal || !is_projection(tape, up, m.units)) return false;
  const ArgRef* act_in = arg_of(act_op, 0);
  if (act_in == nullptr) return false;
  const OpIndex gate = back_through_reshapes(tape, act_in->value, m.units, g_chain);
  if (gate == kExternal || gate == up || !is_projection(tape, gate, m.units)) return false;
  m.gate_mm = gate;
  m.up_mm = up;
  m.act = act;
  m.mul = mul;
  m.act_in = act_in->value;
  m.mul_act = fa.value;
  m.mul_up = fu.value;
  m.unscaled = g_chain;
  m.scaled = a_chain;
  m.scaled.insert(m.scaled.end(), u_chain.begin(), u_chain.end());
  m.scaled.insert(m.scaled.end(), h_chain.begin(), h_chain.end());
  return true;
}

// Safety on the tape alone: every value of the pattern is read once (by the next op of the pattern) and its
// storage is written once (no in-place op), so that changing it changes nothing outside the pattern. Empty when
// it holds.
std::string mlp_rejection(const Tape& tape, const std::vector<int32_t>& uses, const MlpMatch& m) {
  std::string rejected;
  for (const auto* vs : {&m.scaled, &m.unscaled}) {
    for (ValueId v : *vs) {
      if (uses[static_cast<size_t>(v)] != 1) rejected = "a value of the MLP has a reader outside the pattern";
      if (tape.storage(tape.value(v).storage).writers.size() != 1) rejected = "a value of the MLP is written in place";
    }
  }
  return rejected;
}

}  // namespace

std::vector<MlpMatch> match_gated_mlps(const Tape& tape) {
  const auto& ops = tape.ops();
  const std::vector<int32_t> uses = count_uses(tape, nullptr);
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
    if (!match_gate_up(tape, mul, *f0, *f1, h_chain, m) && !match_gate_up(tape, mul, *f1, *f0, h_chain, m)) continue;
    m.rejected = mlp_rejection(tape, uses, m);
    out.push_back(std::move(m));
  }
  return out;
}

namespace {

int64_t norm_dim(int64_t d, int64_t ndim) { return d < 0 ? d + ndim : d; }

std::vector<int64_t> sizes_of(const Tape& tape, ValueId v) { return tape.value(v).meta.sizes.vec(); }
// One step of a head layout through a head-local op: the input on the branch and the op's output.
struct LayoutStep {
  const capture::OpPayload& payload;
  const OpRecord& op;
  const std::vector<int64_t>& os;  // output sizes
  int64_t on;
  const std::vector<int64_t>& is;  // the input's sizes
  int64_t in_n;
  HeadLayout in;  // the input's layout
  int64_t heads, head_dim, cols;  // cols = heads * head_dim

  bool int_arg(size_t i, int64_t& v) const {
    if (i >= payload.args.size() || !payload.args[i].isInt()) return false;
    v = payload.args[i].toInt();
    return true;
  }
};

// view / _unsafe_view / _reshape_alias: merged heads may split into [..., heads, head_dim] or stay merged;
// [..., heads, head_dim] may merge back.
bool through_reshape(const LayoutStep& s, HeadLayout& r) {
  if (s.in.merged) {
    if (s.on >= 1 && s.os[s.on - 1] == s.cols) {
      r = HeadLayout{true, -1};
    } else if (s.on >= 2 && s.os[s.on - 2] == s.heads && s.os[s.on - 1] == s.head_dim) {
      r = HeadLayout{false, static_cast<int>(s.on - 2)};
    } else {
      return false;
    }
  } else if (s.os == s.is) {
    r = s.in;
  } else if (s.in.axis == s.in_n - 2 && s.is[s.in_n - 1] == s.head_dim && s.on >= 1 && s.os[s.on - 1] == s.cols) {
    r = HeadLayout{true, -1};
  } else {
    return false;
  }
  return true;
}

bool through_transpose(const LayoutStep& s, HeadLayout& r) {
  int64_t d0 = 0, d1 = 0;
  if (!s.int_arg(1, d0) || !s.int_arg(2, d1)) return false;
  d0 = norm_dim(d0, s.on);
  d1 = norm_dim(d1, s.on);
  if (s.in.merged) {
    if (d0 == s.on - 1 || d1 == s.on - 1) return false;
    r = s.in;
  } else {
    r = s.in;
    if (s.in.axis == d0) r.axis = static_cast<int>(d1);
    else if (s.in.axis == d1) r.axis = static_cast<int>(d0);
  }
  return true;
}

bool through_unsqueeze(const LayoutStep& s, HeadLayout& r) {
  int64_t d = 0;
  if (!s.int_arg(1, d)) return false;
  d = norm_dim(d, s.on);
  if (s.in.merged) {
    if (d == s.on - 1) return false;
    r = s.in;
  } else {
    r = HeadLayout{false, static_cast<int>(s.in.axis + (d <= s.in.axis ? 1 : 0))};
  }
  return true;
}

// slice / cat along a dim other than the heads' (cat: every piece on the branch).
bool through_slice_or_cat(const LayoutStep& s, const std::unordered_map<ValueId, HeadLayout>& lay, HeadLayout& r) {
  int64_t d = 0;
  if (s.in.merged || !s.int_arg(1, d) || norm_dim(d, s.on) == s.in.axis) return false;
  if (s.op.kind == kinds().cat) {
    for (const ArgRef& b : s.op.inputs) {
      if (!lay.count(b.value)) return false;  // a piece from outside the branch
    }
  }
  r = s.in;
  return true;
}

// mean.dim / sum.dim_IntList over dims other than the heads'.
bool through_reduction(const LayoutStep& s, HeadLayout& r) {
  const auto& args = s.payload.args;
  if (args.size() < 3 || !args[1].isIntList() || !args[2].isBool()) return false;
  const std::vector<int64_t> dims = args[1].toIntVector();
  if (dims.empty()) return false;
  const bool keepdim = args[2].toBool();
  int shift = 0;
  for (int64_t d : dims) {
    d = norm_dim(d, s.in_n);
    if (s.in.merged ? d == s.in_n - 1 : d == s.in.axis) return false;
    if (!s.in.merged && d < s.in.axis) ++shift;
  }
  r = s.in;
  if (!s.in.merged && !keepdim) r.axis -= shift;
  return true;
}

// Elementwise ops (broadcasting may add leading dims).
bool through_elementwise(const LayoutStep& s, HeadLayout& r) {
  if (s.in.merged) {
    if (s.on < 1 || s.os[s.on - 1] != s.cols) return false;
    r = s.in;
  } else {
    r = HeadLayout{false, static_cast<int>(s.in.axis + (s.on - s.in_n))};
  }
  return true;
}

// The layout of the output for input `a` (argument position a.arg) of the step's op; false when the op could mix
// heads or is unknown.
bool through_op(const LayoutStep& s, const ArgRef& a, const std::unordered_map<ValueId, HeadLayout>& lay,
                HeadLayout& r) {
  const Kinds& K = kinds();
  const OpKind k = s.op.kind;
  if (is_reshape(k)) return a.arg == 0 && through_reshape(s, r);
  if (k == K.transpose) return through_transpose(s, r);
  if (k == K.unsqueeze) return through_unsqueeze(s, r);
  if (k == K.slice || k == K.cat) return through_slice_or_cat(s, lay, r);
  if (k == K.mean_dim || k == K.sum_dim) return through_reduction(s, r);
  if (K.elementwise.count(k)) return through_elementwise(s, r);
  return false;
}

// The layout of `op`'s output from the layout of its head-carrying input(s), for the head-local ops an attention
// branch may contain; false when the op could mix heads (or is unknown). `lay` holds the layouts of the branch's
// values so far.
bool propagate_layout(const Tape& tape, const capture::OpPayload& payload, const OpRecord& op,
                      const std::unordered_map<ValueId, HeadLayout>& lay, int64_t heads, int64_t head_dim,
                      HeadLayout& out) {
  if (op.outputs.size() != 1 || op.outputs[0] < 0) return false;
  const std::vector<int64_t> os = sizes_of(tape, op.outputs[0]);
  const auto on = static_cast<int64_t>(os.size());
  // Every input on the branch, aligned to the output's dims, must agree.
  bool first = true;
  for (const ArgRef& a : op.inputs) {
    auto it = lay.find(a.value);
    if (it == lay.end()) continue;
    const std::vector<int64_t> is = sizes_of(tape, a.value);
    const LayoutStep step{payload, op, os, on, is, static_cast<int64_t>(is.size()), it->second,
                          heads, head_dim, heads * head_dim};
    HeadLayout r;
    if (!through_op(step, a, lay, r)) return false;
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


// The SDPA op at `s` and the shapes of its q and k: [B, heads, T, d] and [B, kv_heads, T, d] with kv_heads dividing
// heads. False when `s` is not such an op; `m.rejected` set when it is but attention dropout is on.
bool attention_at(const Tape& tape, const std::vector<capture::OpPayload>& payloads, OpIndex s, AttnMatch& m) {
  const OpRecord& op = tape.op(s);
  const SdpaSpec* spec = sdpa_spec(op.kind);
  if (spec == nullptr || op.outputs.size() < 2) return false;
  const capture::OpPayload& payload = payloads.at(static_cast<size_t>(s));
  const ArgRef* q = arg_of(op, 0);
  const ArgRef* k = arg_of(op, 1);
  const ArgRef* v = arg_of(op, 2);
  if (q == nullptr || k == nullptr || v == nullptr) return false;
  m.sdpa = s;
  const auto qs = sizes_of(tape, q->value);
  const auto ks = sizes_of(tape, k->value);
  if (qs.size() != 4 || ks.size() != 4 || ks[1] <= 0 || qs[1] % ks[1] != 0 || qs[3] != ks[3]) return false;
  m.heads = qs[1];
  m.kv_heads = ks[1];
  m.head_dim = qs[3];
  m.out = op.outputs[0];
  m.lse = op.outputs[1];
  m.mask_arg = spec->mask_arg;
  const auto d = static_cast<size_t>(spec->dropout_arg);
  if (payload.args.size() <= d || !payload.args[d].isDouble() || payload.args[d].toDouble() != 0.0) {
    m.rejected = "attention dropout is on";
  } else if (m.out < 0 || m.lse < 0 || sizes_of(tape, m.lse).size() < 2 || sizes_of(tape, m.lse)[1] != m.heads ||
             sizes_of(tape, m.lse)[0] != qs[0]) {
    m.rejected = "the attention kept no logsumexp of [B, heads, ...] (compute_log_sumexp off?)";
  }
  for (size_t j = 2; j < op.outputs.size(); ++j) m.extra.push_back(op.outputs[j]);
  return true;
}

// The q, k and v branches: each from its own projection through head-local ops only (check_branch).
void match_projections(const Tape& tape, const std::vector<capture::OpPayload>& payloads,
                       const std::vector<int32_t>& uses, AttnMatch& m) {
  const OpRecord& sdpa = tape.op(m.sdpa);
  const int64_t cols[3] = {m.heads * m.head_dim, m.kv_heads * m.head_dim, m.kv_heads * m.head_dim};
  for (int r = 0; r < 3 && m.rejected.empty(); ++r) {
    m.proj[r] = find_projection(tape, arg_of(sdpa, r)->value, cols[r]);
    if (m.proj[r] < 0 || !is_projection(tape, m.proj[r], cols[r])) {
      m.rejected = "q, k or v does not come from one projection";
      break;
    }
    if (r > 0 && (m.proj[r] == m.proj[0] || (r == 2 && m.proj[2] == m.proj[1]))) m.rejected = "a projection is shared";
    if (m.rejected.empty()) {
      m.rejected = check_branch(tape, payloads, uses, m.proj[r], m.sdpa, r, r == 0 ? m.heads : m.kv_heads,
                                m.head_dim, m.values);
    }
  }
}

// The o branch: the attention's output -> reshapes/transposes -> the o projection's input, each value read once.
void match_o_branch(const Tape& tape, const std::vector<capture::OpPayload>& payloads,
                    const std::vector<int32_t>& uses, const std::vector<OpIndex>& reader, AttnMatch& m) {
  if (m.lse < 0 || uses[static_cast<size_t>(m.lse)] != 0) m.rejected = "the attention's logsumexp is read";
  for (ValueId x : m.extra) {
    if (x >= 0 && uses[static_cast<size_t>(x)] != 0) m.rejected = "an extra output of the attention kernel is read";
  }
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
    const OpRecord& cop = tape.op(c);
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
    const bool reshaping = is_reshape(cop.kind) || cop.kind == kinds().transpose || cop.kind == kinds().clone;
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

}  // namespace

std::vector<AttnMatch> match_attention(const Tape& tape, const std::vector<capture::OpPayload>& payloads) {
  std::vector<OpIndex> reader;
  const std::vector<int32_t> uses = count_uses(tape, &reader);
  std::vector<AttnMatch> out;
  for (OpIndex s = 0; s < static_cast<OpIndex>(tape.ops().size()); ++s) {
    AttnMatch m;
    if (!attention_at(tape, payloads, s, m)) continue;
    if (m.rejected.empty()) match_projections(tape, payloads, uses, m);
    if (m.rejected.empty()) match_o_branch(tape, payloads, uses, reader, m);
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace tapesac::replay
