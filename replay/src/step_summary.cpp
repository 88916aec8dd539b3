// A step's totals (see step_summary.h).
#include "tapesac/replay/step_summary.h"

#include <algorithm>
#include <set>
#include <utility>
#include <type_traits>

namespace tapesac::replay {

StepSummary summarize_step(const std::vector<BlockStats>& blocks, const std::vector<ReplayRecord>& records) {
  StepSummary s;
  s.block_calls = static_cast<int64_t>(blocks.size());
  // The integer fields of the totals in visiting order with how they combine; every visit sees the same order.
  std::vector<std::pair<int64_t*, Combine>> sums;
  for_each_block_field(s.totals, [&](const FieldInfo& f, auto& field) {
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, int64_t>) sums.emplace_back(&field, f.combine);
  });
  std::set<std::string> timings;
  for (const BlockStats& b : blocks) {
    size_t i = 0;
    for_each_block_field(b, [&](const FieldInfo& /*f*/, const auto& field) {
      if constexpr (std::is_same_v<std::decay_t<decltype(field)>, int64_t>) {
        auto [total, combine] = sums[i];
        if (combine == Combine::kSum) *total += field;
        if (combine == Combine::kMax) *total = std::max(*total, field);
        ++i;
      }
    });
    if (b.graph_fallbacks > 0) ++s.graph_fallback_reasons[b.graph_fallback];
    timings.insert(b.op_timing);
  }
  for (const std::string& t : timings) s.op_timing += (s.op_timing.empty() ? "" : ",") + t;
  for (const ReplayRecord& r : records) ++s.record_counts[r.status];
  return s;
}

}  // namespace tapesac::replay
