// The graph reserve of policy "auto" with a graph backend: room under the limit for the static memory of the block
// graphs not captured yet.
//
// Note [Graph reserve]. A captured graph's static memory stays for every later step, so it must fit beside the
// plan. When graphs are pending (GraphCache::pending_bytes > 0, measured on their warm-up replays; only as many as
// the cache still has room for, the largest):
//   * a plan that keeps everything replays nothing and needs no graph: capture is switched off, no reserve;
//   * otherwise the plan is made under budget - pending: when some plan fits, capture is switched on and the
//     reserve is part of the predicted peak;
//   * else the plan gets the whole budget and capture is switched off (those blocks keep replaying eagerly; their
//     graph fallback says memory_limit).
// Without pending graphs nothing changes (capture stays as it was).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "tapesac/runtime/plan_info.h"

namespace tapesac::runtime {

/// A plan with its graph reserve.
struct ReservedPlan {
  PlanInfo plan;               ///< the plan to use (predicted_peak_bytes does not include the reserve)
  int64_t reserve_bytes = 0;   ///< the room left for graphs (0 when capture is off)
  std::optional<bool> capture; ///< whether graphs may be captured; nullopt: no graph pending, leave it as it is
};

/// Plans under `budget` bytes leaving room for `pending_bytes` of graphs (Note [Graph reserve]). `plan_at(limit)`
/// plans under `limit` and throws tapesac::Error (kMemoryLimit) when no plan fits; the first call's error (under the
/// whole budget) propagates, the reserve's is the fallback.
ReservedPlan plan_with_graph_reserve(int64_t budget, int64_t pending_bytes,
                                     const std::function<PlanInfo(int64_t limit)>& plan_at);

}  // namespace tapesac::runtime
