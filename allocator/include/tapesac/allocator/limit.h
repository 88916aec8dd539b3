// Limit enforcement during replay and the accounting of the replay arena: the arithmetic only, independent of the
// device, so that it is unit-tested on CPU. The session supplies the numbers (bytes in use now, the predicted
// working set of a whole replay and of its smallest piece); the CUDA arena (capture/cuda, arena.h) and the
// counting CPU allocator (telemetry.h) supply the measurements.
//
// Contract.
//  * decide(): with no limit (limit <= 0) every replay runs whole. Otherwise a replay runs whole when
//    in_use + whole <= limit, in pieces when only in_use + piece <= limit, and is rejected otherwise. A piece can
//    never need more than the whole (callers pass min(piece, whole)).
//  * ArenaAccounting: all blocks' replays share one pool, so the arena's size is the largest working set of one
//    replay, while one pool per block would cost the sum of each block's largest working set. Both are reported.
//    Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace tapesac::allocator {

enum class LimitVerdict : uint8_t { kWhole, kPieces, kReject };

struct LimitDecision {
  LimitVerdict verdict = LimitVerdict::kWhole;
  int64_t limit = 0;     // bytes; <= 0: no limit
  int64_t in_use = 0;    // bytes in use when the replay was asked for
  int64_t headroom = 0;  // limit - in_use (may be negative); 0 without a limit
  int64_t need = 0;      // bytes the chosen (or, when rejected, the smallest) replay needs
};

LimitDecision decide(int64_t limit, int64_t in_use, int64_t whole_need, int64_t piece_need) noexcept;

/// The message of a rejected replay: the limit, the need, the headroom, the block and the phase, and what to do.
std::string rejection_message(const LimitDecision& d, const std::string& block, const std::string& phase);

class ArenaAccounting {
 public:
  void on_replay(const std::string& block, int64_t working_set) noexcept;
  /// Size of one pool shared by every replay: the largest working set seen.
  int64_t shared_bytes() const noexcept;
  /// What one pool per block would hold: the sum over blocks of each block's largest working set.
  int64_t separate_bytes() const noexcept;
  int64_t replays() const noexcept;
  void reset() noexcept;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, int64_t> per_block_;
  int64_t shared_ = 0;
  int64_t replays_ = 0;
};

}  // namespace tapesac::allocator
