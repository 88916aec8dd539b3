// ArenaRouting and device memory figures (see tapesac/cuda/arena.h).
#include "tapesac/cuda/arena.h"

#include <thread>

#include <c10/cuda/CUDACachingAllocator.h>

namespace tapesac::cuda {

namespace alloc = c10::cuda::CUDACachingAllocator;

ArenaRouting::ArenaRouting(int device, uint64_t pool_first, uint64_t pool_second)
    : device_(device), first_(pool_first), second_(pool_second) {
  // Route by thread, as torch.cuda.use_mem_pool does: the filter runs on the allocating thread.
  alloc::beginAllocateToPool(static_cast<c10::DeviceIndex>(device_), {first_, second_},
                             [tid = std::this_thread::get_id()](cudaStream_t) {
                               return std::this_thread::get_id() == tid;
                             });
}

ArenaRouting::~ArenaRouting() {
  try {
    alloc::endAllocateToPool(static_cast<c10::DeviceIndex>(device_), {first_, second_});
    // beginAllocateToPool took a use of the pool (create-or-incref); give it back, as torch.cuda.use_mem_pool
    // does, so the pool's memory is returned once the MemPool itself goes.
    alloc::releasePool(static_cast<c10::DeviceIndex>(device_), {first_, second_});
  } catch (...) {
    // A destructor must not throw; the pool stays routed only for this thread, which is ending its replay.
  }
}

DeviceMemory device_memory(int device) {
  const auto stats = alloc::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  constexpr size_t kAggregate = 0;
  DeviceMemory m;
  m.allocated_current = stats.allocated_bytes[kAggregate].current;
  m.allocated_peak = stats.allocated_bytes[kAggregate].peak;
  m.reserved_current = stats.reserved_bytes[kAggregate].current;
  m.reserved_peak = stats.reserved_bytes[kAggregate].peak;
  return m;
}

int64_t allocated_bytes(int device) { return device_memory(device).allocated_current; }

}  // namespace tapesac::cuda
