// Byte-level checksums for replay checks: "are these two buffers bit-identical?" without copying them back.
//
// Contract: checksum(bytes) = sum over 8-byte words w_i (the last one zero-padded) of mix(w_i, i), mod 2^64,
// then finalised with the byte count. It depends on every byte and its position, is not cryptographic, and is
// identical for device_checksum() and host_checksum() on the same bytes, whatever the pointer alignment.
// A zero-length buffer has a defined checksum (ptr may then be null).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace tapesac::cuda {

/// Checksum of `bytes` bytes of device (or managed) memory at `ptr`, computed by a kernel on `stream`.
/// Synchronizes `stream` to return the value, so it must not be called while `stream` is being captured.
/// Throws std::invalid_argument for a null `ptr` with `bytes > 0`, std::runtime_error on CUDA failure.
std::uint64_t device_checksum(const void* ptr, std::size_t bytes, cudaStream_t stream);

/// The same checksum computed on the CPU over host memory (reference for tests and CPU tensors).
/// Throws std::invalid_argument for a null `ptr` with `bytes > 0`.
std::uint64_t host_checksum(const void* ptr, std::size_t bytes);

}  // namespace tapesac::cuda
