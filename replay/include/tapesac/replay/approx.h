// Approximate rematerialization of linear layers (opt-in, TapeSAC(approx=tapesac.Approx(...))).
//
// Contract. At the end of a block call's forward, prepare() finds gated MLPs on the tape (x -> mm -> silu|gelu,
// x -> mm, their product -> mm: SwiGLU/GeGLU as in HF Llama and Qwen3), measures one importance per hidden unit
// from the tensors the forward saved (before they are dropped), and selects the units that replay will recompute:
// a fraction f of them. When replay later rebuilds a value such an MLP saved, the gate and up matmuls compute only
// the selected columns (the other columns are zero), and the rebuilt *linear* factors (the activation's output, the
// up projection, their product) are multiplied by a per-unit weight w_j: 1/p_j for a selected unit in the sketch
// (p_j its inclusion probability), 1 in greedy, 0 for an unselected unit. The activation's input is not reweighted.
// Every parameter gradient and the input gradient of the MLP is then a sum over units of w_j times unit j's exact
// contribution, so that the sketch is unbiased (E[w_j] = 1) and greedy is not. README, "Approximate
// rematerialization", has the derivation. The forward (and so the loss) is never changed.
//
// What is not matched is replayed exactly: a match is used only when every value of the MLP that autograd saved
// was dropped (none kept by the policy), the MLP's values have no reader outside the pattern, nothing saved and
// dropped depends on the down projection's output, and no storage of the MLP is written in place.
//
// Randomness: a private std::mt19937_64 per block call, seeded from (seed, step, call index); torch's generators are
// never touched. Not thread-safe: one Approx per Session, used on the forward thread (prepare) and under the
// BlockCall's lock (run/finish).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tapesac/capture/tape.h"
#include "tapesac/replay/eager_replayer.h"

namespace tapesac::replay {

enum class ApproxMethod { kSketch, kGreedy };

struct ApproxOptions {
  /// Share of each component's units recomputed, in (0, 1]. At 1 replay is exact (the approximate path is not run).
  double fraction = 2.0 / 3.0;
  ApproxMethod method = ApproxMethod::kSketch;
  /// Component kinds approximated: gated MLPs (per hidden unit). Attention heads are not implemented.
  bool mlp = true;
  /// Seed of the unit sampling (mixed with the step and the block call index).
  uint64_t seed = 0;
  /// Test-only: false keeps the sketch's sampling but drops its 1/p reweighting (then biased).
  bool reweight = true;
  /// Sketch: inclusion probabilities are proportional to importance + defensive * mean importance (capped at 1), so
  /// that no unit has probability 0 (a unit whose forward output is zero can still carry gradient).
  double defensive = 0.1;
};

/// What approximation did in one block call (summed into BlockStats).
struct ApproxStats {
  /// Gated MLPs found on the tape and approximated / found but replayed exactly (a value kept, a reader outside
  /// the pattern, an in-place write, ...).
  int64_t mlp_applied = 0;
  int64_t mlp_skipped = 0;
  /// Hidden units of the approximated MLPs, and how many replay recomputes.
  int64_t units_total = 0;
  int64_t units_recomputed = 0;
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
  /// Multiplies every rebuilt value that is a reweighted factor by its units' weights (out of place).
  void finish(std::unordered_map<capture::ValueId, at::Tensor>& rebuilt) const;
  bool empty() const { return applied_.empty(); }

 private:
  friend class Approx;
  struct Applied {
    at::Tensor units;    // int64 [k], on the device of the block's tensors
    at::Tensor weights;  // [I], the dtype of the down projection's input; 0 for unselected units
    int64_t total = 0;
  };
  std::vector<Applied> applied_;
  std::unordered_map<capture::OpIndex, size_t> op_match_;     // gate/up matmul -> applied_ index
  std::unordered_map<capture::ValueId, size_t> scaled_match_;  // reweighted value -> applied_ index
};

/// The approximation state of one Session: options, the step counter (for seeding) and the per-call preparation.
class Approx {
 public:
  explicit Approx(ApproxOptions options);
  const ApproxOptions& options() const { return options_; }
  /// Called at each step start: later block calls draw new, independent selections.
  void begin_step();
  /// At the end of a block call's forward, after keep/drop is decided and before dropped tensors are released.
  /// `decision[v]`: -1 not saved, 0 saved and dropped, 1 kept; `saved[v]`: the tensor autograd saved for v (or
  /// null). Returns null when nothing on the tape is approximated. Adds to `stats`.
  std::unique_ptr<BlockApprox> prepare(const capture::Tape& tape, const std::vector<int8_t>& decision,
                                       const std::vector<const at::Tensor*>& saved, ApproxStats& stats);

 private:
  ApproxOptions options_;
  uint64_t step_ = 0;
  uint64_t call_ = 0;
};

}  // namespace tapesac::replay
