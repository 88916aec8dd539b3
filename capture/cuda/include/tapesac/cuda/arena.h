// The CUDA replay arena and device memory figures, read from PyTorch's caching allocator.
//
// Contract.
//  * ArenaRouting: while alive, every CUDA allocation *made on the constructing thread* is served from the private
//    memory pool `pool` (a MempoolId_t: exactly one half non-zero, e.g. torch.cuda.MemPool().id). All blocks'
//    replays route into one pool, so its reserved size is the largest replay working set (freed replay tensors'
//    blocks are reused by the next replay). Other threads (and the autograd engine's own buffers on them) are
//    not routed. Destroy on the constructing thread.
//  * allocated_bytes() / DeviceMemory: the caching allocator's aggregate statistics for `device`.
//  Including this header pulls in no CUDA or torch CUDA headers.
#pragma once

#include <cstdint>

namespace tapesac::cuda {

class ArenaRouting {
 public:
  ArenaRouting(int device, uint64_t pool_first, uint64_t pool_second);
  ~ArenaRouting();
  ArenaRouting(const ArenaRouting&) = delete;
  ArenaRouting& operator=(const ArenaRouting&) = delete;

 private:
  int device_;
  uint64_t first_, second_;
};

struct DeviceMemory {
  int64_t allocated_current = 0;
  int64_t allocated_peak = 0;
  int64_t reserved_current = 0;
  int64_t reserved_peak = 0;
};

/// Bytes of tensors allocated on `device` now (caching allocator's allocated_bytes, aggregate).
int64_t allocated_bytes(int device);
DeviceMemory device_memory(int device);

}  // namespace tapesac::cuda
