// A block call's replay schedule (Note [Replay schedule] in schedule.h): which schedule the call follows, what one
// segment's replay reads and returns, the values held between segments, and the unpack order the call observed.
#include <algorithm>
#include <unordered_set>

#include "tapesac/capture/tensor_identity.h"
#include "tapesac/replay/block_call.h"

namespace tapesac::replay {

std::vector<ValueId> BlockCall::default_order() const {
  if (ctx_.orders != nullptr) {
    const auto it = ctx_.orders->find(signature_);
    if (it != ctx_.orders->end()) return it->second.values;
  }
  std::vector<ValueId> saved;
  saved.reserve(slots_.size());
  for (const Slot& s : slots_) saved.push_back(s.dropped ? s.value : -1);
  return guessed_order(saved);
}

ReplaySchedule BlockCall::default_schedule(const std::vector<Read>& targets) const {
  const Tape& tape = recorder_.tape();
  const size_t nvalues = tape.values().size();
  // The observed (or guessed) order, restricted to this call's dropped values; those it misses go last.
  std::vector<int32_t> state(nvalues, -1);
  for (const Read& r : targets) state[static_cast<size_t>(r.value)] = r.state;
  std::vector<ValueId> order;
  std::vector<uint8_t> listed(nvalues, 0);
  for (ValueId v : default_order()) {
    if (v < 0 || static_cast<size_t>(v) >= nvalues || state[static_cast<size_t>(v)] < 0) continue;
    if (listed[static_cast<size_t>(v)]) continue;
    listed[static_cast<size_t>(v)] = 1;
    order.push_back(v);
  }
  for (const Read& r : targets) {
    if (!listed[static_cast<size_t>(r.value)]) order.push_back(r.value);
  }
  // Without a plan or a forced shape: the session's unplanned shape (one segment: every dropped value replayed at the
  // first unpack; or lazy, under a limit until a plan exists).
  ForcedSchedule shape = options_.forced_schedule;
  if (shape == ForcedSchedule::kNone) shape = options_.unplanned_schedule;
  if (shape == ForcedSchedule::kNone) shape = ForcedSchedule::kOneSegment;
  if (shape == ForcedSchedule::kOneSegment) return one_segment(std::move(order));
  ReplaySchedule s = per_value_segments(std::move(order));
  if (shape == ForcedSchedule::kHoldAll) s.holds = hold_everything(tape, s, state, available_);
  return s;
}

void BlockCall::resolve_schedule(const std::vector<Read>& targets) {
  const size_t nvalues = recorder_.tape().values().size();
  schedule_ = ReplaySchedule{};
  if (!targets.empty() && !approx_) {  // approximate replays keep the single replay
    const BlockPlan* plan = nullptr;
    if (ctx_.plans != nullptr && options_.forced_schedule == ForcedSchedule::kNone) {
      const auto it = ctx_.plans->find(ctx_.plan_key);
      if (it != ctx_.plans->end() && it->second.signature == signature_ && !it->second.schedule.order.empty()) {
        plan = &it->second;
      }
    }
    if (plan != nullptr) {
      schedule_ = plan->schedule;
      closed_stats_.planned_ws_bytes = plan->schedule_ws_bytes;
      // Policy kPlan says whether its keep mask applied (decide()); the other policies plan only schedules.
      if (options_.policy != PolicyKind::kPlan) closed_stats_.planned = true;
    } else {
      schedule_ = default_schedule(targets);
    }
  }
  segment_of_ = segment_index(schedule_, nvalues);
  hold_until_ = hold_index(schedule_, nvalues, &hold_from_);
  segment_done_.assign(static_cast<size_t>(std::max(1, schedule_.segments())), 0);
  unpacked_.assign(nvalues, 0);
  dies_before_.assign(nvalues, -1);
  closed_stats_.segments = schedule_.segments();
}

int32_t BlockCall::segment_of(ValueId v) const {
  return v >= 0 && static_cast<size_t>(v) < segment_of_.size() ? segment_of_[static_cast<size_t>(v)] : -1;
}

BlockCall::SegmentInputs BlockCall::segment_inputs(ValueId wanted) {
  const Tape& tape = recorder_.tape();
  SegmentInputs in;
  in.segment = segment_of(wanted);
  // Note [Targets alive elsewhere]: a dropped value whose saved tensor is still alive (the block's output, which the
  // next block holds; an activation the user stored) is served as it is at its unpack (Note [a dropped tensor still
  // alive]), so a rebuilt copy would only be held beside it until then: random program 1672, a 192-byte value of
  // the second block held twice through most of its backward, where keeping everything holds it once. It is not
  // rebuilt; if it dies before its unpack, that unpack replays it.
  std::unordered_set<ValueId> alive;
  for (const Slot& s : slots_) {
    if (!s.dropped || s.released || s.value < 0 || s.value == wanted) continue;
    if (still_alive(s).defined()) alive.insert(s.value);
  }
  for (ValueId value : dropped_values_) {  // ascending
    if (remaining_[static_cast<size_t>(value)] > 0 && !cache_.count(value) && segment_of(value) == in.segment &&
        !alive.count(value)) {
      in.targets.push_back(Read{value, value_state_[static_cast<size_t>(value)]});
    }
  }
  // Beyond available_, the replay reads live what is held and the rebuilt values still waiting for their unpacks
  // (at their storage's final state only: Note [Replay schedule]).
  in.available = available_;
  in.available.resize(tape.values().size(), 0);
  auto add = [&](ValueId v, const at::Tensor& t) {
    if (in.available[static_cast<size_t>(v)] || !t.defined()) return;
    if (in.live.empty()) in.live = live_;
    in.available[static_cast<size_t>(v)] = 1;
    in.live[static_cast<size_t>(v)] = t;
  };
  for (const auto& [value, tensor] : held_) add(value, tensor);
  for (const auto& [value, tensor] : cache_) {
    if (holdable(tape, value) && saved_state(value) == tape.value(value).state) add(value, tensor);
  }
  SegmentReplay sr = plan_segment(tape, in.targets, in.available, hold_from_, hold_until_, in.segment);
  in.plan = std::move(sr.plan);
  in.extras = std::move(sr.extras);
  return in;
}

void BlockCall::note_unpack(ValueId v) {
  if (static_cast<size_t>(v) >= unpacked_.size() || unpacked_[static_cast<size_t>(v)]) return;
  unpacked_[static_cast<size_t>(v)] = 1;
  unpack_order_.push_back(v);
  // Backward has reached this value's segment: what was held for earlier segments is no longer needed.
  const int32_t s = segment_of(v);
  if (s > 0) release_holds(s);
}

void BlockCall::finish_segment(int32_t segment) {
  if (segment >= 0 && static_cast<size_t>(segment) < segment_done_.size()) {
    segment_done_[static_cast<size_t>(segment)] = 1;
  }
  release_holds(-1);
  closed_stats_.held_bytes = std::max(closed_stats_.held_bytes, block_held_bytes(true, segment));
}

void BlockCall::release_holds(int32_t before) {
  for (auto it = held_.begin(); it != held_.end();) {
    const int32_t until = hold_until_[static_cast<size_t>(it->first)];
    const bool done = until < 0 || until < before ||
                      (static_cast<size_t>(until) < segment_done_.size() && segment_done_[static_cast<size_t>(until)]);
    it = done ? held_.erase(it) : std::next(it);
  }
}

void BlockCall::restart_schedule() {
  held_.clear();
  std::fill(segment_done_.begin(), segment_done_.end(), 0);
}

void BlockCall::drop_cached(ValueId v) {
  auto it = cache_.find(v);
  if (it == cache_.end()) return;
  const int32_t until = static_cast<size_t>(v) < hold_until_.size() ? hold_until_[static_cast<size_t>(v)] : -1;
  const int32_t from = static_cast<size_t>(v) < hold_from_.size() ? hold_from_[static_cast<size_t>(v)] : 0;
  const bool wanted_later = until > segment_of(v) && from <= segment_of(v) &&
                            static_cast<size_t>(until) < segment_done_.size() &&
                            !segment_done_[static_cast<size_t>(until)];
  if (wanted_later) held_[v] = std::move(it->second);
  cache_.erase(it);
}

void BlockCall::note_last_unpack(ValueId v) {
  if (static_cast<size_t>(v) < dies_before_.size() && dies_before_[static_cast<size_t>(v)] < 0) {
    dies_before_[static_cast<size_t>(v)] = static_cast<int32_t>(unpack_order_.size());
  }
  drop_cached(v);
}

int64_t BlockCall::block_held_bytes(bool later_only, int32_t segment) const {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  auto count = [&](const at::Tensor& t) {
    if (t.defined() && t.has_storage() && seen.insert(capture::storage_key(t)).second) bytes += capture::storage_bytes(t);
  };
  for (const auto& [value, tensor] : held_) count(tensor);
  for (const auto& [value, tensor] : cache_) {
    if (!later_only || segment_of(value) > segment) count(tensor);
  }
  return bytes;
}

int64_t BlockCall::fit_extras(SegmentInputs& in, int64_t in_use, int64_t limit) {
  // Greedy: the extras whose rebuild from what the call holds costs the most per byte are held first, while the
  // replay still fits; the others are recomputed by the segment that needs them.
  const Tape& tape = recorder_.tape();
  struct Candidate {
    ValueId value;
    double per_byte;
  };
  std::vector<Candidate> candidates;
  for (ValueId v : in.extras) {
    const PruneResult p = prune(tape, {Read{v, tape.value(v).state}}, available_);
    double ns = 0;
    for (OpIndex i : p.ops) ns += static_cast<double>(tape.op(i).duration_ns);
    const int64_t bytes = std::max<int64_t>(1, tape.storage(tape.value(v).storage).nbytes);
    candidates.push_back(Candidate{v, ns / static_cast<double>(bytes)});
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.per_byte > b.per_byte; });
  std::vector<Read> pinned = in.targets;
  in.extras.clear();
  int64_t ws = predict_working_set(tape, in.plan, pinned);
  for (const Candidate& c : candidates) {
    pinned.push_back(Read{c.value, tape.value(c.value).state});
    const int64_t with = predict_working_set(tape, in.plan, pinned);
    if (in_use + with > limit) {
      pinned.pop_back();
      continue;
    }
    in.extras.push_back(c.value);
    ws = with;
  }
  return ws;
}

UnpackObservation BlockCall::observed_order() const {
  std::lock_guard<std::mutex> lock(mu_);
  UnpackObservation out;
  if (unpack_order_.empty()) return out;
  out.values = unpack_order_;
  std::vector<uint8_t> seen(unpacked_);
  for (ValueId v : schedule_.order) {
    if (static_cast<size_t>(v) < seen.size() && !seen[static_cast<size_t>(v)] && dropped(v)) {
      seen[static_cast<size_t>(v)] = 1;
      out.values.push_back(v);
    }
  }
  const auto n = static_cast<int32_t>(out.values.size());
  for (ValueId v : out.values) {
    const int32_t d = static_cast<size_t>(v) < dies_before_.size() ? dies_before_[static_cast<size_t>(v)] : -1;
    out.dies_before.push_back(d < 0 ? n : d);
  }
  return out;
}

}  // namespace tapesac::replay
