// What one block call of a step did: BlockStats, generated from one field list (Note [Statistics defined once] in
// stats_fields.h). Filled by BlockCall (block_call.h); a step's totals are in step_summary.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tapesac/replay/approx_stats.h"
#include "tapesac/replay/stats_fields.h"

// X(type, name, combine, doc). Bytes count unique storages; parameters and buffers are not counted as kept.
#define TAPESAC_BLOCK_STATS_FIELDS(X)                                                                                \
  X(std::string, name, kNone, "the block's qualified name")                                                          \
  X(int64_t, ops_recorded, kSum, "ops recorded in the block's forward")                                              \
  X(int64_t, saved_tensors, kSum, "tensors autograd saved for backward in the block")                                \
  X(int64_t, kept_tensors, kSum, "saved tensors kept (held until backward)")                                         \
  X(int64_t, dropped_tensors, kSum, "saved tensors dropped (rebuilt by replay when backward needs them)")            \
  X(int64_t, opaque_tensors, kSum, "saved tensors the tape did not produce (kept: tapesac cannot rebuild them)")     \
  X(int64_t, kept_bytes, kSum, "bytes of the kept tensors' storages")                                                \
  X(int64_t, dropped_bytes, kSum, "bytes of the dropped tensors' storages")                                          \
  X(int64_t, opaque_bytes, kSum, "bytes of the opaque tensors' storages")                                            \
  X(int64_t, unpacks, kSum, "saved tensors served to the backward (kept ones and rebuilt ones)")                  \
  X(int64_t, replays, kSum, "replays run (each rebuilds the dropped values still needed)")                           \
  X(int64_t, ops_replayed, kSum, "ops those replays ran")                                                            \
  X(int64_t, replay_ns, kSum, "time spent replaying")                                                                \
  X(int64_t, replayed_bytes, kSum, "bytes allocated by the replays")                                                 \
  X(int64_t, replay_pieces, kSum, "replays split because the whole did not fit under memory_limit")                  \
  X(int64_t, replay_peak_bytes, kNone, "the largest measured working set of one replay")                             \
  X(int64_t, predicted_replay_bytes, kNone, "the largest working set of one replay predicted from the tape")         \
  X(int64_t, segments, kNone,                                                                                        \
    "segments of the replay schedule the call followed (1: the first unpack rebuilds every dropped value)")         \
  X(int64_t, held_bytes, kMax, "the most bytes held across segments (values a replay rebuilt for a later one)")      \
  X(int64_t, backward_ws_bytes, kNone,                                                                               \
    "measured: the most bytes the call's replays held at once (values waiting for their unpacks, held values and "  \
    "the running replay's working set)")                                                                             \
  X(int64_t, planned_ws_bytes, kNone, "the planner's prediction of backward_ws_bytes for the schedule (0: no plan)") \
  X(int64_t, over_limit_bytes, kMax,                                                                                 \
    "by how much memory in use exceeded memory_limit while one of the call's replays ran (the step's figure: by "  \
    "how much its measured peak exceeded the limit; 0: within)")                                                    \
  X(int64_t, decision_reused, kSum,                                                                                  \
    "1 when the call reused the keep/drop decision of the block's previous call (identical tape and inputs)")       \
  X(bool, planned, kNone,                                                                                            \
    "the plan was applied (policy 'auto': its keep mask, else the call ran as 'full'; other policies: its replay "  \
    "schedule, else the default one)")                                                                               \
  X(std::string, capture_error, kNone, "why recording failed or the policy raised (everything was then kept)")       \
  X(std::string, op_timing, kNone,                                                                                   \
    "where the tape's op times (the planner's costs) came from: 'cupti' or 'cuda_events' (device timing, on CUDA "   \
    "with policy='auto'), 'cpu_clock' otherwise")                                                                    \
  X(std::string, op_timing_note, kNone, "why the preferred op-time source was not used")                             \
  X(int64_t, graph_replays, kSum, "graph backend: replays launched as a pruned graph")                               \
  X(int64_t, graph_captures, kSum, "graph backend: graphs this call's replays captured")                             \
  X(int64_t, graph_warmups, kNone, "graph backend: eager warm-up replays (before a key is captured)")                \
  X(int64_t, graph_fallbacks, kSum, "graph backend: replays that ran eagerly instead of as a graph")                 \
  X(std::string, graph_fallback, kNone, "graph backend: the reason of the last eager fallback ('' when none)")       \
  X(std::string, graph_detail, kNone, "graph backend: details of the last eager fallback")                           \
  X(int64_t, graph_staged_bytes, kNone, "graph backend: bytes copied into the graphs' static buffers")               \
  X(int64_t, graph_nodes_enabled, kNone, "graph backend: nodes enabled in the last launch")                          \
  X(int64_t, graph_nodes_disabled, kNone, "graph backend: nodes disabled (pruned) in the last launch")               \
  X(int64_t, graph_timed_launches, kSum, "graph launches timed per op (TapeSAC(graph_timing=...))")                  \
  X(std::string, graph_timing, kNone,                                                                                \
    "source of the launch times: 'cupti' (device time of the graph's kernels) or 'cpu_clock' (the emulation)")       \
  X(std::string, graph_timing_note, kNone, "why a launch that was to be timed was not")                              \
  X(OpTimes, graph_op_ns, kNone, "(tape op index, op name, time) of each op whose nodes ran in the timed launches")  \
  X(int64_t, graph_device_ns, kSum, "the summed time of the ops of the timed launches")                              \
  X(int64_t, graph_unattributed_ns, kNone, "time of launch work no op owns (the RNG prologue, copies)")

namespace tapesac::replay {

struct BlockStats {
#define TAPESAC_X(type, name, combine, doc) type name{};
  TAPESAC_BLOCK_STATS_FIELDS(TAPESAC_X)
#undef TAPESAC_X
  /// Approximate rematerialization (Session::set_approx): what was matched, and the units replay recomputes.
  ApproxStats approx;
};

/// Which of a block call's dropped values were alive anyway (Note [dropped values alive elsewhere], block_call.h):
/// dropping them freed nothing while they were. Tape value ids of the call's tape; for the planner's peak models.
struct DroppedLiveness {
  std::string name;  ///< the block call's name (as in BlockStats)
  /// Dropped values whose storage was still alive when the step's backward began (its first unpack): alive through
  /// every forward window after the drop and the tail.
  std::vector<int32_t> alive_after_forward;
  /// Dropped values whose storage was still alive when the backward first unpacked them.
  std::vector<int32_t> alive_at_unpack;
  /// Bytes of the inputs the call held for its replay that nothing else held when the backward began (a plan that
  /// replays nothing does not hold them).
  int64_t held_for_replay_bytes = 0;
  /// Values the first backward rebuilt that were still alive when a second backward over the graph began (the
  /// graph of a create_graph=True backward holds them).
  std::vector<int32_t> rebuilt_alive_at_second;
  /// When (step memory clock, ns) the call's first replay of a second backward over the graph began (-1: none).
  int64_t second_backward_ns = -1;
  /// Every saved tensor of the call outlived the step's later unpacks: the backward retained the graph (Note [A
  /// graph held through its backward], block_call.cpp).
  bool held_through_backward = false;
};

/// Calls f(const FieldInfo&, field&) for every field of `s` (a BlockStats, const or not) in list order, the approx
/// fields last with their names prefixed "approx_".
template <class S, class F>
void for_each_block_field(S&& s, F&& f) {
#define TAPESAC_X(type, name, combine, doc) f(FieldInfo{#name, stats_type_name<type>(), Combine::combine, doc}, s.name);
  TAPESAC_BLOCK_STATS_FIELDS(TAPESAC_X)
#undef TAPESAC_X
#define TAPESAC_X(type, name, combine, doc) \
  f(FieldInfo{"approx_" #name, stats_type_name<type>(), Combine::combine, doc}, s.approx.name);
  TAPESAC_APPROX_STATS_FIELDS(TAPESAC_X)
#undef TAPESAC_X
}

}  // namespace tapesac::replay
