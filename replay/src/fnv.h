// FNV-1a, 64 bits: the hash of tape signatures and graph keys (replay/src only).
#pragma once

#include <cstdint>
#include <string>

namespace tapesac::replay {

class Fnv64 {
 public:
  /// Mixes the 8 bytes of `x`, low byte first.
  void mix(uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h_ = (h_ ^ (x & 0xff)) * 1099511628211ull;
      x >>= 8;
    }
  }
  void mix_bytes(const std::string& s) {
    mix(s.size());
    for (const char c : s) h_ = (h_ ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace tapesac::replay
