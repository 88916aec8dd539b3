// The one clock of tapesac: monotonic nanoseconds (std::chrono::steady_clock). Every duration tapesac reports (op
// costs, replay times, timeline points, planning time) is read through it, so they are comparable with each other.
#pragma once

#include <chrono>
#include <cstdint>

namespace tapesac::common {

/// Nanoseconds on the monotonic clock since an unspecified epoch (differences only). Never throws.
inline int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Measures one interval from construction (or restart()) to elapsed_ns().
class Stopwatch {
 public:
  Stopwatch() noexcept : start_(now_ns()) {}
  void restart() noexcept { start_ = now_ns(); }
  int64_t elapsed_ns() const noexcept { return now_ns() - start_; }
  double elapsed_ms() const noexcept { return static_cast<double>(elapsed_ns()) / 1e6; }

 private:
  int64_t start_;
};

}  // namespace tapesac::common
