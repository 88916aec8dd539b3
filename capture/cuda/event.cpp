// Event: see tapesac/cuda/event.h.
#include "tapesac/cuda/event.h"

#include <stdexcept>
#include <string>

namespace tapesac::cuda {

void Event::Deleter::operator()(cudaEvent_t event) const noexcept {
  // A destructor cannot report; cudaEventDestroy fails only for an invalid handle or a dead context.
  (void)cudaEventDestroy(event);
}

Event::Event(EventOptions options) {
  unsigned flags = cudaEventDefault;
  if (!options.timing) {
    flags |= cudaEventDisableTiming;
  }
  if (options.blocking_sync) {
    flags |= cudaEventBlockingSync;
  }
  cudaEvent_t raw = nullptr;
  TAPESAC_CUDA_CHECK(cudaEventCreateWithFlags(&raw, flags));
  handle_.reset(raw);
}

Event Event::adopt(cudaEvent_t raw) noexcept { return Event(Handle(raw)); }

cudaEvent_t Event::checked_get(const char* what) const {
  if (!handle_) {
    throw std::logic_error(std::string("tapesac::cuda::Event::") + what +
                           ": expected a live event, got a moved-from one");
  }
  return handle_.get();
}

void Event::record(cudaStream_t stream) { TAPESAC_CUDA_CHECK(cudaEventRecord(checked_get("record"), stream)); }

void Event::synchronize() const { TAPESAC_CUDA_CHECK(cudaEventSynchronize(checked_get("synchronize"))); }

bool Event::query() const {
  const cudaError_t err = cudaEventQuery(checked_get("query"));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  TAPESAC_CUDA_CHECK(err);
  return true;
}

float Event::elapsed_ms(const Event& start) const {
  float ms = 0.0F;
  TAPESAC_CUDA_CHECK(cudaEventElapsedTime(&ms, start.checked_get("elapsed_ms(start)"), checked_get("elapsed_ms")));
  return ms;
}

}  // namespace tapesac::cuda
