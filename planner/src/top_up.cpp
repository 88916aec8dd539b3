// Keeping more than a plan that ran (top_up.h, Note [Top-up]).
#include "tapesac/planner/top_up.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "compiled.h"
#include "tapesac/common/errors.h"

namespace tapesac::planner {
namespace {

using common::ScheduleHold;
using common::ScheduleShape;

// Segment k of `s` (segment_begin not empty) spans order indices [begin, end).
int32_t segment_end(const ScheduleShape& s, int32_t k) {
  return k + 1 < s.segments() ? s.segment_begin[static_cast<size_t>(k) + 1] : static_cast<int32_t>(s.order.size());
}

// The segment of `s` that order index `i` alone makes up (-1: none, or one segment).
int32_t sole_segment(const ScheduleShape& s, int32_t i) {
  if (s.segment_begin.empty()) return -1;
  for (int32_t k = 0; k < s.segments(); ++k) {
    const int32_t begin = s.segment_begin[static_cast<size_t>(k)];
    if (begin <= i && i < segment_end(s, k)) return segment_end(s, k) - begin == 1 ? k : -1;
  }
  return -1;
}

std::vector<int32_t> hold_from_of(const ScheduleShape& s, size_t nvalues) {
  std::vector<int32_t> from(nvalues, kNeverHold);
  for (const ScheduleHold& h : s.holds) {
    if (h.value >= 0 && static_cast<size_t>(h.value) < nvalues) {
      from[static_cast<size_t>(h.value)] = std::min(from[static_cast<size_t>(h.value)], h.from);
    }
  }
  return from;
}

std::vector<std::tuple<int32_t, int32_t, int32_t>> sorted_holds(const std::vector<ScheduleHold>& holds) {
  std::vector<std::tuple<int32_t, int32_t, int32_t>> out;
  for (const ScheduleHold& h : holds) out.emplace_back(h.value, h.from, h.until);
  std::sort(out.begin(), out.end());
  return out;
}

// Every hold of `now` is a hold of `before` (same value and start) that ends no later.
bool holds_no_longer(const std::vector<ScheduleHold>& now, const std::vector<ScheduleHold>& before) {
  for (const ScheduleHold& h : now) {
    const bool covered = std::any_of(before.begin(), before.end(), [&](const ScheduleHold& b) {
      return b.value == h.value && b.from <= h.from && b.until >= h.until;
    });
    if (!covered) return false;
  }
  return true;
}

// One call as the greedy sees it.
struct CallState {
  const BlockProblem* p = nullptr;
  const UnpackOrder* unpack = nullptr;
  detail::StorageGroups groups;
  std::vector<int64_t> group_bytes;  // per group: its largest member (a storage's bytes)
  KeepMask keep;
  ScheduleShape shape;
  ScheduleChoice now;  // the model's figures of (keep, shape)
  bool eligible = false;
  std::vector<int32_t> values;
  int64_t added = 0;
  double saved = 0;
};

struct Option {
  size_t call = 0;
  size_t candidate = 0;
  int64_t bytes = 0;
  double saved_ns = 0;
  ScheduleChoice schedule;
};

class Greedy {
 public:
  Greedy(const std::vector<TopUpCall>& calls, const TopUpOptions& options) : options_(options) {
    states_.reserve(calls.size());
    for (const TopUpCall& c : calls) {
      TAPESAC_CHECK(c.problem != nullptr, kConfig, "top_up: a call without a problem");
      validate_mask(*c.problem, c.keep);
      CallState s;
      s.p = c.problem;
      s.unpack = &c.unpack;
      s.groups = detail::storage_groups(*c.problem);
      s.group_bytes.assign(static_cast<size_t>(s.groups.count), 0);
      for (size_t v = 0; v < c.problem->values.size(); ++v) {
        int64_t& b = s.group_bytes[static_cast<size_t>(s.groups.of_value[v])];
        b = std::max(b, c.problem->values[v].bytes);
      }
      s.keep = c.keep;
      s.shape = c.shape;
      s.eligible = reproduces(s);
      states_.push_back(std::move(s));
    }
  }

  TopUp run(int64_t room) {
    std::vector<std::vector<Option>> options(states_.size());
    for (size_t j = 0; j < states_.size(); ++j) options[j] = options_of(j);
    while (room >= 0) {
      const Option* best = nullptr;
      for (const auto& list : options) {
        for (const Option& o : list) {
          if (o.bytes <= room && (best == nullptr || better(o, *best))) best = &o;
        }
      }
      if (best == nullptr) break;
      const Option chosen = *best;
      CallState& s = states_[chosen.call];
      s.keep[chosen.candidate] = 1;
      s.values.push_back(s.p->candidates[chosen.candidate]);
      s.added += chosen.bytes;
      s.saved += chosen.saved_ns;
      s.now = chosen.schedule;
      s.shape = chosen.schedule;  // its ScheduleShape part
      room -= chosen.bytes;
      options[chosen.call] = options_of(chosen.call);
    }
    TopUp out;
    for (size_t j = 0; j < states_.size(); ++j) {
      CallState& s = states_[j];
      if (s.values.empty()) continue;
      out.changes.push_back(TopUpChange{j, s.keep, s.now, s.values, s.added, s.saved});
      out.added_bytes += s.added;
      out.saved_ns += s.saved;
    }
    return out;
  }

 private:
  // Free values first (most time saved), then the most time saved per byte.
  static bool better(const Option& a, const Option& b) {
    if ((a.bytes == 0) != (b.bytes == 0)) return a.bytes == 0;
    if (a.bytes == 0) return a.saved_ns > b.saved_ns;
    return a.saved_ns * static_cast<double>(b.bytes) > b.saved_ns * static_cast<double>(a.bytes);
  }

  std::optional<ScheduleChoice> evaluate(const CallState& s, const KeepMask& keep, const ScheduleShape& shape) {
    const int64_t cells = static_cast<int64_t>(std::max(1, shape.segments())) *
                          static_cast<int64_t>(s.p->values.size() + s.p->ops.size());
    if (evaluations_ >= options_.max_evaluations || cells_ + cells > options_.max_cells) return std::nullopt;
    ++evaluations_;
    cells_ += cells;
    try {
      return evaluate_schedule(*s.p, keep, *s.unpack, shape.order, shape.segment_begin,
                               hold_from_of(shape, s.p->values.size()));
    } catch (const Error&) {
      return std::nullopt;
    }
  }

  // The installed schedule lists every dropped candidate and the model reproduces its holds.
  bool reproduces(CallState& s) {
    size_t dropped = 0;
    for (uint8_t k : s.keep) dropped += k == 0;
    if (dropped == 0 || s.shape.order.size() != dropped) return false;
    const std::optional<ScheduleChoice> now = evaluate(s, s.keep, s.shape);
    if (!now || sorted_holds(now->holds) != sorted_holds(s.shape.holds)) return false;
    s.now = *now;
    return true;
  }

  // Whether keeping `v` more leaves the shape's segments starting where they did (Note [Top-up]).
  static bool keeps_segment_starts(const ScheduleShape& shape, int32_t v) {
    const auto it = std::find(shape.order.begin(), shape.order.end(), v);
    if (it == shape.order.end()) return false;
    if (shape.segments() <= 1) return true;
    const auto i = static_cast<int32_t>(it - shape.order.begin());
    for (int32_t k = 0; k < shape.segments(); ++k) {
      // The first of several: its segment would start later.
      if (i == shape.segment_begin[static_cast<size_t>(k)]) return segment_end(shape, k) - i == 1;
    }
    return true;
  }

  std::vector<Option> options_of(size_t j) {
    std::vector<Option> out;
    const CallState& s = states_[j];
    if (!s.eligible) return out;
    const BlockProblem& p = *s.p;
    // Storage groups the mask keeps resident already.
    std::vector<uint8_t> resident(static_cast<size_t>(s.groups.count), 0);
    for (size_t k = 0; k < p.candidates.size(); ++k) {
      if (s.keep[k]) resident[static_cast<size_t>(s.groups.of_value[static_cast<size_t>(p.candidates[k])])] = 1;
    }
    for (size_t k = 0; k < p.candidates.size(); ++k) {
      if (s.keep[k] || p.must_keep[k]) continue;
      const int32_t v = p.candidates[k];
      const auto g = static_cast<size_t>(s.groups.of_value[static_cast<size_t>(v)]);
      if (s.groups.external[g] || !keeps_segment_starts(s.shape, v)) continue;
      KeepMask keep = s.keep;
      keep[k] = 1;
      const ScheduleShape shape = without_value(s.shape, v);
      const std::optional<ScheduleChoice> c = evaluate(s, keep, shape);
      if (!c) continue;
      const double saved = s.now.replay_cost_ns - c->replay_cost_ns;
      if (saved <= 0 || c->working_set_bytes > s.now.working_set_bytes || !holds_no_longer(c->holds, shape.holds)) {
        continue;
      }
      out.push_back(Option{j, k, resident[g] ? 0 : s.group_bytes[g], saved, *c});
    }
    return out;
  }

  TopUpOptions options_;
  std::vector<CallState> states_;
  int64_t evaluations_ = 0;
  int64_t cells_ = 0;
};

}  // namespace

ScheduleShape without_value(const ScheduleShape& shape, int32_t v) {
  const auto it = std::find(shape.order.begin(), shape.order.end(), v);
  if (it == shape.order.end()) return shape;
  const auto i = static_cast<int32_t>(it - shape.order.begin());
  ScheduleShape out;
  out.order = shape.order;
  out.order.erase(out.order.begin() + i);
  const int32_t removed = sole_segment(shape, i);
  for (int32_t k = 0; k < shape.segments() && !shape.segment_begin.empty() && !out.order.empty(); ++k) {
    const int32_t begin = shape.segment_begin[static_cast<size_t>(k)];
    if (k != removed) out.segment_begin.push_back(begin > i ? begin - 1 : begin);
  }
  for (const ScheduleHold& h : shape.holds) {
    if (h.value == v) continue;
    ScheduleHold kept = h;
    if (removed >= 0) {
      kept.from -= kept.from > removed ? 1 : 0;
      kept.until -= kept.until >= removed ? 1 : 0;
    }
    if (kept.until > kept.from) out.holds.push_back(kept);
  }
  return out;
}

TopUp top_up(const std::vector<TopUpCall>& calls, int64_t room_bytes, const TopUpOptions& options) {
  if (room_bytes < 0 || calls.empty()) return TopUp{};
  return Greedy(calls, options).run(room_bytes);
}

}  // namespace tapesac::planner
