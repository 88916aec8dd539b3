// A step's totals over its block calls, computed once in C++ (Note [Statistics defined once] in stats_fields.h): the
// kSum fields summed, the kMax fields' largest, the graph fallbacks by reason, the op-time sources, the execution records by status.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tapesac/replay/block_stats.h"
#include "tapesac/replay/step_memory.h"

namespace tapesac::replay {

struct StepSummary {
  /// The kSum fields of the block calls, summed, and the kMax fields, their largest; every other field is left
  /// empty. over_limit_bytes is the step's (Session: its measured peak over the limit).
  BlockStats totals;
  int64_t block_calls = 0;
  /// Eager graph fallbacks by reason: one per block call whose last fallback had that reason.
  std::map<std::string, int64_t> graph_fallback_reasons;
  /// The block calls' op-time sources (BlockStats::op_timing), sorted and comma-separated; "" without blocks.
  std::string op_timing;
  /// The step's execution records by status ("match", "recovered", ...).
  std::map<std::string, int64_t> record_counts;
};

StepSummary summarize_step(const std::vector<BlockStats>& blocks, const std::vector<ReplayRecord>& records);

}  // namespace tapesac::replay
