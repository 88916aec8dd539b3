// Replay schedules as the planner models them (schedule.h, Note [Schedule model]).
#include "tapesac/planner/schedule.h"

#include <algorithm>
#include <limits>

#include "compiled.h"
#include "tapesac/common/errors.h"

namespace tapesac::planner {
namespace {

// What every evaluation of one (problem, keep, unpack order) shares.
struct Model {
  const BlockProblem& p;
  detail::StorageGroups groups;
  std::vector<int32_t> creator;     // per group: its first value
  std::vector<uint8_t> base;        // per value: external or kept (resident for the whole backward)
  std::vector<uint8_t> holdable;    // per value
  std::vector<int32_t> first;       // per value: position of its first unpack (order index; large when unknown)
  std::vector<int32_t> death;       // per value: dies before the first unpack at this position

  Model(const BlockProblem& problem, const KeepMask& keep, const UnpackOrder& u)
      : p(problem), groups(detail::storage_groups(problem)), creator(detail::group_creators(groups)) {
    validate_mask(problem, keep);
    const size_t n = p.values.size();
    base.assign(n, 0);
    for (size_t v = 0; v < n; ++v) base[v] = p.values[v].producer == kExternalProducer;
    for (size_t c = 0; c < p.candidates.size(); ++c) {
      if (keep[c]) base[static_cast<size_t>(p.candidates[c])] = 1;
    }
    holdable.assign(n, 0);
    for (size_t v = 0; v < n; ++v) {
      holdable[v] = u.holdable.empty() ? p.values[v].producer != kExternalProducer : u.holdable.at(v);
    }
    const int32_t never = std::numeric_limits<int32_t>::max() / 2;
    first.assign(n, never);
    death.assign(n, never + 1);
    for (size_t i = 0; i < u.values.size(); ++i) {
      const auto v = static_cast<size_t>(u.values[i]);
      if (v >= n || first[v] != never) continue;
      first[v] = static_cast<int32_t>(i);
      death[v] = u.dies_before.empty() ? never + 1 : u.dies_before.at(i);
    }
  }
};

// Per op: needed to produce `wanted` (per value) when `avail` values are read as they are.
std::vector<uint8_t> closure(const BlockProblem& p, std::vector<uint8_t> wanted, const std::vector<uint8_t>& avail) {
  std::vector<uint8_t> needed(p.ops.size(), 0);
  for (size_t i = p.ops.size(); i-- > 0;) {
    const PlanOp& op = p.ops[i];
    if (!std::any_of(op.outputs.begin(), op.outputs.end(), [&](int32_t v) { return wanted[static_cast<size_t>(v)]; })) {
      continue;
    }
    needed[i] = 1;
    for (int32_t v : op.inputs) {
      if (!avail[static_cast<size_t>(v)]) wanted[static_cast<size_t>(v)] = 1;
    }
  }
  return needed;
}

// Bytes of the distinct storage groups of the values marked in `alive` (external groups excluded).
int64_t group_bytes(const Model& m, const std::vector<uint8_t>& alive) {
  std::vector<int64_t> best(static_cast<size_t>(m.groups.count), 0);
  for (size_t v = 0; v < alive.size(); ++v) {
    if (!alive[v]) continue;
    const size_t g = static_cast<size_t>(m.groups.of_value[v]);
    if (!m.groups.external[g]) best[g] = std::max(best[g], m.p.values[v].bytes);
  }
  int64_t total = 0;
  for (int64_t b : best) total += b;
  return total;
}

// The segments simulated in order (Note [Schedule model]).
class Simulation {
 public:
  Simulation(const Model& m, const std::vector<int32_t>& order, const std::vector<int32_t>& begin,
             const std::vector<int32_t>& hold_from)
      : m_(m), order_(order), begin_(begin.empty() ? std::vector<int32_t>{0} : begin), from_(hold_from) {
    const size_t n = m.p.values.size();
    from_.resize(n, kNeverHold);
    for (size_t v = 0; v < n; ++v) {
      if (!m.holdable[v]) from_[v] = kNeverHold;
    }
    seg_of_.assign(n, -1);
    for (size_t s = 0; s < begin_.size(); ++s) {
      for (int32_t k = begin_[s]; k < end(s); ++k) {
        seg_of_[static_cast<size_t>(order_[static_cast<size_t>(k)])] = static_cast<int32_t>(s);
      }
    }
    made_.assign(n, -1);
    last_read_.assign(n, -1);
  }

  ScheduleChoice run() {
    ScheduleChoice out;
    const size_t segs = begin_.size();
    std::vector<std::vector<uint8_t>> needed(segs);
    for (size_t s = 0; s < segs; ++s) needed[s] = read_pass(static_cast<int32_t>(s), out.replay_cost_ns);
    made_.assign(m_.p.values.size(), -1);  // the memory pass replays the same closures in the same order
    first_kept_.assign(m_.p.values.size(), -1);
    for (size_t s = 0; s < segs; ++s) memory_pass(static_cast<int32_t>(s), needed[s], out);
    for (size_t v = 0; v < made_.size(); ++v) {
      const int32_t until = hold_until(static_cast<int32_t>(v));
      if (first_kept_[v] >= 0 && until > first_kept_[v]) {
        out.holds.push_back(ScheduleChoice::Hold{static_cast<int32_t>(v), from_[v], until});
      }
    }
    return out;
  }

 private:
  int32_t end(size_t s) const {
    return s + 1 < begin_.size() ? begin_[s + 1] : static_cast<int32_t>(order_.size());
  }
  int32_t pos(int32_t s) const {
    return m_.first[static_cast<size_t>(order_[static_cast<size_t>(begin_[static_cast<size_t>(s)])])];
  }
  bool target(size_t v) const { return seg_of_[v] >= 0; }
  // Until which segment the kept copy of v stays alive for later replays (a target: at least its own segment).
  int32_t hold_until(int32_t v) const {
    const auto i = static_cast<size_t>(v);
    if (made_[i] < 0) return -1;
    const int32_t own = target(i) ? seg_of_[i] : -1;
    return from_[i] <= made_[i] ? std::max(last_read_[i], own) : own;
  }
  // A replay of segment s that produces v keeps it: its own target, or held from `from` on.
  bool keeps(size_t v, int32_t s) const { return (target(v) && seg_of_[v] == s) || from_[v] <= s; }
  // Value v is read as it is by segment s's replay.
  bool avail(size_t v, int32_t s) const {
    if (m_.base[v]) return true;
    if (made_[v] < 0 || made_[v] >= s || !m_.holdable[v]) return false;
    const bool waiting = target(v) && m_.death[v] > pos(s);
    return waiting || from_[v] <= made_[v];
  }

  std::vector<uint8_t> read_pass(int32_t s, double& cost) {
    const size_t n = m_.p.values.size();
    std::vector<uint8_t> av(n, 0), wanted(n, 0);
    for (size_t v = 0; v < n; ++v) av[v] = avail(v, s);
    for (int32_t k = begin_[static_cast<size_t>(s)]; k < end(static_cast<size_t>(s)); ++k) {
      const auto v = static_cast<size_t>(order_[static_cast<size_t>(k)]);
      if (av[v]) {
        last_read_[v] = std::max(last_read_[v], s);
      } else {
        wanted[v] = 1;
      }
    }
    std::vector<uint8_t> needed = closure(m_.p, wanted, av);
    for (size_t i = 0; i < needed.size(); ++i) {
      if (!needed[i]) continue;
      cost += m_.p.ops[i].cost_ns;
      for (int32_t v : m_.p.ops[i].inputs) {
        if (!m_.base[static_cast<size_t>(v)] && av[static_cast<size_t>(v)]) {
          last_read_[static_cast<size_t>(v)] = std::max(last_read_[static_cast<size_t>(v)], s);
        }
      }
    }
    mark_made(needed, s);
    return needed;
  }

  void mark_made(const std::vector<uint8_t>& needed, int32_t s) {
    for (size_t i = 0; i < needed.size(); ++i) {
      if (!needed[i]) continue;
      for (int32_t v : m_.p.ops[i].outputs) {
        const auto u = static_cast<size_t>(v);
        if (!keeps(u, s)) continue;  // freed after this replay; recomputed by the first segment that needs it
        made_[u] = s;
        if (first_kept_.size() > u && first_kept_[u] < 0) first_kept_[u] = s;
      }
    }
  }

  void memory_pass(int32_t s, const std::vector<uint8_t>& needed, ScheduleChoice& out) {
    const size_t n = m_.p.values.size();
    std::vector<uint8_t> resident(n, 0), alive(n, 0), pinned(n, 0), held(n, 0);
    for (size_t v = 0; v < n; ++v) {
      resident[v] = avail(v, s);
      if (m_.base[v] || made_[v] < 0) continue;
      const bool waiting = target(v) && m_.death[v] > pos(s);
      alive[v] = waiting || hold_until(static_cast<int32_t>(v)) >= s;
    }
    for (size_t i = 0; i < needed.size(); ++i) {
      if (!needed[i]) continue;
      for (int32_t v : m_.p.ops[i].outputs) {
        const auto u = static_cast<size_t>(v);
        pinned[u] = (target(u) && seg_of_[u] == s) || (from_[u] <= s && last_read_[u] > s) ||
                    (target(u) && seg_of_[u] > s && from_[u] <= s);
      }
    }
    const int64_t before = group_bytes(m_, alive);
    const int64_t ws = before + detail::replay_walk_peak(m_.p, m_.groups, m_.creator, needed, resident, pinned);
    if (ws > out.working_set_bytes) {
      out.working_set_bytes = ws;
      out.peak_segment = s;
    }
    mark_made(needed, s);
    for (size_t v = 0; v < n; ++v) {
      if (made_[v] < 0 || m_.base[v]) continue;
      held[v] = (target(v) && seg_of_[v] > s) || hold_until(static_cast<int32_t>(v)) > s;
    }
    out.held_bytes = std::max(out.held_bytes, group_bytes(m_, held));
  }

  const Model& m_;
  const std::vector<int32_t>& order_;
  std::vector<int32_t> begin_;
  std::vector<int32_t> from_;        // per value: the first segment whose replay may hold it
  std::vector<int32_t> seg_of_;
  std::vector<int32_t> made_;        // per value: the segment whose replay made its kept copy (-1: none)
  std::vector<int32_t> first_kept_;  // per value: the first such segment (memory pass)
  std::vector<int32_t> last_read_;   // per value: the last segment whose replay reads it as it is
};

ScheduleChoice run(const Model& m, std::vector<int32_t> order, std::vector<int32_t> begin,
                   const std::vector<int32_t>& hold_from) {
  ScheduleChoice c = Simulation(m, order, begin, hold_from).run();
  c.order = std::move(order);
  c.segment_begin = std::move(begin);
  if (c.segment_begin.size() <= 1) c.segment_begin.clear();
  return c;
}

// The values a schedule holds through its peak segment (the ones worth trying to recompute instead), by storage group:
// a group's bytes are freed only when none of its values is held.
std::vector<std::vector<int32_t>> held_at_peak(const Model& m, const ScheduleChoice& c) {
  std::vector<std::vector<int32_t>> by_group(static_cast<size_t>(m.groups.count));
  for (const ScheduleChoice::Hold& h : c.holds) {
    if (h.until >= c.peak_segment && h.from <= c.peak_segment) {
      by_group[static_cast<size_t>(m.groups.of_value[static_cast<size_t>(h.value)])].push_back(h.value);
    }
  }
  std::vector<std::vector<int32_t>> out;
  for (auto& g : by_group) {
    if (!g.empty()) out.push_back(std::move(g));
  }
  return out;
}

}  // namespace

std::vector<int32_t> replay_order(const BlockProblem& p, const KeepMask& keep, const UnpackOrder& unpack) {
  validate_mask(p, keep);
  std::vector<uint8_t> dropped(p.values.size(), 0);
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    if (!keep[c]) dropped[static_cast<size_t>(p.candidates[c])] = 1;
  }
  std::vector<int32_t> order;
  for (int32_t v : unpack.values) {
    if (v >= 0 && static_cast<size_t>(v) < dropped.size() && dropped[static_cast<size_t>(v)]) {
      dropped[static_cast<size_t>(v)] = 0;
      order.push_back(v);
    }
  }
  for (size_t c = p.candidates.size(); c-- > 0;) {
    if (dropped[static_cast<size_t>(p.candidates[c])]) order.push_back(p.candidates[c]);
  }
  return order;
}

ScheduleChoice evaluate_schedule(const BlockProblem& problem, const KeepMask& keep, const UnpackOrder& unpack,
                                 std::vector<int32_t> order, std::vector<int32_t> segment_begin,
                                 const std::vector<int32_t>& hold_from) {
  const Model m(problem, keep, unpack);
  // A mask of the candidates, not a search per value: that was O(order * candidates) per evaluation, the largest
  // self cost of the top-up on blocks of thousands of ops (an adversarial test; Note [Bounded schedule search]).
  std::vector<uint8_t> candidate(m.base.size(), 0);
  for (int32_t c : problem.candidates) {
    if (c >= 0 && static_cast<size_t>(c) < candidate.size()) candidate[static_cast<size_t>(c)] = 1;
  }
  for (int32_t v : order) {
    const bool dropped = v >= 0 && static_cast<size_t>(v) < m.base.size() && !m.base[static_cast<size_t>(v)] &&
                         candidate[static_cast<size_t>(v)] != 0;
    TAPESAC_CHECK(dropped, kConfig, "evaluate_schedule: v", v, " in the order is not a candidate the mask drops");
  }
  return run(m, std::move(order), std::move(segment_begin), hold_from);
}

std::vector<ScheduleChoice> schedule_choices(const BlockProblem& problem, const KeepMask& keep,
                                             const UnpackOrder& unpack, const ScheduleOptions& options) {
  const Model m(problem, keep, unpack);
  const std::vector<int32_t> order = replay_order(problem, keep, unpack);
  std::vector<ScheduleChoice> found;
  found.push_back(run(m, order, {}, {}));  // one segment
  if (order.size() > 1) {
    // The finest segments and the evaluations they allow (Note [Bounded schedule search], schedule.h).
    const size_t n_fine = std::min(order.size(), static_cast<size_t>(std::max<int32_t>(2, options.max_segments)));
    std::vector<int32_t> fine(n_fine);
    for (size_t i = 0; i < n_fine; ++i) fine[i] = static_cast<int32_t>(i * order.size() / n_fine);
    const int64_t cells = static_cast<int64_t>(n_fine * (problem.values.size() + problem.ops.size()));
    const int64_t affordable = std::max<int64_t>(4, options.max_cells / std::max<int64_t>(1, cells));
    const int32_t max_evaluations = static_cast<int32_t>(std::min<int64_t>(options.max_evaluations, affordable));
    // Hold everything later segments read, from the start; a value the greedy stops holding is then recomputed
    // from what is still held (values nobody held are never held: they stay transients of the replays).
    std::vector<int32_t> from(problem.values.size(), 0);
    ScheduleChoice cur = run(m, order, fine, from);
    std::fill(from.begin(), from.end(), kNeverHold);
    for (const ScheduleChoice::Hold& h : cur.holds) from[static_cast<size_t>(h.value)] = 0;
    int32_t evaluations = 1;
    // Greedy (Note [Schedule model]): move past the peak the hold that lowers the working set most per nanosecond.
    bool pushed = false;
    while (evaluations < max_evaluations) {
      double best_score = -1;
      ScheduleChoice best;
      const int32_t past = cur.peak_segment + 1;
      std::vector<int32_t> best_group;
      for (const std::vector<int32_t>& group : held_at_peak(m, cur)) {
        if (evaluations >= max_evaluations) break;
        std::vector<int32_t> before;
        for (int32_t v : group) {
          before.push_back(from[static_cast<size_t>(v)]);
          from[static_cast<size_t>(v)] = past;
        }
        ScheduleChoice c = run(m, order, fine, from);
        for (size_t k = 0; k < group.size(); ++k) from[static_cast<size_t>(group[k])] = before[k];
        ++evaluations;
        const int64_t freed = cur.working_set_bytes - c.working_set_bytes;
        if (freed <= 0) continue;
        const double score = static_cast<double>(freed) / std::max(1.0, c.replay_cost_ns - cur.replay_cost_ns);
        if (score > best_score) {
          best_score = score;
          best_group = group;
          best = std::move(c);
        }
      }
      found.push_back(cur);
      pushed = true;
      if (best_group.empty()) break;
      for (int32_t v : best_group) from[static_cast<size_t>(v)] = past;
      cur = std::move(best);
      pushed = false;
    }
    if (!pushed) found.push_back(cur);
    found.push_back(run(m, order, fine, {}));  // nothing held
  }
  // The Pareto chain: ascending cost, strictly descending working set.
  std::stable_sort(found.begin(), found.end(), [](const ScheduleChoice& a, const ScheduleChoice& b) {
    return a.replay_cost_ns != b.replay_cost_ns ? a.replay_cost_ns < b.replay_cost_ns
                                                : a.working_set_bytes < b.working_set_bytes;
  });
  std::vector<ScheduleChoice> out;
  for (ScheduleChoice& c : found) {
    if (!out.empty() && c.working_set_bytes >= out.back().working_set_bytes) continue;
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace tapesac::planner
