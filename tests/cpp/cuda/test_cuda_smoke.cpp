// Smoke tests of the GPU backend skeleton (tapesac::cuda): device discovery, TAPESAC_CUDA_CHECK, Event, checksum.
//
// Suites named CudaHost* need no device and run in CI (ctest labels cpu;gpu); the others need a device and
// GTEST_SKIP() without one (label gpu; run by the GPU check script).
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/cuda/check.h"
#include "tapesac/cuda/checksum.h"
#include "tapesac/cuda/device.h"
#include "tapesac/cuda/event.h"

namespace tc = tapesac::cuda;

namespace {

std::vector<unsigned char> pattern(std::size_t n) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = static_cast<unsigned char>((i * 131 + 7) & 0xFF);
  }
  return v;
}

}  // namespace

TEST(CudaHostDevice, CountIsNonNegativeAndStable) {
  const int n = tc::device_count();
  EXPECT_GE(n, 0);
  EXPECT_EQ(tc::device_count(), n);
  if (n > 0) {
    // With a device the error slot must be clean; without a driver every runtime call (cudaGetLastError too)
    // reports the sticky initialisation error, so there is nothing to check.
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

TEST(CudaHostCheck, MessageNamesExpressionErrorAndLocation) {
  try {
    TAPESAC_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL() << "expected TAPESAC_CUDA_CHECK to throw";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("`cudaErrorInvalidValue`"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got cudaErrorInvalidValue"), std::string::npos) << msg;
    EXPECT_NE(msg.find("test_cuda_smoke.cpp:"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(TAPESAC_CUDA_CHECK(cudaSuccess));
}

TEST(CudaHostChecksum, DependsOnEveryByteAndItsPosition) {
  auto a = pattern(1000);
  const std::uint64_t base = tc::host_checksum(a.data(), a.size());
  EXPECT_EQ(base, tc::host_checksum(a.data(), a.size()));
  a[999] ^= 1;  // last byte, inside the zero-padded tail word
  EXPECT_NE(base, tc::host_checksum(a.data(), a.size()));
  a[999] ^= 1;
  std::swap(a[0], a[8]);  // same bytes, different positions
  EXPECT_NE(base, tc::host_checksum(a.data(), a.size()));
  EXPECT_NE(tc::host_checksum(a.data(), 16), tc::host_checksum(a.data(), 17));
  EXPECT_EQ(tc::host_checksum(nullptr, 0), tc::host_checksum(a.data(), 0));
  EXPECT_THROW(tc::host_checksum(nullptr, 1), std::invalid_argument);
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (tc::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device (device_count() == 0)";
    }
  }
};

TEST_F(CudaDeviceTest, ChecksumMatchesHostForAlignedAndUnalignedBuffers) {
  const auto host = pattern(3 * 4096 + 5);
  void* dev = nullptr;
  TAPESAC_CUDA_CHECK(cudaMalloc(&dev, host.size()));
  TAPESAC_CUDA_CHECK(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  TAPESAC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  tc::Event start;
  tc::Event stop;
  start.record(stream);
  const std::uint64_t got = tc::device_checksum(dev, host.size(), stream);
  stop.record(stream);
  stop.synchronize();
  EXPECT_EQ(got, tc::host_checksum(host.data(), host.size()));
  EXPECT_TRUE(stop.query());
  EXPECT_GE(stop.elapsed_ms(start), 0.0F);

  const auto* bytes = static_cast<const unsigned char*>(dev);
  for (std::size_t offset : {1U, 3U, 7U}) {
    const std::size_t n = host.size() - offset;
    EXPECT_EQ(tc::device_checksum(bytes + offset, n, stream), tc::host_checksum(host.data() + offset, n))
        << "offset " << offset;
  }
  EXPECT_EQ(tc::device_checksum(dev, 0, stream), tc::host_checksum(nullptr, 0));

  TAPESAC_CUDA_CHECK(cudaStreamDestroy(stream));
  TAPESAC_CUDA_CHECK(cudaFree(dev));
}

TEST_F(CudaDeviceTest, EventIsMoveOnlyAndMovedFromThrows) {
  tc::Event a;
  const cudaEvent_t raw = a.get();
  tc::Event b = std::move(a);
  EXPECT_EQ(b.get(), raw);
  EXPECT_EQ(a.get(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is what is tested
  EXPECT_THROW(a.record(nullptr), std::logic_error);

  tc::Event untimed(tc::EventOptions{.timing = false});
  tc::Event timed;
  timed.record(nullptr);
  untimed.record(nullptr);
  untimed.synchronize();
  EXPECT_THROW((void)untimed.elapsed_ms(timed), std::runtime_error);
}
