// cuda_device_memory() when tapesac is built without the GPU backend (with it: capture/cuda/device_memory.cpp).
#include "tapesac/capture/device_memory.h"

#ifndef TAPESAC_WITH_CUDA

namespace tapesac::capture {

std::shared_ptr<DeviceMemorySource> cuda_device_memory() { return nullptr; }

}  // namespace tapesac::capture

#endif  // TAPESAC_WITH_CUDA
