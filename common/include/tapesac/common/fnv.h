// FNV-1a, 64 bits: the one non-cryptographic hash of tapesac (tape signatures, graph keys, the strict contract's byte
// checksums). Stable across runs and processes: no seed, no addresses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tapesac::common {

class Fnv64 {
 public:
  static constexpr uint64_t kOffset = 14695981039346656037ull;  // 0xcbf29ce484222325
  static constexpr uint64_t kPrime = 1099511628211ull;

  /// Mixes the 8 bytes of `x`, low byte first.
  void mix(uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h_ = (h_ ^ (x & 0xff)) * kPrime;
      x >>= 8;
    }
  }
  /// Mixes the length of `s`, then its bytes.
  void mix_bytes(const std::string& s) {
    mix(s.size());
    mix_raw(s.data(), s.size());
  }
  /// Mixes `n` bytes at `p`, in order (no length prefix).
  void mix_raw(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ b[i]) * kPrime;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = kOffset;
};

}  // namespace tapesac::common
