// Byte counts for people: the one formatter of tapesac's messages and tables (Python's tapesac.memory.format_bytes
// calls it through the bindings). Binary units: "512 B", "1.5 KiB", "12.00 MiB", "1.50 GiB".
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace tapesac::common {

inline std::string format_bytes(int64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  const double a = std::abs(b);
  constexpr double kKi = 1024.0, kMi = kKi * 1024.0, kGi = kMi * 1024.0;
  if (a >= kGi) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / kGi);
  } else if (a >= kMi) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / kMi);
  } else if (a >= kKi) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / kKi);
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  }
  return buf;
}

/// "<format_bytes> (<n> bytes)": a figure a user can paste back as an exact memory_limit.
inline std::string format_bytes_exact(int64_t bytes) {
  return format_bytes(bytes) + " (" + std::to_string(bytes) + " bytes)";
}

}  // namespace tapesac::common
