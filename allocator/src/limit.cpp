// Replay limit arithmetic and arena accounting (see limit.h).
#include "tapesac/allocator/limit.h"

#include "tapesac/common/bytes.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace tapesac::allocator {

using common::format_bytes;

LimitDecision decide(int64_t limit, int64_t in_use, int64_t whole_need, int64_t piece_need) noexcept {
  LimitDecision d;
  d.limit = limit;
  d.in_use = in_use;
  piece_need = std::min(piece_need, whole_need);
  if (limit <= 0) {
    d.need = whole_need;
    return d;
  }
  d.headroom = limit - in_use;
  if (whole_need <= d.headroom) {
    d.need = whole_need;
  } else if (piece_need <= d.headroom) {
    d.verdict = LimitVerdict::kPieces;
    d.need = piece_need;
  } else {
    d.verdict = LimitVerdict::kReject;
    d.need = piece_need;
  }
  return d;
}

std::string rejection_message(const LimitDecision& d, const std::string& block, const std::string& phase) {
  return "tapesac: memory_limit " + format_bytes(d.limit) + " (" + std::to_string(d.limit) + " bytes) cannot be met in " +
         phase + " of block '" + block + "': " + format_bytes(d.in_use) + " are in use and the smallest replay needs " +
         format_bytes(d.need) + " more (" + std::to_string(d.in_use + d.need) + " bytes in all; headroom " +
         format_bytes(d.headroom) + "). Raise memory_limit to at least " + std::to_string(d.in_use + d.need) +
         " bytes (a lower bound: what this replay needs at this moment; the backward's own allocations and the "
         "other blocks' replays come on top, and a new limit is planned afresh), use a policy that keeps more "
         "(e.g. policy='none'), or lower the batch size.";
}

void ArenaAccounting::on_replay(const std::string& block, int64_t working_set) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  ++replays_;
  shared_ = std::max(shared_, working_set);
  try {
    int64_t& b = per_block_[block];
    b = std::max(b, working_set);
  } catch (...) {
    // Out of memory for the map entry: the per-block figure misses this replay; the shared size is exact.
  }
}

int64_t ArenaAccounting::shared_bytes() const noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  return shared_;
}

int64_t ArenaAccounting::separate_bytes() const noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t sum = 0;
  for (const auto& [name, bytes] : per_block_) sum += bytes;
  return sum;
}

int64_t ArenaAccounting::replays() const noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  return replays_;
}

void ArenaAccounting::reset() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  per_block_.clear();
  shared_ = 0;
  replays_ = 0;
}

}  // namespace tapesac::allocator
