// The device side of the step's memory, CUDA-free: what the memory limit reads on a CUDA device (the caching
// allocator's figures) and how a replay's allocations are routed into the replay arena (a private memory pool).
// The CUDA implementation lives in capture/cuda (device_memory.cpp); without the GPU backend there is none and
// cuda_device_memory() returns null — the CPU counter (allocator/telemetry.h) is then the only figure.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

namespace tapesac::capture {

/// An open routing of allocations into a pool; the routing ends when it is destroyed (on the thread that made it).
class PoolRouting {
 public:
  virtual ~PoolRouting() = default;
};

/// A memory pool id (torch's MempoolId_t: exactly one half non-zero); {0, 0} means "no pool".
using PoolId = std::pair<uint64_t, uint64_t>;

/// Device memory figures and arena routing. Thread-safe.
class DeviceMemorySource {
 public:
  virtual ~DeviceMemorySource() = default;
  /// Bytes of tensors allocated on CUDA device `device` now.
  virtual int64_t allocated(int device) const = 0;
  /// The peak of allocated(device) since the caching allocator's peak statistics were last reset.
  virtual int64_t allocated_peak(int device) const = 0;
  /// Serves every allocation this thread makes on `device` from `pool` until the result is destroyed. Throws
  /// tapesac::Error when the allocator refuses (e.g. the pool is already routed on this thread).
  virtual std::unique_ptr<PoolRouting> route(int device, PoolId pool) = 0;
};

/// The CUDA caching allocator's figures (a process-wide instance), or null when tapesac was built without the GPU
/// backend.
std::shared_ptr<DeviceMemorySource> cuda_device_memory();

}  // namespace tapesac::capture
