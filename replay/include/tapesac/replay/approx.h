// Approximate rematerialization of linear layers (opt-in, TapeSAC(approx=tapesac.Approx(...))).
//
// Contract. At the end of a block call's forward, prepare() finds *components* on the tape, measures one importance
// per unit from the tensors the forward saved (before they are dropped), and selects the units that replay will
// recompute: a fraction f of them. Units get a weight w_j: 1/p_j for a selected unit in the sketch (p_j its
// inclusion probability), 1 in greedy, 0 for an unselected unit.
// - Gated MLPs (x -> mm -> silu|gelu, x -> mm, their product -> mm: SwiGLU/GeGLU as in HF Llama and Qwen3); a unit
//   is a hidden unit. Replay computes the gate and up matmuls over the selected columns only (the others are 0) and
//   multiplies the rebuilt *linear* factors (the activation's output, the up projection, their product) by w; the
//   activation's input is not reweighted.
// - Attention (q/k/v projections -> head-local ops (views, RoPE, per-head norms) -> the CPU flash SDPA kernel ->
//   views -> o projection; grouped-query attention included); a unit is a query head. Replay computes the q
//   projection over the selected heads' columns, k/v over their kv groups' columns (the others are 1, a harmless
//   finite value), and SDPA over the selected heads only; the saved logsumexp of head h becomes lse_h - log(w_h)
//   (+inf for an unselected head), which multiplies the attention probabilities the backward rebuilds from it by
//   w_h, and the o projection's saved input is multiplied by w_h.
// Every parameter gradient and the component's input gradient is then a sum over units of w_j times unit j's exact
// contribution: the sketch is unbiased (E[w_j] = 1) and greedy is not. README, "Approximate rematerialization", has
// the derivation. The forward (and so the loss) is never changed.
//
// What is not matched is replayed exactly: a match is used only when autograd saved the input of its output
// projection (down / o) and every value of the component that autograd saved was dropped (none kept by the
// policy), its values have no reader outside the pattern and no storage of it is written in place. A dropped value
// whose replay would read the component's output (e.g. the residual stream after attention, read by the next norm)
// is kept instead (prepare() appends it to `keep`), so that replay never reads an approximation.
//
// Randomness: a private std::mt19937_64 per approximated component, seeded from (seed, step, block call index,
// component index); torch's generators are never touched. Not thread-safe: one Approx per Session, used on the
// forward thread (prepare) and under the BlockCall's lock (run/finish).
//
// Sources: approx_match.cpp (tape matching), approx_prepare.cpp (unit sampling, prepare()), approx_replay.cpp
// (BlockApprox::run/finish, the replay override).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tapesac/capture/op_payload.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/approx_stats.h"
#include "tapesac/replay/eager_replayer.h"

namespace tapesac::replay {

enum class ApproxMethod { kSketch, kGreedy };

struct ApproxOptions {
  /// Share of each component's units recomputed, in (0, 1]. At 1 replay is exact (the approximate path is not run).
  double fraction = 2.0 / 3.0;
  ApproxMethod method = ApproxMethod::kSketch;
  /// Component kinds approximated: gated MLPs (per hidden unit), attention (per query head).
  bool mlp = true;
  bool attn = false;
  /// Seed of the unit sampling (mixed with the step and the block call index).
  uint64_t seed = 0;
  /// Test-only: false keeps the sketch's sampling but drops its 1/p reweighting (then biased).
  bool reweight = true;
  /// Sketch: inclusion probabilities are proportional to importance + defensive * mean importance (capped at 1), so
  /// that no unit has probability 0 (a unit whose forward output is zero can still carry gradient).
  double defensive = 0.1;
};

/// One gated MLP found on a tape (torch-free; see match_gated_mlps).
struct MlpMatch {
  capture::OpIndex gate_mm = -1;  // x @ W_gate^T (mm or addmm), then the activation
  capture::OpIndex up_mm = -1;    // x @ W_up^T
  capture::OpIndex act = -1;      // silu / gelu of the gate
  capture::OpIndex mul = -1;      // act * up
  capture::OpIndex down_mm = -1;  // (act * up) @ W_down^T
  int64_t units = 0;              // the hidden size I (last dim of every value below)
  /// Values read by the pattern's ops that autograd may save: the activation's input (not reweighted), the two
  /// factors of the product and the down projection's input (reweighted).
  capture::ValueId act_in = -1, mul_act = -1, mul_up = -1, down_in = -1, down_w = -1;
  /// Every value of the pattern whose last dim indexes units: reweighted ones and the others (the gate branch).
  std::vector<capture::ValueId> scaled;
  std::vector<capture::ValueId> unscaled;
  /// Why this candidate was rejected (empty when it is usable as far as the tape alone can tell).
  std::string rejected;
};

/// Gated MLPs on `tape` (every candidate whose ops match, with `rejected` set when it is unsafe to approximate).
/// Pure function of the tape.
std::vector<MlpMatch> match_gated_mlps(const capture::Tape& tape);

/// Where the heads of an attention value are: `merged` (heads * head_dim along the last dim) or on dim `axis`.
struct HeadLayout {
  bool merged = true;
  int axis = -1;
};

/// One attention found on a tape (see match_attention).
struct AttnMatch {
  capture::OpIndex sdpa = -1;
  capture::OpIndex proj[3] = {-1, -1, -1};  // q, k, v projections (mm or addmm)
  capture::OpIndex o_mm = -1;               // the o projection
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  capture::ValueId out = -1, lse = -1, o_in = -1, o_w = -1;
  /// The kernel's other outputs (CUDA kernels: sequence offsets, philox state, debug mask), read by autograd only.
  std::vector<capture::ValueId> extra;
  /// Boxed position of the kernel's attention mask / bias argument (-1: the kernel takes none).
  int mask_arg = -1;
  /// Values between `out` and the o projection (reweighted per head), with their layouts.
  std::vector<std::pair<capture::ValueId, HeadLayout>> scaled;
  /// Every value of the component (q/k/v branches, SDPA outputs, the o branch).
  std::vector<capture::ValueId> values;
  std::string rejected;
};

/// Attention components on `tape`: an SDPA kernel whose backward reads its logsumexp (the CPU flash kernel
/// aten::_scaled_dot_product_flash_attention_for_cpu, and on CUDA aten::_scaled_dot_product_flash_attention,
/// _scaled_dot_product_efficient_attention and _scaled_dot_product_cudnn_attention; no dropout) whose q, k and v
/// each come from one projection through head-local ops only. Pure function.
std::vector<AttnMatch> match_attention(const capture::Tape& tape, const std::vector<capture::OpPayload>& payloads);

/// Selection of `k` of `importance.size()` units. Greedy: the k largest (weights 1). Sketch: systematic sampling in
/// a random order with inclusion probabilities p_j = min(1, c (importance_j + defensive * mean)), sum p_j = k,
/// weights 1/p_j (1 when !reweight). Returns (unit, weight) pairs sorted by unit. Exposed for tests.
struct UnitSample {
  std::vector<int64_t> units;
  std::vector<double> weights;
  std::vector<double> probabilities;  // inclusion probability of every unit (sketch; 1 for greedy's selected)
};
UnitSample select_units(const std::vector<double>& importance, int64_t k, ApproxMethod method, bool reweight,
                        double defensive, uint64_t seed);

/// The approximation of one block call: applied matches, their selected units and weights. Implements the
/// replayer's OpOverride (the gate/up matmuls over the selected columns) and rescales rebuilt values (finish).
class BlockApprox : public OpOverride {
 public:
  bool run(capture::OpIndex op, std::vector<c10::IValue>& stack) const override;
  /// Multiplies every rebuilt value that is a reweighted factor by its units' weights (out of place); shifts a
  /// rebuilt logsumexp by -log(w).
  void finish(std::unordered_map<capture::ValueId, at::Tensor>& rebuilt) const;
  bool empty() const { return applied_.empty(); }
  /// True when replay rebuilds `value` differently from the forward (a value of an approximated component).
  bool approximates(capture::ValueId value) const { return approximated_.count(value) != 0; }

 private:
  friend class Approx;
  struct Applied {
    at::Tensor units;    // int64 [k] selected units (hidden units or query heads), on the block's device
    at::Tensor weights;  // [n]; 0 for unselected units
    int64_t total = 0;
    // Attention only: columns of the q and the k/v projections to compute, the kv head of each selected head,
    // the SDPA operator and the layout of its outputs.
    at::Tensor q_cols, kv_cols, kv_of_head;
    int64_t heads = 0;
    std::optional<c10::OperatorHandle> sdpa;
    std::vector<int64_t> out_sizes, out_strides, lse_sizes, lse_strides;
    int mask_arg = -1;  // boxed position of the kernel's mask / bias (-1: none)
  };
  enum class Role { kColumns, kQ, kKv, kSdpa };
  struct OpUse {
    size_t applied = 0;
    Role role = Role::kColumns;
    bool addmm = false;
  };
  struct Scale {
    size_t applied = 0;
    HeadLayout layout;  // merged with head_dim 1 for MLP units
    int64_t group = 1;  // merged layout: columns per unit
    bool log_shift = false;  // the logsumexp: lse - log(w) along `layout.axis`
  };
  std::vector<Applied> applied_;
  std::unordered_map<capture::OpIndex, OpUse> op_match_;
  std::unordered_map<capture::ValueId, Scale> scaled_match_;
  std::unordered_set<capture::ValueId> approximated_;
};

/// What prepare() reads about a block call at the end of its forward.
struct ApproxInput {
  const capture::Tape& tape;
  const std::vector<capture::OpPayload>& payloads;
  /// -1 not saved, 0 saved and dropped, 1 kept (by value id).
  const std::vector<int8_t>& decision;
  /// The tensor autograd saved for each value (null when none), still alive, and the state of its storage then.
  const std::vector<const at::Tensor*>& saved;
  const std::vector<int32_t>& state;
};

/// The approximation state of one Session: options, the step counter (for seeding) and the per-call preparation
/// (approx_prepare.cpp).
class Approx {
 public:
  explicit Approx(ApproxOptions options);
  const ApproxOptions& options() const { return options_; }
  /// Called at each step start: later block calls draw new, independent selections.
  void begin_step();
  /// At the end of a block call's forward, after keep/drop is decided and before dropped tensors are released.
  /// Returns null when nothing on the tape is approximated. Appends to `keep` the dropped values the caller must
  /// keep instead (their replay would read an approximated component's output). Adds to `stats`.
  std::unique_ptr<BlockApprox> prepare(const ApproxInput& in, std::vector<capture::ValueId>& keep,
                                       ApproxStats& stats);

 private:
  struct Call;  // one prepare() call
  /// prepare()'s step per matched component: rejected (counted as skipped), recomputed whole, or added to the
  /// call's BlockApprox with its sampled units.
  void add_mlp(Call& c, MlpMatch& m) const;
  void add_attention(Call& c, AttnMatch& m) const;
  /// Seed of the unit sampling of the `component`-th component (1-based) of block call `call` in this step.
  uint64_t seed_for(uint64_t call, uint64_t component) const;
  /// Units recomputed out of `n`: round(fraction * n), clamped to [1, n].
  int64_t units_to_recompute(int64_t n) const;

  ApproxOptions options_;
  uint64_t step_ = 0;
  uint64_t call_ = 0;
};

}  // namespace tapesac::replay
