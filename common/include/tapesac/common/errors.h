// Error types shared by every layer (tapesac::common, below capture). User-facing failures throw tapesac::Error with
// a kind that the bindings map to the Python classes of tapesac.errors (TapeSACError, ConfigError, MemoryLimitError,
// ReplayContractError, CaptureError). Messages say what was expected, what was found, and how to fix it.
#pragma once

#include <stdexcept>
#include <string>

#include <c10/util/StringUtil.h>

namespace tapesac {

enum class ErrorKind { kGeneric, kConfig, kMemoryLimit, kReplayContract, kCapture };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace tapesac

/// User-facing check: throws tapesac::Error of `kind` (a tapesac::ErrorKind enumerator name) with the message parts.
#define TAPESAC_CHECK(cond, kind, ...)                                                \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      throw ::tapesac::Error(::tapesac::ErrorKind::kind, ::c10::str(__VA_ARGS__));    \
    }                                                                                 \
  } while (0)

/// Invariant of tapesac itself: a failure is a tapesac bug.
#define TAPESAC_INTERNAL_ASSERT(cond, ...)                                                                        \
  do {                                                                                                            \
    if (!(cond)) {                                                                                                \
      throw ::tapesac::Error(::tapesac::ErrorKind::kGeneric,                                                      \
                             ::c10::str("tapesac internal error at ", __FILE__, ":", __LINE__, ": ", #cond, ". ", \
                                        ##__VA_ARGS__, " Please report this."));                                 \
    }                                                                                                             \
  } while (0)
