// Helpers for the planner tests: a builder for hand-made block problems, seeded random problems, a synthetic
// transformer-like block, and brute-force references that use only the public evaluation functions (evaluate.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tapesac/planner/evaluate.h"
#include "tapesac/planner/problem.h"

namespace tapesac::planner::testing {

constexpr int64_t kMiB = int64_t{1} << 20;

/// Builds a BlockProblem op by op, in tape order.
class ProblemBuilder {
 public:
  BlockProblem problem;

  explicit ProblemBuilder(std::string signature = "test") { problem.signature = std::move(signature); }

  /// An external value (block input, parameter).
  int32_t ext(int64_t bytes = kMiB, int32_t storage = kOwnStorage) {
    problem.values.push_back(PlanValue{bytes, kExternalProducer, storage});
    return last_value();
  }

  /// An op reading `inputs` and producing one value per entry of `out_bytes`; returns the outputs.
  std::vector<int32_t> multi(const std::string& name, double cost, const std::vector<int32_t>& inputs,
                             const std::vector<int64_t>& out_bytes, bool replayable = true) {
    PlanOp op;
    op.name = name;
    op.cost_ns = cost;
    op.inputs = inputs;
    op.replayable = replayable;
    const int32_t index = static_cast<int32_t>(problem.ops.size());
    for (int64_t b : out_bytes) {
      problem.values.push_back(PlanValue{b, index, kOwnStorage});
      op.outputs.push_back(last_value());
    }
    problem.ops.push_back(std::move(op));
    return problem.ops.back().outputs;
  }

  int32_t op(const std::string& name, double cost, const std::vector<int32_t>& inputs, int64_t bytes = kMiB,
             bool replayable = true) {
    return multi(name, cost, inputs, {bytes}, replayable).front();
  }

  /// An op whose output shares the storage of `base` (a view, or an in-place write when the op also reads
  /// `others`): the output is a new value (SSA) with base's bytes.
  int32_t alias(const std::string& name, double cost, int32_t base, const std::vector<int32_t>& others = {},
                bool replayable = true) {
    int32_t& s = problem.values[static_cast<size_t>(base)].storage;
    if (s == kOwnStorage) s = next_storage_++;
    const int32_t storage = s;
    const int64_t bytes = problem.values[static_cast<size_t>(base)].bytes;
    std::vector<int32_t> inputs{base};
    inputs.insert(inputs.end(), others.begin(), others.end());
    const int32_t out = op(name, cost, inputs, bytes, replayable);
    problem.values[static_cast<size_t>(out)].storage = storage;
    return out;
  }

  /// Marks `v` as a candidate; returns its candidate index.
  int32_t save(int32_t v, bool must_keep = false) {
    problem.candidates.push_back(v);
    problem.must_keep.push_back(must_keep ? 1 : 0);
    return static_cast<int32_t>(problem.candidates.size()) - 1;
  }

 private:
  int32_t last_value() const { return static_cast<int32_t>(problem.values.size()) - 1; }
  int32_t next_storage_ = 0;
};

struct RandomOptions {
  int32_t n_ops = 40;
  int32_t n_candidates = 12;
  int32_t n_external = 2;
  double p_multi_output = 0.1;
  double p_view = 0.08;
  double p_inplace = 0.06;
  double p_must_keep = 0.05;
  double p_non_replayable = 0.02;
};

/// A random block problem. Ops read 1-3 values, mostly recent ones (locality, as in real tapes); costs are
/// heavy-tailed (50% cheap elementwise 1-10, 30% medium 10-100, 20% heavy 100-2000); sizes are 1, 2, 4 or 8 MiB
/// (small statistics outputs of 4 KiB for multi-output ops); views and in-place writes share their base's storage;
/// candidates are a random subset of the produced values.
inline BlockProblem random_problem(uint64_t seed, const RandomOptions& o = {}) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  auto log_uniform = [&](double lo, double hi) { return lo * std::pow(hi / lo, unit(rng)); };
  auto cost = [&]() {
    const double u = unit(rng);
    return u < 0.5 ? log_uniform(1, 10) : u < 0.8 ? log_uniform(10, 100) : log_uniform(100, 2000);
  };
  auto size = [&]() { return kMiB << std::uniform_int_distribution<int>(0, 3)(rng); };
  ProblemBuilder b("random-" + std::to_string(seed));
  std::vector<int32_t> live;  // newest version of each storage, in creation order
  for (int32_t i = 0; i < o.n_external; ++i) live.push_back(b.ext(size()));
  auto pick = [&]() {
    // Geometric preference for recent values.
    std::geometric_distribution<int> back(0.35);
    const int k = std::min<int>(back(rng), static_cast<int>(live.size()) - 1);
    return static_cast<int32_t>(live.size()) - 1 - k;
  };
  std::vector<int32_t> produced;
  for (int32_t i = 0; i < o.n_ops; ++i) {
    const double u = unit(rng);
    const bool replayable = unit(rng) >= o.p_non_replayable;
    const int32_t slot = pick();
    const int32_t base = live[static_cast<size_t>(slot)];
    const bool base_external = b.problem.values[static_cast<size_t>(base)].producer == kExternalProducer;
    if (u < o.p_view) {
      const int32_t v = b.alias("view" + std::to_string(i), 0.01, base, {}, replayable);
      live.push_back(v);
      produced.push_back(v);
    } else if (u < o.p_view + o.p_inplace && !base_external) {
      const int32_t other = live[static_cast<size_t>(pick())];
      const int32_t v = b.alias("inplace" + std::to_string(i), cost(), base, {other}, replayable);
      live[static_cast<size_t>(slot)] = v;
      produced.push_back(v);
    } else {
      std::vector<int32_t> inputs{base};
      const int n_more = std::uniform_int_distribution<int>(0, 2)(rng);
      for (int k = 0; k < n_more; ++k) inputs.push_back(live[static_cast<size_t>(pick())]);
      std::vector<int64_t> outs{size()};
      if (unit(rng) < o.p_multi_output) outs.push_back(unit(rng) < 0.5 ? 4096 : size());
      for (int32_t v : b.multi("op" + std::to_string(i), cost(), inputs, outs, replayable)) {
        live.push_back(v);
        produced.push_back(v);
      }
    }
  }
  std::shuffle(produced.begin(), produced.end(), rng);
  produced.resize(std::min<size_t>(produced.size(), static_cast<size_t>(o.n_candidates)));
  std::sort(produced.begin(), produced.end());
  for (int32_t v : produced) b.save(v, unit(rng) < o.p_must_keep);
  return b.problem;
}

/// A synthetic transformer block of `d` model width and `tokens` tokens in bf16: attention (q/k/v/out matmuls,
/// views, rope, an attention op with a small logsumexp output), an MoE-style MLP of `experts` experts (router,
/// gather, gate/up matmuls, silu, mul, down, scatter-add), norms, residual adds, and cheap elementwise filler ops
/// until the block has about `target_ops` ops; the values autograd would save are candidates (~60 for the defaults).
/// Costs are proportional to FLOPs (matmuls) or bytes (elementwise), with +-20% seeded noise.
inline BlockProblem transformer_block(uint64_t seed, int32_t target_ops = 300, int32_t experts = 8) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> noise(0.8, 1.2);
  const int64_t tokens = 4096, d = 4096, ffn = 1408;  // per expert
  const int64_t act = tokens * d * 2;
  ProblemBuilder b("transformer");
  auto mm = [&](const char* name, int32_t x, int64_t n_out, int64_t k) {
    const double flops = 2.0 * static_cast<double>(tokens) * static_cast<double>(k) * static_cast<double>(n_out);
    return b.op(name, flops / 400e3 * noise(rng), {x, b.ext(k * n_out * 2)}, tokens * n_out * 2);
  };
  auto ew = [&](const char* name, const std::vector<int32_t>& in, int64_t bytes) {
    return b.op(name, static_cast<double>(bytes) / 2e3 * noise(rng), in, bytes);
  };
  std::vector<int32_t> saved;
  const int32_t x = b.ext(act);
  // Attention.
  const std::vector<int32_t> n1 = b.multi("rms_norm", 20e3 * noise(rng), {x, b.ext(d * 2)}, {act, tokens * 4});
  saved.insert(saved.end(), n1.begin(), n1.end());
  const int32_t q = mm("q_proj", n1[0], d, d), k = mm("k_proj", n1[0], d / 4, d), v = mm("v_proj", n1[0], d / 4, d);
  const int32_t qv = b.alias("view", 0.5, q), kv = b.alias("view", 0.5, k), vv = b.alias("view", 0.5, v);
  const int32_t qr = ew("rope", {qv}, act), kr = ew("rope", {kv}, act / 4);
  saved.insert(saved.end(), {qr, kr, vv});
  const std::vector<int32_t> at = b.multi("sdpa", 4.0 * tokens * tokens * d / 400e3 * noise(rng), {qr, kr, vv},
                                          {act, tokens * 32 * 4});
  saved.insert(saved.end(), at.begin(), at.end());
  const int32_t o = mm("o_proj", at[0], d, d);
  const int32_t h = ew("add", {x, o}, act);
  const std::vector<int32_t> n2 = b.multi("rms_norm", 20e3 * noise(rng), {h, b.ext(d * 2)}, {act, tokens * 4});
  saved.insert(saved.end(), n2.begin(), n2.end());
  // MoE MLP: router, then per expert a gathered slice of tokens.
  const int32_t logits = mm("router", n2[0], experts, d);
  const std::vector<int32_t> topk = b.multi("topk", 5e3 * noise(rng), {logits}, {tokens * 2 * 4, tokens * 2 * 8});
  saved.push_back(topk[0]);
  int32_t acc = ew("zeros", {h}, act);
  const int64_t per_expert = tokens * 2 / experts;
  for (int32_t e = 0; e < experts; ++e) {
    const int32_t idx = ew("index", {topk[1]}, per_expert * 8);
    const int32_t xe = b.op("gather", static_cast<double>(per_expert * d * 2) / 2e3, {n2[0], idx}, per_expert * d * 2);
    const double g_flops = 2.0 * static_cast<double>(per_expert) * static_cast<double>(d) * static_cast<double>(ffn);
    const int32_t gate = b.op("gate", g_flops / 400e3 * noise(rng), {xe, b.ext(d * ffn * 2)}, per_expert * ffn * 2);
    const int32_t up = b.op("up", g_flops / 400e3 * noise(rng), {xe, b.ext(d * ffn * 2)}, per_expert * ffn * 2);
    const int32_t s = ew("silu", {gate}, per_expert * ffn * 2);
    const int32_t m = ew("mul", {s, up}, per_expert * ffn * 2);
    const int32_t down = b.op("down", g_flops / 400e3 * noise(rng), {m, b.ext(d * ffn * 2)}, per_expert * d * 2);
    const int32_t w = ew("mul_weight", {down, topk[0]}, per_expert * d * 2);
    acc = b.alias("index_add_", static_cast<double>(per_expert * d * 2) / 2e3, acc, {w, idx});
    saved.insert(saved.end(), {xe, gate, s, up, m});
  }
  int32_t out = ew("add", {h, acc}, act);
  // Filler: chains of cheap elementwise ops (casts, dropout, scaling) hanging off recent values, some saved.
  std::uniform_int_distribution<int> coin(0, 9);
  std::vector<int32_t> recent{out, h, n2[0], at[0]};
  while (static_cast<int32_t>(b.problem.ops.size()) < target_ops) {
    const int32_t src = recent[std::uniform_int_distribution<size_t>(0, recent.size() - 1)(rng)];
    const int32_t y = ew("elementwise", {src, out}, act / (1 + coin(rng) % 4));
    if (coin(rng) < 1) saved.push_back(y);
    out = ew("add", {out, y}, act);
    recent.push_back(y);
  }
  std::sort(saved.begin(), saved.end());
  saved.erase(std::unique(saved.begin(), saved.end()), saved.end());
  for (int32_t v : saved) b.save(v);
  return b.problem;
}

struct BruteForce {
  bool feasible = false;
  double cost = std::numeric_limits<double>::infinity();
  int64_t bytes = 0;
  KeepMask keep;
};

/// Every keep mask that keeps forced_keep(); calls f(mask).
template <typename F>
void for_each_mask(const BlockProblem& p, F&& f) {
  const KeepMask forced = forced_keep(p);
  std::vector<size_t> free;
  for (size_t c = 0; c < forced.size(); ++c) {
    if (!forced[c]) free.push_back(c);
  }
  for (uint64_t bits = 0; bits < (uint64_t{1} << free.size()); ++bits) {
    KeepMask keep = forced;
    for (size_t k = 0; k < free.size(); ++k) keep[free[k]] = (bits >> k) & 1;
    f(keep);
  }
}

/// Optimal mask by enumeration, with the public evaluation functions only.
inline BruteForce brute_force(const BlockProblem& p, int64_t budget) {
  BruteForce best;
  for_each_mask(p, [&](const KeepMask& keep) {
    const int64_t bytes = kept_bytes(p, keep);
    if (bytes > budget) return;
    const double cost = replay_cost_ns(p, keep);
    if (!best.feasible || cost < best.cost - 1e-9 * std::max(1.0, cost) ||
        (cost <= best.cost + 1e-9 * std::max(1.0, cost) && bytes < best.bytes)) {
      best = BruteForce{true, cost, bytes, keep};
    }
  });
  return best;
}

}  // namespace tapesac::planner::testing
