// MemoryMeter: counts the CPU tensor memory allocated on the calling thread between start() and stop() (and the
// frees of exactly those bytes, on any thread), through the counting allocator layer (telemetry.h). Backs
// tapesac.MemoryMeter. Not thread-safe: one meter per `with` block, started and stopped on one thread.
#pragma once

#include <memory>
#include <optional>

#include "tapesac/allocator/telemetry.h"

namespace tapesac::allocator {

class MemoryMeter {
 public:
  /// Installs the counting layer (if not yet) and makes a fresh counter active on this thread. Throws
  /// tapesac::Error when the meter is already started.
  void start();
  /// Deactivates the counter; its figures stay readable (frees of counted bytes still count). Idempotent.
  void stop() noexcept;
  /// {current, peak, allocated, allocations} so far (zeros before start()).
  Gauge gauge() const noexcept;

 private:
  std::unique_ptr<CountingAllocatorUse> use_;
  std::shared_ptr<MemoryCounter> counter_;
  std::optional<ScopedCounter> scope_;
};

}  // namespace tapesac::allocator
