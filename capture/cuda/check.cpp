// throw_cuda_error(): the cold path of TAPESAC_CUDA_CHECK (tapesac/cuda/check.h). Builds the message once.
#include "tapesac/cuda/check.h"

#include <sstream>
#include <stdexcept>

namespace tapesac::cuda::detail {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  // Non-sticky errors stay in the runtime's last-error slot; clear them so the next call starts clean.
  (void)cudaGetLastError();
  std::ostringstream msg;
  msg << "CUDA call `" << expr << "` failed: expected cudaSuccess, got " << cudaGetErrorName(err) << " ("
      << cudaGetErrorString(err) << ") at " << file << ":" << line;
  throw std::runtime_error(msg.str());
}

}  // namespace tapesac::cuda::detail
