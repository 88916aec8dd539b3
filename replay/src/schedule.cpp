// The replay schedule (see schedule.h, Note [Replay schedule]).
#include "tapesac/replay/schedule.h"

#include <algorithm>

#include "tapesac/common/errors.h"

namespace tapesac::replay {

ForcedSchedule parse_forced_schedule(const std::string& name) {
  if (name == "none") return ForcedSchedule::kNone;
  if (name == "one_segment") return ForcedSchedule::kOneSegment;
  if (name == "hold_all") return ForcedSchedule::kHoldAll;
  if (name == "lazy") return ForcedSchedule::kLazy;
  TAPESAC_CHECK(false, kConfig, "forced schedule must be 'none', 'one_segment', 'hold_all' or 'lazy', got '", name,
                "'");
  return ForcedSchedule::kNone;
}

std::vector<ValueId> guessed_order(const std::vector<ValueId>& saved) {
  std::vector<ValueId> order;
  std::vector<uint8_t> seen;
  for (size_t i = saved.size(); i-- > 0;) {
    const ValueId v = saved[i];
    if (v < 0) continue;
    if (seen.size() <= static_cast<size_t>(v)) seen.resize(static_cast<size_t>(v) + 1, 0);
    if (seen[static_cast<size_t>(v)]) continue;
    seen[static_cast<size_t>(v)] = 1;
    order.push_back(v);
  }
  return order;
}

ReplaySchedule one_segment(std::vector<ValueId> order) {
  ReplaySchedule s;
  s.order = std::move(order);
  return s;
}

ReplaySchedule per_value_segments(std::vector<ValueId> order) {
  ReplaySchedule s;
  s.order = std::move(order);
  for (size_t i = 0; i < s.order.size(); ++i) s.segment_begin.push_back(static_cast<int32_t>(i));
  return s;
}

std::vector<int32_t> segment_index(const ReplaySchedule& s, size_t nvalues) {
  std::vector<int32_t> index(nvalues, -1);
  const int32_t n = s.segments();
  for (int32_t k = 0; k < n; ++k) {
    for (ValueId v : s.segment(k)) {
      if (v >= 0 && static_cast<size_t>(v) < nvalues && index[static_cast<size_t>(v)] < 0) {
        index[static_cast<size_t>(v)] = k;
      }
    }
  }
  return index;
}

std::vector<int32_t> hold_index(const ReplaySchedule& s, size_t nvalues, std::vector<int32_t>* from) {
  std::vector<int32_t> index(nvalues, -1);
  if (from != nullptr) from->assign(nvalues, 0);
  for (const ScheduleHold& h : s.holds) {
    if (h.value < 0 || static_cast<size_t>(h.value) >= nvalues) continue;
    index[static_cast<size_t>(h.value)] = std::max(index[static_cast<size_t>(h.value)], h.until);
    if (from != nullptr) (*from)[static_cast<size_t>(h.value)] = h.from;
  }
  return index;
}

bool holdable(const Tape& tape, ValueId v) {
  if (v < 0 || static_cast<size_t>(v) >= tape.values().size()) return false;
  const capture::ValueInfo& info = tape.value(v);
  if (info.producer == capture::kExternal) return false;
  const capture::StorageInfo& st = tape.storage(info.storage);
  return !st.external && info.state == st.final_state();
}

std::vector<ScheduleHold> hold_everything(const Tape& tape, const ReplaySchedule& s, const std::vector<int32_t>& state,
                                          const std::vector<uint8_t>& available) {
  const size_t nvalues = tape.values().size();
  std::vector<uint8_t> avail = available;
  avail.resize(nvalues, 0);
  std::vector<int32_t> produced_in(nvalues, -1), until(nvalues, -1);
  const int32_t n = s.segments();
  for (int32_t k = 0; k < n; ++k) {
    std::vector<Read> targets;
    for (ValueId v : s.segment(k)) {
      const Read r{v, state.at(static_cast<size_t>(v))};
      if (produced_in[static_cast<size_t>(v)] >= 0 &&
          classify_read(tape, avail, v, r.state, false) == ReadSource::kLive) {
        until[static_cast<size_t>(v)] = k;  // an earlier replay rebuilt it: it waits for this segment
        continue;
      }
      targets.push_back(r);
    }
    const PruneResult plan = prune(tape, targets, avail);
    if (!plan.ok) continue;  // BlockCall reports it when it replays; nothing to hold for it
    for (OpIndex i : plan.ops) {
      for (const capture::ArgRef& a : tape.op(i).inputs) {
        const auto v = static_cast<size_t>(a.value);
        if (produced_in[v] >= 0 && classify_read(tape, avail, a.value, a.state, a.meta_only) == ReadSource::kLive) {
          until[v] = k;
        }
      }
    }
    for (OpIndex i : plan.ops) {
      for (ValueId v : tape.op(i).outputs) {
        if (v < 0 || !holdable(tape, v) || avail[static_cast<size_t>(v)]) continue;
        avail[static_cast<size_t>(v)] = 1;
        produced_in[static_cast<size_t>(v)] = k;
      }
    }
  }
  std::vector<ScheduleHold> holds;
  for (size_t v = 0; v < nvalues; ++v) {
    if (until[v] > produced_in[v]) holds.push_back(ScheduleHold{static_cast<ValueId>(v), 0, until[v]});
  }
  return holds;
}

SegmentReplay plan_segment(const Tape& tape, const std::vector<Read>& targets, const std::vector<uint8_t>& available,
                           const std::vector<int32_t>& hold_from, const std::vector<int32_t>& hold_until,
                           int32_t segment) {
  SegmentReplay out;
  out.plan = prune(tape, targets, available);
  if (!out.plan.ok) return out;
  for (OpIndex i : out.plan.ops) {
    for (ValueId v : tape.op(i).outputs) {
      if (v < 0 || static_cast<size_t>(v) >= hold_until.size() || hold_until[static_cast<size_t>(v)] <= segment) {
        continue;
      }
      if (static_cast<size_t>(v) < hold_from.size() && hold_from[static_cast<size_t>(v)] > segment) continue;
      const bool avail = static_cast<size_t>(v) < available.size() && available[static_cast<size_t>(v)] != 0;
      if (!avail && holdable(tape, v)) out.extras.push_back(v);
    }
  }
  return out;
}

}  // namespace tapesac::replay
