// The memory side of one step, shared by the Session and its BlockCalls: the step's counter (the counting CPU
// allocator on the stepping thread, allocator/telemetry.h), the baseline, the device's figures behind a CUDA-free
// interface (capture/device_memory.h), the arena accounting, and the step's timeline spans and replay records.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tapesac/allocator/limit.h"
#include "tapesac/allocator/telemetry.h"
#include "tapesac/capture/device_memory.h"

namespace tapesac::replay {

/// A span of the step's timeline: one block's forward or one replay.
struct TimelineSpan {
  std::string kind;  // "forward" or "replay"
  std::string block;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  /// The call's plan key (replay::plan_key: the block's name, "name#k" for its k-th call in the step): tells the
  /// spans of two calls of one block apart.
  std::string call;
};

/// The execution record of one replayed value (contract outcome and cost).
struct ReplayRecord {
  std::string block;
  int64_t value = -1;
  std::string op;      // the op that produced the value's bytes
  std::string status;  // "match", "recovered", "rejected", "divergent" or "approximated" (TapeSAC(approx=...))
  int64_t bytes = 0;
  int64_t ns = 0;      // duration of the replay that rebuilt it (shared by the values of one replay)
  int64_t replay = 0;  // index of that replay within the block call
  std::string detail;  // what was recovered, rejected or diverged
};

/// The memory of one step. Spans and records are guarded by a mutex (replays may run on autograd's threads).
class StepMemory {
 public:
  /// `device` may be null (no GPU backend): CUDA figures are then unavailable and the counter is the only figure.
  StepMemory(size_t timeline_points, int64_t baseline, std::shared_ptr<capture::DeviceMemorySource> device);

  allocator::MemoryCounter& counter() { return *counter_; }
  const std::shared_ptr<allocator::MemoryCounter>& counter_ptr() const { return counter_; }
  /// Bytes of the model's parameters, buffers and gradients at step start (not counted by the step's counter).
  int64_t baseline() const { return baseline_; }
  /// Nanoseconds since the step started (the timeline's clock).
  int64_t elapsed_ns() const { return counter_->elapsed_ns(); }
  /// Bytes in use now as the memory limit sees them: on CUDA device `cuda_device` (>= 0) the caching allocator's
  /// figure, else baseline + the step's counter.
  int64_t in_use(int cuda_device = -1) const;
  /// The highest figure of the step so far: baseline + the counter's peak, and on `cuda_device` (>= 0) also the
  /// caching allocator's peak.
  int64_t peak_so_far(int cuda_device = -1) const;
  /// The device source (null without the GPU backend).
  capture::DeviceMemorySource* device() const { return device_.get(); }

  allocator::ArenaAccounting& arena() { return arena_; }
  void count_replay_piece() { ++replay_pieces_; }
  void add_span(TimelineSpan span);
  /// The tag of call `call` (its plan key) for allocator::mark_dropped_alive: the counter logs the changes of its
  /// marks, StepMemoryStats::alive_changes, so the keep-everything ceiling knows whose dropped bytes were alive when.
  int32_t alive_tag(const std::string& call);
  void add_record(ReplayRecord record);
  /// Moves the records out (step end).
  std::vector<ReplayRecord> take_records();

  friend struct StepMemoryStats;

 private:
  std::shared_ptr<allocator::MemoryCounter> counter_;
  int64_t baseline_;
  std::shared_ptr<capture::DeviceMemorySource> device_;
  allocator::ArenaAccounting arena_;
  std::atomic<int64_t> replay_pieces_{0};
  mutable std::mutex mu_;
  std::vector<TimelineSpan> spans_;     // guarded by mu_
  std::vector<std::string> alive_calls_;  // guarded by mu_: a tag's call
  std::vector<ReplayRecord> records_;   // guarded by mu_
};

/// A snapshot of StepMemory at step end.
struct StepMemoryStats {
  int64_t baseline = 0;
  allocator::Gauge total;  // the step's counter: peak is relative to step start (add baseline for the step peak)
  std::array<allocator::Gauge, allocator::kNumPhases> phases{};
  int64_t arena_shared = 0;
  int64_t arena_separate = 0;
  int64_t replay_pieces = 0;
  int64_t memory_limit = 0;
  std::vector<allocator::TimelinePoint> timeline;
  std::vector<TimelineSpan> spans;
  /// The changes of the marks of dropped bytes still alive, by call (allocator::AliveChange; a change's tag indexes
  /// alive_calls, the calls' plan keys).
  std::vector<allocator::AliveChange> alive_changes;
  std::vector<std::string> alive_calls;

  /// Snapshots `m` (copies the timeline and the spans). May throw std::bad_alloc.
  static StepMemoryStats of(const StepMemory& m, int64_t memory_limit);
};

/// Sets the counter's phase for a scope and puts the previous one back (also when the scope throws).
class PhaseScope {
 public:
  PhaseScope(allocator::MemoryCounter* c, allocator::Phase p) : c_(c), prev_(c ? c->phase() : p) {
    if (c_) c_->set_phase(p);
  }
  ~PhaseScope() {
    if (c_) c_->set_phase(prev_);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  allocator::MemoryCounter* c_;
  allocator::Phase prev_;
};

}  // namespace tapesac::replay
