// capture::cuda_device_memory() of the GPU backend: the caching allocator's statistics and the arena routing
// (arena.h), behind the CUDA-free interface of tapesac/capture/device_memory.h.
#include "tapesac/capture/device_memory.h"

#include "tapesac/cuda/arena.h"

namespace tapesac::capture {
namespace {

class ArenaPoolRouting final : public PoolRouting {
 public:
  ArenaPoolRouting(int device, PoolId pool) : routing_(device, pool.first, pool.second) {}

 private:
  cuda::ArenaRouting routing_;
};

class CudaDeviceMemory final : public DeviceMemorySource {
 public:
  int64_t allocated(int device) const override { return cuda::allocated_bytes(device); }
  int64_t allocated_peak(int device) const override { return cuda::device_memory(device).allocated_peak; }
  std::unique_ptr<PoolRouting> route(int device, PoolId pool) override {
    return std::make_unique<ArenaPoolRouting>(device, pool);
  }
};

}  // namespace

std::shared_ptr<DeviceMemorySource> cuda_device_memory() {
  static const auto source = std::make_shared<CudaDeviceMemory>();
  return source;
}

}  // namespace tapesac::capture
