// The step's memory (see step_memory.h).
#include "tapesac/replay/step_memory.h"

#include <algorithm>

namespace tapesac::replay {
namespace {
// Bounds of the per-step lists: a runaway step (millions of replays) must not grow host memory without end.
constexpr size_t kMaxSpans = 100000;
constexpr size_t kMaxRecords = 100000;
}  // namespace

StepMemory::StepMemory(size_t timeline_points, int64_t baseline, std::shared_ptr<capture::DeviceMemorySource> device)
    : counter_(std::make_shared<allocator::MemoryCounter>(timeline_points)),
      baseline_(baseline),
      device_(std::move(device)) {}

int64_t StepMemory::in_use(int cuda_device) const {
  if (cuda_device >= 0 && device_) return device_->allocated(cuda_device);
  return baseline_ + counter_->current();
}

int64_t StepMemory::peak_so_far(int cuda_device) const {
  int64_t peak = baseline_ + counter_->total().peak;
  if (cuda_device >= 0 && device_) peak = std::max(peak, device_->allocated_peak(cuda_device));
  return peak;
}

void StepMemory::add_span(TimelineSpan span) {
  std::lock_guard<std::mutex> lock(mu_);
  if (spans_.size() < kMaxSpans) spans_.push_back(std::move(span));
}

int32_t StepMemory::alive_tag(const std::string& call) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = std::find(alive_calls_.begin(), alive_calls_.end(), call);
  if (it != alive_calls_.end()) return static_cast<int32_t>(it - alive_calls_.begin());
  alive_calls_.push_back(call);
  return static_cast<int32_t>(alive_calls_.size() - 1);
}

void StepMemory::add_record(ReplayRecord record) {
  std::lock_guard<std::mutex> lock(mu_);
  if (records_.size() < kMaxRecords) records_.push_back(std::move(record));
}

std::vector<ReplayRecord> StepMemory::take_records() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ReplayRecord> out = std::move(records_);
  records_.clear();
  return out;
}

StepMemoryStats StepMemoryStats::of(const StepMemory& m, int64_t memory_limit) {
  StepMemoryStats s;
  s.baseline = m.baseline_;
  s.total = m.counter_->total();
  for (int p = 0; p < allocator::kNumPhases; ++p) {
    s.phases[static_cast<size_t>(p)] = m.counter_->phase_gauge(static_cast<allocator::Phase>(p));
  }
  s.arena_shared = m.arena_.shared_bytes();
  s.arena_separate = m.arena_.separate_bytes();
  s.replay_pieces = m.replay_pieces_.load();
  s.memory_limit = memory_limit;
  s.timeline = m.counter_->timeline();
  s.alive_changes = m.counter_->alive_changes();
  std::lock_guard<std::mutex> lock(m.mu_);
  s.spans = m.spans_;
  s.alive_calls = m.alive_calls_;
  return s;
}

}  // namespace tapesac::replay
