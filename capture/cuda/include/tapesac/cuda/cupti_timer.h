// Per-op device times: a CUPTI activity collector (preferred) and a CUDA-event timer (fallback).
//
// Contract.
//  * CuptiTimer::start() claims CUPTI for the process: it loads the library (cupti_loader.h), subscribes
//    (cuptiSubscribe_v2: one subscriber per process, so it fails while torch.profiler / Nsight holds CUPTI, and the
//    reason names the holder), registers activity buffers and enables CONCURRENT_KERNEL, MEMCPY, MEMSET, RUNTIME,
//    DRIVER and EXTERNAL_CORRELATION records and the GRAPHNODE_CLONED resource callback. Only one CuptiTimer can
//    be active; start() returns null with a reason instead of throwing. Start it before a graph is instantiated
//    when its replays are to be timed per node (the clone callback fires at instantiation).
//  * push(external_id)/pop() bracket one op's dispatch on the calling thread (CUSTOM2 external correlation ids,
//    capture::external_id(block, op)); stop() synchronises the device, flushes, disables and unsubscribes, and
//    returns the records; join them with capture::attribute_kernel_times (kernel_times.h).
//  * EventOpTimer records a timing event at each op boundary on the current stream (from a pool reused across
//    blocks) and reads all of them after one synchronisation (stream time, including gaps; see reference/cuda.md
//    §C6); brackets nest, each segment is charged to the innermost open op.
//  * Everything here needs a CUDA device except CuptiTimer::start()'s refusals; not thread-safe.
//  Written against CUDA 13.0; compiled and linked in CI, not yet run on a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tapesac/capture/kernel_times.h"

namespace tapesac::cuda {

struct CuptiRecords {
  std::vector<capture::DeviceActivity> activities;
  std::vector<capture::ExternalCorrelation> correlations;
  /// CUPTI id of a template graph node -> id of its clone in an executable (GRAPHNODE_CLONED).
  std::unordered_map<uint64_t, uint64_t> cloned;
  /// Records CUPTI dropped (buffers full).
  uint64_t dropped = 0;
};

class CuptiTimer {
 public:
  /// Null (and *why set) when CUPTI cannot be loaded, is held by another subscriber, or refuses a step.
  static std::unique_ptr<CuptiTimer> start(std::string* why);
  /// Stops if stop() was not called (errors ignored).
  ~CuptiTimer();
  CuptiTimer(const CuptiTimer&) = delete;
  CuptiTimer& operator=(const CuptiTimer&) = delete;

  void push(uint64_t external_id);
  void pop();
  /// Synchronises the device, flushes every buffer and releases CUPTI. Throws std::runtime_error on failure.
  CuptiRecords stop();
  /// CUPTI's id of a template graph node (a cudaGraphNode_t passed as uint64_t, as NodeAttribution holds them).
  uint64_t graph_node_id(uint64_t node_handle) const;
  /// Executable-node id -> tape op, from the template node handles of a capture and their owners, through the
  /// clone map of `records`. Nodes without an owner or a clone are left out.
  std::unordered_map<uint64_t, capture::OpIndex> exec_node_owner(const std::vector<uint64_t>& template_handles,
                                                                  const std::vector<capture::OpIndex>& owner,
                                                                  const CuptiRecords& records) const;

 struct Impl;  // public only for the C callbacks in cupti_timer.cpp

 private:
  explicit CuptiTimer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class EventOpTimer {
 public:
  EventOpTimer();
  ~EventOpTimer();
  EventOpTimer(const EventOpTimer&) = delete;
  EventOpTimer& operator=(const EventOpTimer&) = delete;

  /// Creates the events of `ops` brackets up front (they are otherwise created on first need and then reused).
  void reserve(size_t ops);
  /// Records the start of op `op` on the current CUDA stream. Brackets nest: an open op's time stops while an
  /// inner one runs (exclusive time).
  void begin(capture::OpIndex op);
  /// Records the end of the innermost open op. Throws std::logic_error when none is open.
  void end();
  /// Synchronises on the last event and returns nanoseconds per op (size n_ops; ops never timed are 0; an op timed
  /// several times accumulates). Resets the timer (its events are kept for reuse).
  std::vector<int64_t> collect(size_t n_ops);
  /// Forgets every bracket (open ones included) without reading them. Never throws.
  void reset() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tapesac::cuda
