// Attribution of device activity records (CUPTI kernels, memcpys, memsets) to tape ops: the pure part of the
// CUPTI timer (capture/cuda/cupti_timer.h), torch-free and CUDA-free so it is tested on CPU.
//
// Note [Kernel time attribution]. Eager: the timer pushes the external correlation id external_id(block, op)
// (CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2; Kineto uses CUSTOM0/1) around each op's dispatch; CUPTI then emits, per
// runtime/driver API call inside, an external-correlation record {correlation_id -> external id}, and each kernel
// record carries the API call's correlation_id. Graph replay: a kernel record carries the id of the node *cloned
// into the executable* (graph_node_id != 0), mapped back to the tape op through the GRAPHNODE_CLONED callback and
// the capture's node attribution (`graph_node_owner`). Time per op = sum of (end - start) of its records: device
// time, launch gaps not included. Records that map to no op of this block are counted as unattributed.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "tapesac/capture/tape.h"

namespace tapesac::capture {

/// One device activity (kernel, memcpy or memset) as the CUPTI timer extracts it from an activity record.
struct DeviceActivity {
  uint32_t correlation_id = 0;
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
  /// Id of the executable-graph node that ran it; 0 for work launched outside a graph.
  uint64_t graph_node_id = 0;
};

/// CUPTI's external-correlation record: API call `correlation_id` ran under external id `external_id`.
struct ExternalCorrelation {
  uint32_t correlation_id = 0;
  uint64_t external_id = 0;
};

/// The external correlation id of op `op` of block `block` (block in the high 32 bits).
inline uint64_t external_id(int32_t block, OpIndex op) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(block)) << 32) | static_cast<uint32_t>(op);
}

struct OpKernelTimes {
  /// Device nanoseconds per tape op (size n_ops).
  std::vector<int64_t> ns;
  /// Records per tape op.
  std::vector<int32_t> records;
  int64_t unattributed_ns = 0;
  int64_t unattributed_records = 0;
};

// Header-only: the CUDA backend's tests (tapesac::cuda, which tapesac::capture links) use it too.
/// Note [Kernel time attribution]. `graph_node_owner`: executable-graph node id -> tape op of `block` (empty for
/// eager). Pure; O(records + correlations).
inline OpKernelTimes attribute_kernel_times(const std::vector<DeviceActivity>& activities,
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

/// Executable-node id -> tape op, for attribute_kernel_times on a graph launch (Note [Kernel time attribution]).
/// `template_ids[n]`: CUPTI's id of template node n (NodeId order), `owner[n]` its tape op (kUnowned: none, -1);
/// `cloned`: template id -> id of its clone in the executable (the GRAPHNODE_CLONED callbacks of its
/// instantiation). Nodes without an owner or a clone are left out (their records count as unattributed). Pure;
/// throws std::invalid_argument when the two vectors differ in size.
inline std::unordered_map<uint64_t, OpIndex> exec_node_owner(const std::vector<uint64_t>& template_ids,
                                                               const std::vector<OpIndex>& owner,
                                                               const std::unordered_map<uint64_t, uint64_t>& cloned) {
  if (template_ids.size() != owner.size()) {
    throw std::invalid_argument("exec_node_owner: " + std::to_string(template_ids.size()) + " node ids but " +
                                std::to_string(owner.size()) + " owners");
  }
  std::unordered_map<uint64_t, OpIndex> out;
  for (size_t i = 0; i < owner.size(); ++i) {
    if (owner[i] < 0) continue;
    const auto it = cloned.find(template_ids[i]);
    if (it != cloned.end()) out[it->second] = owner[i];
  }
  return out;
}

}  // namespace tapesac::capture
