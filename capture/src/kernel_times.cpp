// attribute_kernel_times (Note [Kernel time attribution] in kernel_times.h).
#include "tapesac/capture/kernel_times.h"

namespace tapesac::capture {

OpKernelTimes attribute_kernel_times(const std::vector<DeviceActivity>& activities,
                                     const std::vector<ExternalCorrelation>& correlations, int32_t block,
                                     size_t n_ops, const std::unordered_map<uint64_t, OpIndex>& graph_node_owner) {
  std::unordered_map<uint32_t, uint64_t> external;
  external.reserve(correlations.size());
  for (const auto& c : correlations) external[c.correlation_id] = c.external_id;
  OpKernelTimes out;
  out.ns.assign(n_ops, 0);
  out.records.assign(n_ops, 0);
  for (const auto& a : activities) {
    const int64_t dt = a.end_ns > a.start_ns ? static_cast<int64_t>(a.end_ns - a.start_ns) : 0;
    OpIndex op = -1;
    if (a.graph_node_id != 0) {
      const auto it = graph_node_owner.find(a.graph_node_id);
      if (it != graph_node_owner.end()) op = it->second;
    } else {
      const auto it = external.find(a.correlation_id);
      if (it != external.end() && static_cast<int32_t>(it->second >> 32) == block) {
        op = static_cast<OpIndex>(static_cast<uint32_t>(it->second & 0xffffffffu));
      }
    }
    if (op >= 0 && static_cast<size_t>(op) < n_ops) {
      out.ns[static_cast<size_t>(op)] += dt;
      out.records[static_cast<size_t>(op)] += 1;
    } else {
      out.unattributed_ns += dt;
      out.unattributed_records += 1;
    }
  }
  return out;
}

}  // namespace tapesac::capture
