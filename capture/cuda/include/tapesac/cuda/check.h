// TAPESAC_CUDA_CHECK(expr): evaluate a CUDA runtime call once; on failure throw std::runtime_error naming the
// expression, the CUDA error name and description, and file:line.
//
// Contract: use on every CUDA runtime call whose failure the caller cannot handle locally. Never use in a
// noexcept function or a destructor (deleters ignore errors on purpose). The thrown message reads
//   "CUDA call `cudaEventRecord(e, s)` failed: expected cudaSuccess, got cudaErrorInvalidResourceHandle
//    (invalid resource handle) at capture/cuda/event.cpp:42"
#pragma once

#include <cuda_runtime_api.h>

namespace tapesac::cuda::detail {

/// Throws std::runtime_error describing `err` (see the file comment); clears the non-sticky error state first.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);

inline void check_cuda(cudaError_t err, const char* expr, const char* file, int line) {
  if (err != cudaSuccess) {
    throw_cuda_error(err, expr, file, line);
  }
}

}  // namespace tapesac::cuda::detail

#define TAPESAC_CUDA_CHECK(expr) ::tapesac::cuda::detail::check_cuda((expr), #expr, __FILE__, __LINE__)
