// MemoryMeter (see meter.h).
#include "tapesac/allocator/meter.h"

#include "tapesac/common/errors.h"

namespace tapesac::allocator {

void MemoryMeter::start() {
  TAPESAC_CHECK(!scope_, kGeneric, "tapesac: MemoryMeter.start() called twice; use one meter per `with` block");
  use_ = std::make_unique<CountingAllocatorUse>();
  counter_ = std::make_shared<MemoryCounter>(0);
  scope_.emplace(counter_);
}

void MemoryMeter::stop() noexcept {
  scope_.reset();
  use_.reset();
}

Gauge MemoryMeter::gauge() const noexcept { return counter_ ? counter_->total() : Gauge{}; }

}  // namespace tapesac::allocator
