// device_count(): see tapesac/cuda/device.h. Never throws; any CUDA error means "no usable device" (0).
#include "tapesac/cuda/device.h"

#include <cuda_runtime_api.h>

namespace tapesac::cuda {

int device_count() noexcept {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // Without a driver this is cudaErrorInsufficientDriver / cudaErrorNoDevice; clear it so the next
    // TAPESAC_CUDA_CHECK elsewhere does not report a stale error.
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace tapesac::cuda
