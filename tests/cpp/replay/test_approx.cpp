// Tests of approximate rematerialization's torch-free parts (replay/approx.h): unit selection (greedy; the sketch's
// inclusion probabilities, sample size and weights) and gated-MLP matching on hand-made tapes.
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/approx.h"

namespace tapesac::replay {
namespace {

using capture::ArgRef;
using capture::OpRecord;
using capture::StorageId;
using capture::TensorMeta;

TEST(SelectUnits, GreedyTakesTheLargest) {
  const UnitSample s = select_units({0.5, 3.0, 1.0, 2.0, 0.1}, 3, ApproxMethod::kGreedy, true, 0.1, 7);
  EXPECT_EQ(s.units, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(s.weights, (std::vector<double>{1.0, 1.0, 1.0}));
}

TEST(SelectUnits, SketchProbabilitiesSumToKAndAreCapped) {
  const std::vector<double> imp{100.0, 1.0, 1.0, 2.0, 0.0, 3.0, 0.5, 1.5};
  const UnitSample s = select_units(imp, 4, ApproxMethod::kSketch, true, 0.1, 1);
  double sum = 0;
  for (double p : s.probabilities) {
    EXPECT_GT(p, 0.0);  // the defensive share: even importance 0 has a chance
    EXPECT_LE(p, 1.0);
    sum += p;
  }
  EXPECT_NEAR(sum, 4.0, 1e-9);
  EXPECT_DOUBLE_EQ(s.probabilities[0], 1.0);  // far above the others: capped, always taken
}

TEST(SelectUnits, SketchTakesEachUnitWithItsProbability) {
  const std::vector<double> imp{5.0, 1.0, 0.2, 3.0, 0.0, 2.0, 0.7, 1.1, 4.0, 0.4};
  const int64_t k = 4;
  const int draws = 20000;
  std::vector<int> taken(imp.size(), 0);
  std::vector<double> p;
  for (int d = 0; d < draws; ++d) {
    const UnitSample s = select_units(imp, k, ApproxMethod::kSketch, true, 0.1, 1000 + static_cast<uint64_t>(d));
    ASSERT_EQ(static_cast<int64_t>(s.units.size()), k) << "systematic sampling takes exactly k units";
    for (size_t r = 0; r < s.units.size(); ++r) {
      ++taken[static_cast<size_t>(s.units[r])];
      EXPECT_DOUBLE_EQ(s.weights[r], 1.0 / s.probabilities[static_cast<size_t>(s.units[r])]);
    }
    p = s.probabilities;
  }
  for (size_t j = 0; j < imp.size(); ++j) {
    const double freq = static_cast<double>(taken[j]) / draws;
    const double sd = std::sqrt(std::max(p[j] * (1 - p[j]), 1e-12) / draws);
    EXPECT_NEAR(freq, p[j], 5 * sd + 1e-9) << "unit " << j;
  }
}

TEST(SelectUnits, NoReweightingAndNonFiniteImportance) {
  const UnitSample s = select_units({1.0, NAN, 2.0, 3.0}, 2, ApproxMethod::kSketch, false, 0.1, 3);
  for (double p : s.probabilities) EXPECT_DOUBLE_EQ(p, 0.5);  // non-finite importance: uniform
  EXPECT_EQ(s.weights, (std::vector<double>{1.0, 1.0}));
}

// A tape of x[T, D] -> gate/up projections [T, I] -> silu, mul -> down projection, as HF's Llama MLP records it
// (t of each weight, mm, then reshapes).
class MlpTape {
 public:
  static constexpr int64_t kT = 8, kD = 4, kI = 6;
  capture::Tape tape;

  ValueId ext(std::vector<int64_t> sizes) {
    const StorageId s = tape.add_storage(true, 4 * numel(sizes));
    return tape.add_external_value(s, meta(sizes));
  }
  ValueId op(const std::string& name, std::vector<ValueId> reads, std::vector<int64_t> sizes, bool view = false) {
    OpRecord rec;
    rec.kind = capture::intern_op_kind(name);
    for (size_t i = 0; i < reads.size(); ++i) {
      const auto& info = tape.value(reads[i]);
      rec.inputs.push_back(ArgRef{static_cast<int16_t>(i), -1, reads[i], tape.state_of(info.storage), view});
    }
    if (view) {
      rec.flags |= capture::kView;
      const StorageId s = tape.value(reads[0]).storage;
      rec.outputs.push_back(tape.add_output_value(s, tape.state_of(s), meta(sizes)));
    } else {
      const StorageId s = tape.add_storage(false, 4 * numel(sizes));
      rec.writes.push_back(s);
      rec.outputs.push_back(tape.add_output_value(s, 1, meta(sizes)));
    }
    tape.add_op(std::move(rec));
    return tape.op(tape.next_op_index() - 1).outputs[0];
  }
  /// x -> (t(W) view, mm) -> [T, I]
  ValueId proj(ValueId x, int64_t out) {
    const ValueId w = ext({out, kD});
    const ValueId wt = op("aten::t", {w}, {kD, out}, true);
    return op("aten::mm", {x, wt}, {kT, out});
  }

  static int64_t numel(const std::vector<int64_t>& s) {
    return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
  }
  static TensorMeta meta(std::vector<int64_t> sizes) {
    TensorMeta m;
    m.sizes.assign(sizes.begin(), sizes.end());
    std::vector<int64_t> strides(sizes.size(), 1);
    for (size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * sizes[i];
    m.strides.assign(strides.begin(), strides.end());
    m.dtype = 6;
    m.nbytes = 4 * numel(sizes);
    return m;
  }
};

TEST(MatchGatedMlp, FindsSwiGlu) {
  MlpTape b;
  const ValueId x = b.ext({MlpTape::kT, MlpTape::kD});
  const ValueId g = b.op("aten::_unsafe_view", {b.proj(x, MlpTape::kI)}, {2, 4, MlpTape::kI}, true);
  const ValueId a = b.op("aten::silu", {g}, {2, 4, MlpTape::kI});
  const ValueId u = b.op("aten::_unsafe_view", {b.proj(x, MlpTape::kI)}, {2, 4, MlpTape::kI}, true);
  const ValueId h = b.op("aten::mul.Tensor", {a, u}, {2, 4, MlpTape::kI});
  const ValueId h2 = b.op("aten::view", {h}, {MlpTape::kT, MlpTape::kI}, true);
  const ValueId wd = b.ext({MlpTape::kD, MlpTape::kI});
  b.op("aten::mm", {h2, b.op("aten::t", {wd}, {MlpTape::kI, MlpTape::kD}, true)}, {MlpTape::kT, MlpTape::kD});

  const std::vector<MlpMatch> m = match_gated_mlps(b.tape);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_TRUE(m[0].rejected.empty()) << m[0].rejected;
  EXPECT_EQ(m[0].units, MlpTape::kI);
  EXPECT_EQ(m[0].act_in, g);
  EXPECT_EQ(m[0].mul_act, a);
  EXPECT_EQ(m[0].mul_up, u);
  EXPECT_EQ(m[0].down_in, h2);
  // The gate branch is not reweighted; the activation's output, the up branch and the product are.
  EXPECT_EQ(m[0].unscaled.size(), 2u);
  EXPECT_EQ(m[0].scaled.size(), 5u);
}

TEST(MatchGatedMlp, RejectsAReaderOutsideThePattern) {
  MlpTape b;
  const ValueId x = b.ext({MlpTape::kT, MlpTape::kD});
  const ValueId g = b.proj(x, MlpTape::kI);
  const ValueId a = b.op("aten::silu", {g}, {MlpTape::kT, MlpTape::kI});
  const ValueId u = b.proj(x, MlpTape::kI);
  const ValueId h = b.op("aten::mul.Tensor", {a, u}, {MlpTape::kT, MlpTape::kI});
  const ValueId wd = b.ext({MlpTape::kD, MlpTape::kI});
  b.op("aten::mm", {h, b.op("aten::t", {wd}, {MlpTape::kI, MlpTape::kD}, true)}, {MlpTape::kT, MlpTape::kD});
  b.op("aten::sum", {u}, {});  // u is read by something else: changing it would change that too

  const std::vector<MlpMatch> m = match_gated_mlps(b.tape);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_FALSE(m[0].rejected.empty());
}

TEST(MatchGatedMlp, IgnoresANonGatedMlp) {
  MlpTape b;
  const ValueId x = b.ext({MlpTape::kT, MlpTape::kD});
  const ValueId a = b.op("aten::gelu", {b.proj(x, MlpTape::kI)}, {MlpTape::kT, MlpTape::kI});
  const ValueId wd = b.ext({MlpTape::kD, MlpTape::kI});
  b.op("aten::mm", {a, b.op("aten::t", {wd}, {MlpTape::kI, MlpTape::kD}, true)}, {MlpTape::kT, MlpTape::kD});
  EXPECT_TRUE(match_gated_mlps(b.tape).empty());
}

}  // namespace
}  // namespace tapesac::replay
