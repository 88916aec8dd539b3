// device_op_timers() when tapesac is built without the GPU backend (with it: capture/cuda/device_op_timer.cpp).
#include "tapesac/capture/op_timer.h"

#ifndef TAPESAC_WITH_CUDA

namespace tapesac::capture {
namespace {

class NoDeviceTimers final : public OpTimerFactory {
 public:
  std::unique_ptr<OpTimer> make(const std::string& /*block*/, std::string* why) override {
    if (why != nullptr) {
      *why = "tapesac was built without the GPU backend (TAPESAC_CUDA off), so there are no device timers; op "
             "times are the CPU clock. Rebuild with a CUDA toolkit (nvcc) matching torch's CUDA version.";
    }
    return nullptr;
  }
};

}  // namespace

std::shared_ptr<OpTimerFactory> device_op_timers(int /*device*/) { return std::make_shared<NoDeviceTimers>(); }

}  // namespace tapesac::capture

#endif  // TAPESAC_WITH_CUDA
