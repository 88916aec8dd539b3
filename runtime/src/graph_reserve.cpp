// plan_with_graph_reserve (graph_reserve.h, Note [Graph reserve]).
#include "tapesac/runtime/graph_reserve.h"

#include "tapesac/common/errors.h"

namespace tapesac::runtime {

ReservedPlan plan_with_graph_reserve(int64_t budget, int64_t pending_bytes,
                                     const std::function<PlanInfo(int64_t limit)>& plan_at) {
  ReservedPlan out{plan_at(budget), 0, std::nullopt};
  if (pending_bytes == 0) return out;
  out.capture = false;
  if (!out.plan.keeps_everything) {
    try {
      out.plan = plan_at(budget - pending_bytes);
      out.capture = true;
      out.reserve_bytes = pending_bytes;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kMemoryLimit) throw;
    }
  }
  return out;
}

}  // namespace tapesac::runtime
