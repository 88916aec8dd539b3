// Device discovery for the GPU backend.
//
// Contract: device_count() never throws and never aborts; it returns 0 when there is no CUDA driver, no device,
// or the runtime reports any error (CI machines have the toolkit but no driver), so callers can pick the CPU
// path with one branch. Including this header pulls in no CUDA headers.
#pragma once

namespace tapesac::cuda {

/// Number of CUDA devices visible to this process; 0 when there is no driver or device or the CUDA runtime
/// fails (the error is cleared so it does not leak into a later cudaGetLastError()). Thread-safe.
int device_count() noexcept;

}  // namespace tapesac::cuda
