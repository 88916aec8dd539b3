// device_checksum() / host_checksum(): see tapesac/cuda/checksum.h.
//
// Each word is mixed with its index (splitmix64 finaliser) and the mixes are summed; integer addition is
// associative, so the parallel reduction (warp shuffles + one atomicAdd per warp) is deterministic.
#include "tapesac/cuda/checksum.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tapesac/cuda/check.h"

namespace tapesac::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 4096;
constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

__host__ __device__ inline std::uint64_t mix(std::uint64_t word, std::uint64_t index) {
  std::uint64_t z = word ^ (index * kGolden + 0x632BE59BD9B4E019ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

__host__ __device__ inline std::uint64_t finalize(std::uint64_t sum, std::uint64_t bytes) {
  return mix(sum, bytes ^ 0xA0761D6478BD642FULL);
}

// Little-endian word `index` of the buffer, zero-padded past `bytes`; byte loads so any alignment works.
__device__ inline std::uint64_t load_word_bytes(const unsigned char* p, std::size_t bytes, std::size_t index) {
  std::uint64_t w = 0;
  const std::size_t base = index * 8;
  for (int b = 0; b < 8; ++b) {
    if (base + b < bytes) {
      w |= static_cast<std::uint64_t>(p[base + b]) << (8 * b);
    }
  }
  return w;
}

template <bool kAligned>
__global__ void checksum_kernel(const unsigned char* p, std::size_t bytes, std::size_t words,
                                unsigned long long* out) {
  std::uint64_t local = 0;
  const std::size_t stride = static_cast<std::size_t>(blockDim.x) * gridDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    std::uint64_t w;
    if (kAligned && (i + 1) * 8 <= bytes) {
      w = reinterpret_cast<const std::uint64_t*>(p)[i];
    } else {
      w = load_word_bytes(p, bytes, i);
    }
    local += mix(w, i);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    local += __shfl_down_sync(0xFFFFFFFFU, local, offset);
  }
  if ((threadIdx.x & 31U) == 0) {
    atomicAdd(out, static_cast<unsigned long long>(local));
  }
}

void check_args(const void* ptr, std::size_t bytes, const char* fn) {
  if (ptr == nullptr && bytes > 0) {
    throw std::invalid_argument(std::string("tapesac::cuda::") + fn + ": expected a non-null pointer for " +
                                std::to_string(bytes) + " bytes, got nullptr");
  }
}

}  // namespace

std::uint64_t device_checksum(const void* ptr, std::size_t bytes, cudaStream_t stream) {
  check_args(ptr, bytes, "device_checksum");
  if (bytes == 0) {
    return finalize(0, 0);
  }
  const std::size_t words = (bytes + 7) / 8;
  const unsigned blocks =
      static_cast<unsigned>(std::min<std::size_t>((words + kThreads - 1) / kThreads, kMaxBlocks));

  unsigned long long* d_sum = nullptr;
  TAPESAC_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d_sum), sizeof(*d_sum), stream));
  // Free on every path; the stream-ordered free runs after the copy below.
  struct Free {
    unsigned long long* p;
    cudaStream_t s;
    ~Free() { (void)cudaFreeAsync(p, s); }
  } free_guard{d_sum, stream};

  TAPESAC_CUDA_CHECK(cudaMemsetAsync(d_sum, 0, sizeof(*d_sum), stream));
  const auto* p = static_cast<const unsigned char*>(ptr);
  if (reinterpret_cast<std::uintptr_t>(ptr) % alignof(std::uint64_t) == 0) {
    checksum_kernel<true><<<blocks, kThreads, 0, stream>>>(p, bytes, words, d_sum);
  } else {
    checksum_kernel<false><<<blocks, kThreads, 0, stream>>>(p, bytes, words, d_sum);
  }
  TAPESAC_CUDA_CHECK(cudaGetLastError());
  unsigned long long sum = 0;
  TAPESAC_CUDA_CHECK(cudaMemcpyAsync(&sum, d_sum, sizeof(sum), cudaMemcpyDeviceToHost, stream));
  TAPESAC_CUDA_CHECK(cudaStreamSynchronize(stream));
  return finalize(sum, bytes);
}

std::uint64_t host_checksum(const void* ptr, std::size_t bytes) {
  check_args(ptr, bytes, "host_checksum");
  const auto* p = static_cast<const unsigned char*>(ptr);
  std::uint64_t sum = 0;
  const std::size_t words = (bytes + 7) / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w = 0;
    const std::size_t n = std::min<std::size_t>(8, bytes - i * 8);
    std::memcpy(&w, p + i * 8, n);  // little-endian host (x86-64, aarch64), as on the device
    sum += mix(w, i);
  }
  return finalize(sum, bytes);
}

}  // namespace tapesac::cuda
