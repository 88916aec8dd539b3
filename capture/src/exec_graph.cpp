// NodeAttribution (Note [Node attribution] in exec_graph.h) and NodeKind names.
#include "tapesac/capture/exec_graph.h"

#include <stdexcept>

namespace tapesac::capture {

const char* to_string(NodeKind kind) {
  switch (kind) {
    case NodeKind::kKernel: return "kernel";
    case NodeKind::kMemcpy: return "memcpy";
    case NodeKind::kMemset: return "memset";
    case NodeKind::kHost: return "host";
    case NodeKind::kChildGraph: return "child_graph";
    case NodeKind::kEmpty: return "empty";
    case NodeKind::kWaitEvent: return "wait_event";
    case NodeKind::kEventRecord: return "event_record";
    case NodeKind::kExtSemaphoreSignal: return "ext_semaphore_signal";
    case NodeKind::kExtSemaphoreWait: return "ext_semaphore_wait";
    case NodeKind::kMemAlloc: return "memalloc";
    case NodeKind::kMemFree: return "memfree";
    case NodeKind::kConditional: return "conditional";
    case NodeKind::kOther: return "other";
  }
  return "other";
}

size_t NodeAttribution::add_new(OpIndex owner, const Handle* nodes, size_t n) {
  size_t added = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<NodeId>(handles_.size());
    if (index_.emplace(nodes[i], id).second) {
      handles_.push_back(nodes[i]);
      owner_.push_back(owner);
      ++added;
    }
  }
  return added;
}

size_t NodeAttribution::after_op(OpIndex op, const Handle* nodes, size_t n) {
  if (op < 0 || op < last_op_) {
    throw std::invalid_argument("NodeAttribution::after_op: ops must be observed in tape order with indices >= 0; "
                                "got op " + std::to_string(op) + " after op " + std::to_string(last_op_));
  }
  last_op_ = op;
  return add_new(op, nodes, n);
}

size_t NodeAttribution::after_unowned(const Handle* nodes, size_t n) { return add_new(kUnowned, nodes, n); }

NodeId NodeAttribution::find(Handle h) const {
  const auto it = index_.find(h);
  return it == index_.end() ? -1 : it->second;
}

}  // namespace tapesac::capture
