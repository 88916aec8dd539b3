// The sequence peak model and step profiles (peak_model.h).
#include "tapesac/planner/peak_model.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "tapesac/common/errors.h"

namespace tapesac::planner {
namespace {

constexpr int64_t kNone = std::numeric_limits<int64_t>::min();

// Window boundaries in time order; the peak of the timeline's points in each [begin_k, begin_{k+1}) (the last to
// `end`); a window without a point gets the bytes in use at its start (the last point before it).
std::vector<int64_t> window_peaks(const std::vector<TimedBytes>& timeline, const std::vector<int64_t>& begin,
                                  int64_t end, int64_t offset) {
  const size_t n = begin.size();
  std::vector<int64_t> peaks(n, kNone);
  for (size_t k = 0; k < n; ++k) {
    const int64_t hi = k + 1 < n ? begin[k + 1] : end;
    int64_t before = kNone;
    for (const TimedBytes& pt : timeline) {
      if (pt.t_ns < begin[k]) {
        before = pt.bytes + offset;
      } else if (pt.t_ns < hi) {
        peaks[k] = std::max(peaks[k], pt.bytes + offset);
      }
    }
    if (peaks[k] == kNone) peaks[k] = before;
  }
  return peaks;
}

// Per window as in window_peaks: the reduced levels of its points (the last point before it when it has none).
std::vector<std::vector<RestLevel>> window_levels(const std::vector<TimedBytes>& timeline,
                                                  const std::vector<int64_t>& begin, int64_t end, int64_t offset) {
  const size_t n = begin.size();
  std::vector<std::vector<RestLevel>> out(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t hi = k + 1 < n ? begin[k + 1] : end;
    const TimedBytes* before = nullptr;
    std::vector<RestLevel> levels;
    for (const TimedBytes& pt : timeline) {
      if (pt.t_ns < begin[k]) {
        before = &pt;
      } else if (pt.t_ns < hi) {
        levels.push_back(RestLevel{pt.bytes - pt.replay_bytes + offset, pt.replay_bytes});
      }
    }
    if (levels.empty() && before != nullptr) {
      levels.push_back(RestLevel{before->bytes - before->replay_bytes + offset, before->replay_bytes});
    }
    out[k] = reduce_levels(std::move(levels));
  }
  return out;
}

}  // namespace

std::vector<RestLevel> reduce_levels(std::vector<RestLevel> levels, size_t max_levels) {
  std::sort(levels.begin(), levels.end(), [](const RestLevel& a, const RestLevel& b) {
    return a.rest != b.rest ? a.rest > b.rest : a.replay > b.replay;
  });
  std::vector<RestLevel> out;
  for (const RestLevel& l : levels) {
    if (out.empty() || l.rest + l.replay > out.back().rest + out.back().replay) out.push_back(l);
  }
  max_levels = std::max<size_t>(max_levels, 1);
  while (out.size() > max_levels) {
    // Rest descending, rest + replay ascending: a pair merges into its first's rest and its second's total.
    size_t w = 0;
    for (size_t i = 0; i < out.size(); i += 2) {
      if (i + 1 == out.size()) {
        out[w++] = out[i];
        break;
      }
      out[w++] = RestLevel{out[i].rest, out[i + 1].rest + out[i + 1].replay - out[i].rest};
    }
    out.resize(w);
  }
  return out;
}

int64_t keep_all_ceiling(const std::vector<TimedBytes>& timeline, const std::vector<int64_t>& forward_end_ns,
                         const std::vector<int64_t>& release_ns, const std::vector<int64_t>& dropped_bytes,
                         int64_t offset, const std::vector<int64_t>& held_bytes,
                         const std::vector<HeldToEnd>& held_to_end, const std::vector<CallAlive>* alive) {
  const size_t n = forward_end_ns.size();
  if (timeline.empty() || release_ns.size() != n || dropped_bytes.size() != n ||
      (!held_bytes.empty() && held_bytes.size() != n)) {
    return std::numeric_limits<int64_t>::max();
  }
  std::vector<CallAlive> changes;
  if (alive != nullptr) {
    changes = *alive;
    std::stable_sort(changes.begin(), changes.end(),
                     [](const CallAlive& a, const CallAlive& b) { return a.t_ns < b.t_ns; });
  }
  std::vector<int64_t> alive_of(n, 0);  // per call, its dropped bytes the step held at the point
  int64_t alive_unknown = 0;
  size_t next_change = 0;
  int64_t ceiling = std::numeric_limits<int64_t>::min();
  for (const TimedBytes& pt : timeline) {
    for (; next_change < changes.size() && changes[next_change].t_ns <= pt.t_ns; ++next_change) {
      const CallAlive& c = changes[next_change];
      (c.call >= 0 && static_cast<size_t>(c.call) < n ? alive_of[static_cast<size_t>(c.call)] : alive_unknown) +=
          c.bytes;
    }
    int64_t counted_alive = alive != nullptr ? alive_unknown : pt.dropped_alive;
    int64_t pending = 0;
    int64_t rebuilt = 0;  // dropped bytes of the calls whose last replay has begun: the most of them still alive
    for (size_t k = 0; k < n; ++k) {
      const bool released = release_ns[k] >= 0 && pt.t_ns >= release_ns[k];
      if (released) {
        rebuilt += dropped_bytes[k];
      } else {
        if (pt.t_ns >= forward_end_ns[k]) pending += dropped_bytes[k];
        if (alive != nullptr) counted_alive += alive_of[k];
      }
      // Held for the replays from the forward's end to the step's (the call releases its inputs at the step end).
      if (pt.t_ns >= forward_end_ns[k] && !held_bytes.empty()) pending -= held_bytes[k];
    }
    for (const HeldToEnd& h : held_to_end) {
      if (pt.t_ns >= h.t_ns) pending -= h.bytes;
    }
    ceiling = std::max(ceiling, pt.bytes - pt.replay_bytes + std::min(pt.replay_bytes, rebuilt) - counted_alive +
                                    offset + pending);
  }
  return ceiling;
}

StepProfile profile_step(const std::vector<TimedBytes>& timeline, const std::vector<int64_t>& forward_begin_ns,
                         const std::vector<int64_t>& forward_end_ns, const std::vector<int64_t>& replay_start_ns,
                         int64_t offset, int64_t end_ns) {
  StepProfile p;
  const size_t n = replay_start_ns.size();
  if (n == 0 || timeline.empty() || forward_begin_ns.size() != n || forward_end_ns.size() != n) return p;
  for (size_t k = 0; k < n; ++k) {
    if (replay_start_ns[k] < 0 || forward_begin_ns[k] < 0 || forward_end_ns[k] < forward_begin_ns[k]) return p;
    if (k > 0 && forward_begin_ns[k] < forward_end_ns[k - 1]) return p;  // forwards must not overlap
  }
  // Backward windows in time order: the backward reaches the calls from the last to the first, but pieces, hooks
  // or re-entrant backwards may reorder them.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return replay_start_ns[a] < replay_start_ns[b]; });
  const int64_t first_replay = replay_start_ns[order[0]];
  if (first_replay < forward_end_ns[n - 1]) return p;  // a replay during the forward: no clean windows
  const int64_t end = end_ns;

  std::vector<int64_t> fwd_begin = forward_begin_ns;
  fwd_begin.push_back(forward_end_ns[n - 1]);  // the tail window
  std::vector<int64_t> fwd = window_peaks(timeline, fwd_begin, first_replay, offset);
  p.tail_peak = fwd.back();
  fwd.pop_back();
  p.forward_peaks = std::move(fwd);
  p.pre_peak = window_peaks(timeline, {std::numeric_limits<int64_t>::min()}, forward_begin_ns[0], offset)[0];

  std::vector<int64_t> starts;
  for (size_t k : order) starts.push_back(replay_start_ns[k]);
  const std::vector<int64_t> bwd = window_peaks(timeline, starts, end, offset);
  std::vector<std::vector<RestLevel>> levels = window_levels(timeline, starts, end, offset);
  p.backward_peaks.assign(n, kNone);
  p.backward_levels.resize(n);
  for (size_t k = 0; k < n; ++k) {
    p.backward_peaks[order[k]] = bwd[k];
    p.backward_levels[order[k]] = std::move(levels[k]);
  }

  auto known = [](int64_t v) { return v != kNone; };
  if (!known(p.tail_peak) || !std::all_of(p.forward_peaks.begin(), p.forward_peaks.end(), known) ||
      !std::all_of(p.backward_peaks.begin(), p.backward_peaks.end(), known)) {
    return p;
  }
  if (!known(p.pre_peak)) p.pre_peak = offset;
  p.valid = true;
  return p;
}

namespace {

// What call k holds for its replay after the forward when it keeps `kept` bytes.
int64_t held(const std::vector<int64_t>& held_for_replay, const std::vector<int64_t>& keep_all, size_t k,
             int64_t kept) {
  if (k >= held_for_replay.size() || k >= keep_all.size()) return 0;
  return kept < keep_all[k] ? held_for_replay[k] : 0;
}

// v[k], or 0 past its end (a figure not measured).
int64_t at_or_zero(const std::vector<int64_t>& v, size_t k) { return k < v.size() ? v[k] : 0; }

// The levels of the backward windows (Note [Window of a call keeping more]; with a retained graph Note [Backward
// levels]), relative to what the plan that ran (`kept_ref`) kept and held.
void calibrate_levels(SequencePeakModel& m, const StepProfile& profile, const std::vector<int64_t>& kept_ref,
                      const StepExtras& extras) {
  const size_t n = profile.backward_peaks.size();
  int64_t all_ref = 0;  // every call's kept and held bytes in the plan that ran
  for (size_t k = 0; k < n; ++k) all_ref += kept_ref[k] + held(m.held_for_replay, m.keep_all, k, kept_ref[k]);
  if (!extras.retained && profile.backward_levels.size() == n) {
    // Note [Window of a call keeping more]: rest less what the plan that ran kept before the call, held up to it,
    // and the dropped values alive anyway before it (as backward_c).
    m.kept_ref = kept_ref;
    m.alive_ref.resize(n);
    m.window_levels.resize(n);
    int64_t before = 0, held_up_to = 0;
    for (size_t k = 0; k < n; ++k) {
      m.alive_ref[k] = at_or_zero(extras.alive_backward, k);
      held_up_to += held(m.held_for_replay, m.keep_all, k, kept_ref[k]);
      for (const RestLevel& l : profile.backward_levels[k]) {
        m.window_levels[k].push_back(RestLevel{l.rest - before - held_up_to, l.replay});
      }
      before += kept_ref[k] + m.alive_ref[k];
    }
    m.window_all_ref = all_ref;
  }
  if (extras.retained && profile.backward_levels.size() == n) {  // Note [Backward levels]
    // Rebuilt values a later graph held are replay bytes on the timeline, not kept ones.
    m.levels_all_ref = all_ref;
    m.backward_levels.resize(n);
    int64_t alive = 0;  // dropped values alive anyway (not replay bytes), calls up to k: as backward_c
    for (size_t k = 0; k < n; ++k) {
      alive += at_or_zero(extras.alive_backward, k);
      for (const RestLevel& l : profile.backward_levels[k]) {
        m.backward_levels[k].push_back(RestLevel{l.rest - all_ref - alive, l.replay});
      }
    }
  }
}

}  // namespace

int64_t SequencePeakModel::predict(const std::vector<int64_t>& kept, const std::vector<int64_t>& ws) const {
  TAPESAC_CHECK(valid && kept.size() == backward_c.size() && ws.size() == backward_c.size(), kConfig,
                "SequencePeakModel::predict: expected ", backward_c.size(), " calls (a calibrated model), got ",
                kept.size(), " kept and ", ws.size(), " working sets");
  int64_t all = 0;  // every call's kept bytes and what it holds for its replay
  for (size_t k = 0; k < kept.size(); ++k) all += kept[k] + held(held_for_replay, keep_all, k, kept[k]);
  int64_t peak = pre;
  int64_t prefix = 0;  // kept bytes of the calls before k
  int64_t holding = 0;  // what the calls up to k hold for their replays
  const bool levels = retained && backward_levels.size() == kept.size();
  int64_t rebuilt = std::max<int64_t>(0, levels_all_ref - all);  // Note [Backward levels]
  for (int64_t w : ws) rebuilt += w;
  // Note [Window of a call keeping more]: for plans that replay (keeping everything is the ceiling's).
  const bool replays = std::any_of(ws.begin(), ws.end(), [](int64_t w) { return w > 0; });
  for (size_t k = 0; k < kept.size(); ++k) {
    peak = std::max(peak, forward_c[k] + prefix);
    prefix += kept[k];
    holding += held(held_for_replay, keep_all, k, kept[k]);
    if (levels) {
      for (const RestLevel& l : backward_levels[k]) peak = std::max(peak, l.rest + all + std::min(rebuilt, l.replay));
    } else {
      peak = std::max(peak, backward_c[k] + (retained ? all : prefix + holding) + ws[k]);
      // rest_c and ws_ref: one per call, or none; spread likewise (and kept_ref then, set with the window levels).
      const bool other = !rest_c.empty() && (ws[k] > ws_ref[k] || (!spread.empty() && spread[k] &&
                                                                   (ws[k] != ws_ref[k] || kept[k] != kept_ref[k])));
      if (!retained && other) {
        peak = std::max(peak, rest_c[k] + prefix + holding + ws[k]);  // Note [Working set larger than the measured one]
      }
      if (!retained && replays && window_levels.size() == kept.size()) {
        // Note [Window of a call keeping more]: what the plan replays in this window (the call's working set, and
        // what it keeps less than the plan that ran), and the values of this call it keeps that the plan that ran
        // rebuilt: together at most the replay bytes the measured step had alive.
        const int64_t replayed = std::max<int64_t>(0, window_all_ref - all) + ws[k];
        const int64_t kept_more = std::max<int64_t>(0, kept[k] - kept_ref[k] - alive_ref[k]);
        const int64_t before = prefix - kept[k] + holding;  // calls before k kept, calls up to k held
        for (const RestLevel& l : window_levels[k]) {
          peak = std::max(peak, l.rest + before + std::min(replayed + kept_more, l.replay));
        }
      }
    }
    if (k < last_backward_c.size()) peak = std::max(peak, last_backward_c[k] + prefix + holding + ws[k]);
  }
  return std::max(peak, tail_c + prefix + holding) + baseline_shift;
}

SequencePeakModel SequencePeakModel::calibrate(const StepProfile& profile, const std::vector<int64_t>& kept_ref,
                                               const std::vector<int64_t>& ws_ref, const StepExtras& extras) {
  SequencePeakModel m;
  const size_t n = profile.backward_peaks.size();
  if (!profile.valid || kept_ref.size() != n || ws_ref.size() != n || profile.forward_peaks.size() != n) return m;
  m.pre = profile.pre_peak;
  m.retained = extras.retained;
  if (extras.held_for_replay.size() == n && extras.keep_all.size() == n) {
    m.held_for_replay = extras.held_for_replay;
    m.keep_all = extras.keep_all;
  }
  m.forward_c.resize(n);
  m.backward_c.resize(n);
  int64_t all = 0;
  for (size_t k = 0; k < n; ++k) {
    all += kept_ref[k] + held(m.held_for_replay, m.keep_all, k, kept_ref[k]) + at_or_zero(extras.alive_retained, k);
  }
  int64_t prefix = 0;      // kept (and alive anyway after the forward) bytes of the calls before k
  int64_t holding = 0;     // held for the replays, calls up to k
  int64_t bwd_alive = 0;   // alive anyway in the backward, calls up to k
  int64_t bwd_prefix = 0;  // kept bytes of the calls up to k
  for (size_t k = 0; k < n; ++k) {
    m.forward_c[k] = profile.forward_peaks[k] - prefix;
    prefix += kept_ref[k] + at_or_zero(extras.alive_forward, k);
    holding += held(m.held_for_replay, m.keep_all, k, kept_ref[k]);
    bwd_prefix += kept_ref[k];
    bwd_alive += at_or_zero(extras.alive_backward, k);
    m.backward_c[k] =
        profile.backward_peaks[k] - (extras.retained ? all : bwd_prefix + holding) - bwd_alive - ws_ref[k];
    if (!extras.retained && profile.backward_levels.size() == n && !profile.backward_levels[k].empty()) {
      // Note [Working set larger than the measured one]: the levels are sorted by rest, largest first.
      m.rest_c.push_back(std::max(m.backward_c[k], profile.backward_levels[k].front().rest - bwd_prefix - holding -
                                                       bwd_alive));
    }
    if (extras.retained && extras.last_backward.valid && extras.last_backward.backward_peaks.size() == n) {
      m.last_backward_c.push_back(extras.last_backward.backward_peaks[k] - bwd_prefix - holding - bwd_alive -
                                  ws_ref[k]);
    }
  }
  m.tail_c = profile.tail_peak - prefix - holding;
  if (m.rest_c.size() == n) {
    m.ws_ref = ws_ref;
    if (extras.spread.size() == n) m.spread = extras.spread;
  } else {
    m.rest_c.clear();
  }
  calibrate_levels(m, profile, kept_ref, extras);
  m.valid = true;
  return m;
}

}  // namespace tapesac::planner
