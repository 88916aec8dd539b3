// Tests of the statistics field list (replay/block_stats.h, Note [Statistics defined once]) and the step summary
// (replay/step_summary.h).
#include <algorithm>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/replay/block_stats.h"
#include "tapesac/replay/step_summary.h"

namespace tapesac::replay {
namespace {

std::vector<std::string> field_names() {
  std::vector<std::string> names;
  for_each_block_field(BlockStats{}, [&](const FieldInfo& f, const auto&) { names.push_back(f.name); });
  return names;
}

TEST(BlockStatsFields, NamesAreUniqueDocumentedAndApproxIsPrefixed) {
  const std::vector<std::string> names = field_names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());
  EXPECT_EQ(names.front(), "name");
  EXPECT_NE(std::find(names.begin(), names.end(), "approx_mlp"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "approx_kept_values"), names.end());
  for_each_block_field(BlockStats{}, [](const FieldInfo& f, const auto& value) {
    EXPECT_GT(std::string(f.doc).size(), 10u) << f.name << " has no doc";
    using T = std::decay_t<decltype(value)>;
    EXPECT_STREQ(f.type, stats_type_name<T>()) << f.name;
    if (f.combine == Combine::kSum) {  // only integer counters can be summed
      EXPECT_TRUE((std::is_same_v<T, int64_t>)) << f.name;
    }
  });
}

TEST(StepSummary, SumsTheSummedFieldsAndCountsFallbacksTimingsAndRecords) {
  BlockStats a, b;
  a.name = "layers.0";
  b.name = "layers.1";
  a.saved_tensors = 5;
  b.saved_tensors = 7;
  a.replay_ns = 1000;
  b.replay_ns = 500;
  a.replay_peak_bytes = 100;  // not summed
  b.replay_peak_bytes = 300;
  a.approx.mlp = 1;
  b.approx.mlp = 1;
  a.approx.mlp_skipped = 1;  // summed: the README promises the step's total (an adversarial test found it missing)
  b.approx.mlp_skipped = 2;
  a.graph_fallbacks = 2;
  a.graph_fallback = "rng";
  b.graph_fallbacks = 1;
  b.graph_fallback = "rng";
  a.op_timing = "cpu_clock";
  b.op_timing = "cupti";
  std::vector<ReplayRecord> records(3);
  records[0].status = "match";
  records[1].status = "match";
  records[2].status = "recovered";
  const StepSummary s = summarize_step({a, b}, records);
  EXPECT_EQ(s.block_calls, 2);
  EXPECT_EQ(s.totals.saved_tensors, 12);
  EXPECT_EQ(s.totals.replay_ns, 1500);
  EXPECT_EQ(s.totals.graph_fallbacks, 3);
  EXPECT_EQ(s.totals.approx.mlp, 2);
  EXPECT_EQ(s.totals.replay_peak_bytes, 0);
  EXPECT_EQ(s.totals.approx.mlp_skipped, 3);
  EXPECT_EQ(s.totals.name, "");
  EXPECT_EQ(s.graph_fallback_reasons.at("rng"), 2);
  EXPECT_EQ(s.op_timing, "cpu_clock,cupti");
  EXPECT_EQ(s.record_counts.at("match"), 2);
  EXPECT_EQ(s.record_counts.at("recovered"), 1);
}

TEST(StepSummary, AStepWithoutBlocksIsEmpty) {
  const StepSummary s = summarize_step({}, {});
  EXPECT_EQ(s.block_calls, 0);
  EXPECT_EQ(s.op_timing, "");
  EXPECT_TRUE(s.graph_fallback_reasons.empty());
}

}  // namespace
}  // namespace tapesac::replay
