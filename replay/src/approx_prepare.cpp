// Approximate rematerialization, unit sampling and preparation (approx.h): select_units draws the units replay
// recomputes (greedy or the sketch); Approx::prepare, at the end of a block call's forward, takes the components
// the matchers found (approx_match.cpp), rejects those with a value kept or not saved, measures each unit's
// importance from the tensors the forward saved, draws the units, and builds the call's BlockApprox (which
// approx_replay.cpp runs); it also names the dropped values to keep because their replay would read an
// approximated component's output.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <unordered_set>

#include <ATen/ATen.h>

#include "approx_internal.h"
#include "tapesac/replay/approx.h"

namespace tapesac::replay {

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

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

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

// Importance of MLP unit j: the norm of its contribution to the MLP's output, ||h[:, j]|| * ||W_down[:, j]|| (a
// rank-one term h[:, j] W_down[:, j]^T, whose Frobenius norm is exactly this product). `w` may be null (not saved).
at::Tensor mlp_importance(const at::Tensor& h, const at::Tensor* w, int64_t n) {
  at::Tensor imp = at::linalg_vector_norm(h.reshape({-1, n}), 2, at::IntArrayRef{0}, false, at::kDouble);
  if (w != nullptr && w->dim() == 2 && w->size(0) == n) {
    imp = imp * at::linalg_vector_norm(*w, 2, at::IntArrayRef{1}, false, at::kDouble);
  }
  return imp;
}

// Importance of head h: ||A_h||_F * ||W_o[:, h]||_F, A_h the head's columns of the o projection's input (an upper
// bound of the norm of its contribution A_h W_o[:, h]^T to the output). `w` may be null (not saved).
at::Tensor head_importance(const at::Tensor& o_in, const at::Tensor* w, int64_t n, int64_t hd) {
  at::Tensor imp = at::linalg_vector_norm(o_in.reshape({-1, n, hd}), 2, at::IntArrayRef{0, 2}, false, at::kDouble);
  if (w != nullptr && w->dim() == 2 && w->size(0) == n * hd) {
    imp = imp * at::linalg_vector_norm(w->reshape({n, hd, -1}), 2, at::IntArrayRef{1, 2}, false, at::kDouble);
  }
  return imp;
}

// What replay computes of an attention for the selected heads: their weights (0 elsewhere), the q projection's
// columns, the k/v projections' columns (those of the selected heads' kv heads) and each selected head's kv head.
struct HeadColumns {
  std::vector<double> weights;
  std::vector<int64_t> q_cols, kv_cols, kv_of_head;
  int64_t kv_heads_recomputed = 0;
};

HeadColumns head_columns(const UnitSample& sample, const AttnMatch& m) {
  const int64_t n = m.heads, hd = m.head_dim;
  const int64_t group = n / m.kv_heads;
  HeadColumns c;
  c.weights.assign(static_cast<size_t>(n), 0.0);
  std::vector<uint8_t> kv_used(static_cast<size_t>(m.kv_heads), 0);
  for (size_t r = 0; r < sample.units.size(); ++r) {
    const int64_t h = sample.units[r];
    c.weights[static_cast<size_t>(h)] = sample.weights[r];
    for (int64_t d = 0; d < hd; ++d) c.q_cols.push_back(h * hd + d);
    c.kv_of_head.push_back(h / group);
    kv_used[static_cast<size_t>(h / group)] = 1;
  }
  for (int64_t g = 0; g < m.kv_heads; ++g) {
    if (!kv_used[static_cast<size_t>(g)]) continue;
    ++c.kv_heads_recomputed;
    for (int64_t d = 0; d < hd; ++d) c.kv_cols.push_back(g * hd + d);
  }
  return c;
}

// Dropped values whose replay would run an approximated component's output op (`outputs`; e.g. the residual
// stream after attention, which the next norm saves) are appended to `keep`: in tape order, so that one kept value
// (the residual) cuts the closures of everything after it.
void keep_readers_of_outputs(const ApproxInput& in, const std::vector<OpIndex>& outputs, std::vector<ValueId>& keep,
                             ApproxStats& stats) {
  const Tape& tape = in.tape;
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

}  // namespace

// One prepare() call: its input, index and statistics, the BlockApprox being built and the output ops of the
// components it approximates.
struct Approx::Call {
  Call(const ApproxInput& input, uint64_t call_index, ApproxStats& call_stats)
      : in(input), index(call_index), stats(call_stats) {}

  const ApproxInput& in;
  uint64_t index;
  ApproxStats& stats;
  uint64_t component = 0;  // components matched so far (approximated or not): the sampling seeds' counter
  std::unique_ptr<BlockApprox> result = std::make_unique<BlockApprox>();
  std::vector<OpIndex> outputs;
};

Approx::Approx(ApproxOptions options) : options_(options) {}

void Approx::begin_step() {
  ++step_;
  call_ = 0;
}

uint64_t Approx::seed_for(uint64_t call, uint64_t component) const {
  return splitmix64(options_.seed ^ splitmix64(step_ * 0x100000001B3ull + call) ^ splitmix64(component + 1));
}

int64_t Approx::units_to_recompute(int64_t n) const {
  return std::clamp<int64_t>(std::llround(options_.fraction * static_cast<double>(n)), 1, n);
}

void Approx::add_mlp(Call& c, MlpMatch& m) const {
  const uint64_t component = ++c.component;
  if (m.rejected.empty()) {
    const std::unordered_set<ValueId> readable{m.act_in, m.mul_act, m.mul_up, m.down_in};
    std::vector<ValueId> values = m.scaled;
    values.insert(values.end(), m.unscaled.begin(), m.unscaled.end());
    m.rejected = check_saved(c.in, values, &readable);
  }
  const at::Tensor* h = saved_of(c.in, m.down_in);
  if (m.rejected.empty() && h == nullptr) m.rejected = "the down projection's input is not saved";
  if (!m.rejected.empty()) {
    ++c.stats.mlp_skipped;
    return;
  }
  const int64_t n = m.units;
  const int64_t k = units_to_recompute(n);
  ++c.stats.mlp;
  c.stats.units_total += n;
  if (k == n) {  // everything recomputed: the exact replay, bitwise
    c.stats.units_recomputed += n;
    return;
  }
  const UnitSample sample = select_units(to_host(mlp_importance(*h, saved_of(c.in, m.down_w), n)), k,
                                         options_.method, options_.reweight, options_.defensive,
                                         seed_for(c.index, component));
  c.stats.units_recomputed += static_cast<int64_t>(sample.units.size());
  std::vector<double> weights(static_cast<size_t>(n), 0.0);
  for (size_t r = 0; r < sample.units.size(); ++r) weights[static_cast<size_t>(sample.units[r])] = sample.weights[r];
  BlockApprox::Applied a;
  a.total = n;
  a.units = to_device(sample.units, at::kLong, h->device(), at::kLong);
  a.weights = to_device(weights, at::kDouble, h->device(), h->scalar_type());
  BlockApprox& result = *c.result;
  const size_t idx = result.applied_.size();
  result.applied_.push_back(std::move(a));
  for (OpIndex p : {m.gate_mm, m.up_mm}) {
    result.op_match_[p] = BlockApprox::OpUse{idx, BlockApprox::Role::kColumns, is_addmm(c.in.tape.op(p))};
  }
  for (ValueId v : m.scaled) result.scaled_match_[v] = BlockApprox::Scale{idx, HeadLayout{true, -1}, 1, false};
  result.approximated_.insert(m.scaled.begin(), m.scaled.end());
  result.approximated_.insert(m.unscaled.begin(), m.unscaled.end());
  c.outputs.push_back(m.down_mm);
}

void Approx::add_attention(Call& c, AttnMatch& m) const {
  const uint64_t component = ++c.component;
  if (m.rejected.empty()) m.rejected = check_saved(c.in, m.values, nullptr);
  const at::Tensor* o_in = saved_of(c.in, m.o_in);
  if (m.rejected.empty() && o_in == nullptr) m.rejected = "the o projection's input is not saved";
  if (!m.rejected.empty()) {
    ++c.stats.attn_skipped;
    return;
  }
  const int64_t n = m.heads, hd = m.head_dim;
  const int64_t k = units_to_recompute(n);
  ++c.stats.attn;
  c.stats.heads_total += n;
  c.stats.kv_heads_total += m.kv_heads;
  if (k == n) {
    c.stats.heads_recomputed += n;
    c.stats.kv_heads_recomputed += m.kv_heads;
    return;
  }
  c.outputs.push_back(m.o_mm);
  const UnitSample sample = select_units(to_host(head_importance(*o_in, saved_of(c.in, m.o_w), n, hd)), k,
                                         options_.method, options_.reweight, options_.defensive,
                                         seed_for(c.index, component));
  c.stats.heads_recomputed += static_cast<int64_t>(sample.units.size());
  const HeadColumns cols = head_columns(sample, m);
  c.stats.kv_heads_recomputed += cols.kv_heads_recomputed;
  const at::Device dev = o_in->device();
  const Tape& tape = c.in.tape;
  BlockApprox::Applied a;
  a.total = n;
  a.heads = n;
  a.units = to_device(sample.units, at::kLong, dev, at::kLong);
  a.weights = to_device(cols.weights, at::kDouble, dev, o_in->scalar_type());
  a.q_cols = to_device(cols.q_cols, at::kLong, dev, at::kLong);
  a.kv_cols = to_device(cols.kv_cols, at::kLong, dev, at::kLong);
  a.kv_of_head = to_device(cols.kv_of_head, at::kLong, dev, at::kLong);
  a.sdpa = c.in.payloads.at(static_cast<size_t>(m.sdpa)).handle;
  a.out_sizes = tape.value(m.out).meta.sizes.vec();
  a.out_strides = tape.value(m.out).meta.strides.vec();
  a.lse_sizes = tape.value(m.lse).meta.sizes.vec();
  a.lse_strides = tape.value(m.lse).meta.strides.vec();
  a.mask_arg = m.mask_arg;
  BlockApprox& result = *c.result;
  const size_t idx = result.applied_.size();
  result.applied_.push_back(std::move(a));
  const BlockApprox::Role roles[3] = {BlockApprox::Role::kQ, BlockApprox::Role::kKv, BlockApprox::Role::kKv};
  for (int r = 0; r < 3; ++r) {
    result.op_match_[m.proj[r]] = BlockApprox::OpUse{idx, roles[r], is_addmm(tape.op(m.proj[r]))};
  }
  result.op_match_[m.sdpa] = BlockApprox::OpUse{idx, BlockApprox::Role::kSdpa, false};
  for (const auto& [v, layout] : m.scaled) {
    result.scaled_match_[v] = BlockApprox::Scale{idx, layout, layout.merged ? hd : 1, false};
  }
  result.scaled_match_[m.lse] = BlockApprox::Scale{idx, HeadLayout{false, 1}, 1, true};
  result.approximated_.insert(m.values.begin(), m.values.end());
}

std::unique_ptr<BlockApprox> Approx::prepare(const ApproxInput& in, std::vector<ValueId>& keep, ApproxStats& stats) {
  Call c(in, call_++, stats);
  at::NoGradGuard no_grad;
  if (options_.mlp) {
    for (MlpMatch& m : match_gated_mlps(in.tape)) add_mlp(c, m);
  }
  if (options_.attn) {
    for (AttnMatch& m : match_attention(in.tape, in.payloads)) add_attention(c, m);
  }
  if (!c.outputs.empty()) keep_readers_of_outputs(in, c.outputs, keep, stats);
  if (c.result->empty()) return nullptr;
  return std::move(c.result);
}

}  // namespace tapesac::replay
