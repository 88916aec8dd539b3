// The shape of a block call's replay schedule, the one type that replay (which follows a schedule,
// replay/schedule.h: Note [Replay schedule]) and the planner (which chooses one, planner/schedule.h: Note [Schedule
// model]) share, and how a backward used the dropped values (what the replay side observes and the planner reads).
// Plain data, torch-free; value ids are a block tape's (capture::ValueId). Here because neither replay nor planner
// may depend on the other (capture <- replay, capture <- planner), and capture owns the tape, not schedules.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace tapesac::common {

/// A value that the replay of a segment in [from, until) keeps alive, when it produces it, until segment `until` has
/// replayed. A replay before `from` frees it: the first later segment that needs it recomputes it.
struct ScheduleHold {
  int32_t value = -1;
  int32_t from = 0;
  int32_t until = 0;
};

/// The dropped values of a block call in the order their segments replay (the expected first-unpack order), split
/// into segments, and the holds.
struct ScheduleShape {
  std::vector<int32_t> order;
  /// Index into `order` of each segment's first value, ascending, starting at 0; empty: one segment.
  std::vector<int32_t> segment_begin;
  std::vector<ScheduleHold> holds;

  /// Segments: 0 when `order` is empty, 1 when segment_begin is.
  int32_t segments() const {
    if (order.empty()) return 0;
    return segment_begin.empty() ? 1 : static_cast<int32_t>(segment_begin.size());
  }
  /// The values of segment `s`, in order (empty when there is no such segment).
  std::vector<int32_t> segment(int32_t s) const {
    const int32_t n = segments();
    if (s < 0 || s >= n) return {};
    if (segment_begin.empty()) return order;
    const auto begin = static_cast<size_t>(segment_begin[static_cast<size_t>(s)]);
    const size_t end = s + 1 < n ? static_cast<size_t>(segment_begin[static_cast<size_t>(s) + 1]) : order.size();
    return std::vector<int32_t>(order.begin() + static_cast<std::ptrdiff_t>(begin),
                                order.begin() + static_cast<std::ptrdiff_t>(std::max(begin, end)));
  }
};

/// How one block call's backward used its dropped values: the order of their first unpacks, and when each was last
/// unpacked.
struct UnpackObservation {
  /// Value ids in the order of their first unpack (those never unpacked last).
  std::vector<int32_t> values;
  /// Per entry: the index into `values` of the first value first-unpacked after this one's last unpack (how many
  /// first unpacks had happened when it was last unpacked); values.size() or more: alive to the end of the block's
  /// backward. Empty: every value lives to the end.
  std::vector<int32_t> dies_before;
};

}  // namespace tapesac::common
