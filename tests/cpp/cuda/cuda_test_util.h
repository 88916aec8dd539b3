// Helpers shared by the GPU test files of tapesac_test_cuda: skipping without a device, bitwise tensor equality.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tapesac/cuda/device.h"

/// First statement of a test that needs a CUDA device: GTEST_SKIP() without one.
#define TAPESAC_NEED_DEVICE()                             \
  if (::tapesac::cuda::device_count() == 0) {             \
    GTEST_SKIP() << "needs a CUDA device";                \
  }

namespace tapesac::cuda::testing {

/// Same shape, dtype and bytes.
inline bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.dtype() == b.dtype() &&
         torch::equal(a.contiguous().view(torch::kByte), b.contiguous().view(torch::kByte));
}

}  // namespace tapesac::cuda::testing
