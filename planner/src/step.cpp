// Step-level selection under one memory limit (step.h).
//
// Note [Step knapsack]. The predicted peak is baseline + sum_j kept_j + max_j ws_j. The max term couples the
// calls, so we enumerate its value: for each cap W among the working sets of the frontier points, every call is
// restricted to points with ws <= W, and what is left is a multiple-choice knapsack: minimize sum_j cost_j
// subject to sum_j kept_j <= limit - baseline - W. The optimum over all W is the optimum of the whole problem
// (the optimal choice has some max working set W*, and it is feasible for cap W*).
// For one cap we solve the LP relaxation exactly: on each frontier only the lower convex hull of (bytes, cost)
// matters, and taking hull segments in decreasing order of cost saved per byte is optimal for the LP (the
// classic MCKP result; it is the Lagrangian dual: for every multiplier each call picks the hull point
// minimizing cost + lambda * bytes). The greedy stops with at most one call that the LP would advance
// fractionally, so the integer solution is within one hull segment's cost of the LP bound, which is itself
// below the integer optimum. With many calls that is a small fraction of the total (one block of 48); the
// remaining bytes are then spent by moving single calls to any frontier point (not only hull points) that fits
// and saves the most. The LP bound is reported as StepPlan::replay_cost_lower_bound_ns so the gap is visible.
// Cost: O(caps * (points + calls) * log) for the LP greedy, plus the slack moves; caps <= frontier points.
#include "tapesac/planner/step.h"

#include "tapesac/planner/evaluate.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <string>

namespace tapesac::planner {
namespace {

std::string human_bytes(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%lld bytes (%.3f GiB)", static_cast<long long>(bytes),
                static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// Indices of the points of f with working set <= cap, ascending bytes.
std::vector<int32_t> allowed_points(const BlockFrontier& f, int64_t cap) {
  std::vector<int32_t> out;
  for (size_t p = 0; p < f.points.size(); ++p) {
    if (f.points[p].working_set_bytes <= cap) out.push_back(static_cast<int32_t>(p));
  }
  return out;
}

// Lower convex hull of the allowed points in the (bytes, cost) plane, from the first (least bytes) point, keeping
// only segments that save cost.
std::vector<int32_t> lower_hull(const BlockFrontier& f, const std::vector<int32_t>& allowed) {
  std::vector<int32_t> hull;
  for (int32_t p : allowed) {
    const FrontierPoint& c = f.points[static_cast<size_t>(p)];
    if (!hull.empty() && c.replay_cost_ns >= f.points[static_cast<size_t>(hull.back())].replay_cost_ns) continue;
    while (hull.size() >= 2) {
      const FrontierPoint& a = f.points[static_cast<size_t>(hull[hull.size() - 2])];
      const FrontierPoint& b = f.points[static_cast<size_t>(hull.back())];
      const double cross = static_cast<double>(b.kept_bytes - a.kept_bytes) * (c.replay_cost_ns - a.replay_cost_ns) -
                           (b.replay_cost_ns - a.replay_cost_ns) * static_cast<double>(c.kept_bytes - a.kept_bytes);
      if (cross > 0) break;  // b is strictly below the chord a-c
      hull.pop_back();
    }
    hull.push_back(p);
  }
  return hull;
}

// A choice for every call, as counts of calls per frontier point.
struct Choice {
  std::vector<std::vector<int32_t>> at;  // [frontier][point] -> calls
  double cost = 0;
  double lower_bound = 0;
  int64_t kept = 0;
  int64_t max_ws = 0;
};

// The choice for one working-set cap (Note [Step knapsack]); false when no choice fits `kept_room`.
bool solve_cap(const StepInput& in, const std::vector<int32_t>& n_calls, int64_t cap, int64_t kept_room,
               Choice* out) {
  const size_t nf = in.frontiers.size();
  Choice ch;
  ch.at.resize(nf);
  std::vector<std::vector<int32_t>> hulls(nf);
  int64_t base = 0;
  for (size_t f = 0; f < nf; ++f) {
    if (n_calls[f] == 0) continue;
    const BlockFrontier& fr = in.frontiers[f];
    const std::vector<int32_t> allowed = allowed_points(fr, cap);
    if (allowed.empty()) return false;
    hulls[f] = lower_hull(fr, allowed);
    ch.at[f].assign(fr.points.size(), 0);
    const FrontierPoint& first = fr.points[static_cast<size_t>(hulls[f].front())];
    ch.at[f][static_cast<size_t>(hulls[f].front())] = n_calls[f];
    base += n_calls[f] * first.kept_bytes;
    ch.cost += n_calls[f] * first.replay_cost_ns;
  }
  int64_t room = kept_room - base;
  if (room < 0) return false;

  // LP greedy over hull segments, steepest first. A frontier's segment k+1 is queued only after segment k was
  // taken, and its slope is smaller, so every call that will reach hull[k] is there when segment k is popped.
  struct Segment {
    double per_byte;
    int32_t f;
    int32_t k;
    bool operator<(const Segment& o) const { return per_byte < o.per_byte; }
  };
  auto segment = [&](int32_t f, int32_t k) {
    const BlockFrontier& fr = in.frontiers[static_cast<size_t>(f)];
    const auto& h = hulls[static_cast<size_t>(f)];
    const FrontierPoint& a = fr.points[static_cast<size_t>(h[static_cast<size_t>(k)])];
    const FrontierPoint& b = fr.points[static_cast<size_t>(h[static_cast<size_t>(k) + 1])];
    return Segment{(a.replay_cost_ns - b.replay_cost_ns) / static_cast<double>(b.kept_bytes - a.kept_bytes), f, k};
  };
  std::priority_queue<Segment> queue;
  for (size_t f = 0; f < nf; ++f) {
    if (hulls[f].size() >= 2) queue.push(segment(static_cast<int32_t>(f), 0));
  }
  bool fractional = false;
  while (!queue.empty()) {
    const Segment s = queue.top();
    queue.pop();
    const BlockFrontier& fr = in.frontiers[static_cast<size_t>(s.f)];
    const auto& h = hulls[static_cast<size_t>(s.f)];
    const int32_t from = h[static_cast<size_t>(s.k)];
    const int32_t to = h[static_cast<size_t>(s.k) + 1];
    const int64_t db = fr.points[static_cast<size_t>(to)].kept_bytes - fr.points[static_cast<size_t>(from)].kept_bytes;
    const double dc =
        fr.points[static_cast<size_t>(from)].replay_cost_ns - fr.points[static_cast<size_t>(to)].replay_cost_ns;
    int32_t& n_from = ch.at[static_cast<size_t>(s.f)][static_cast<size_t>(from)];
    const int32_t t = static_cast<int32_t>(std::min<int64_t>(n_from, room / db));
    n_from -= t;
    ch.at[static_cast<size_t>(s.f)][static_cast<size_t>(to)] += t;
    room -= t * db;
    ch.cost -= t * dc;
    if (n_from > 0 && !fractional) {
      fractional = true;
      ch.lower_bound = ch.cost - s.per_byte * static_cast<double>(room);
    }
    if (t > 0 && static_cast<size_t>(s.k) + 2 < h.size()) queue.push(segment(s.f, s.k + 1));
  }
  if (!fractional) ch.lower_bound = ch.cost;

  // Spend what is left: move one call at a time to the point (any point under the cap) that saves the most.
  while (true) {
    double best_gain = 0;
    int32_t best_f = -1, best_p = -1, best_q = -1;
    for (size_t f = 0; f < nf; ++f) {
      const BlockFrontier& fr = in.frontiers[f];
      for (size_t p = 0; p < ch.at[f].size(); ++p) {
        if (ch.at[f][p] == 0) continue;
        const FrontierPoint& a = fr.points[p];
        for (size_t q = p + 1; q < fr.points.size(); ++q) {
          const FrontierPoint& b = fr.points[q];
          if (b.kept_bytes - a.kept_bytes > room) break;
          if (b.working_set_bytes > cap) continue;
          const double gain = a.replay_cost_ns - b.replay_cost_ns;
          if (gain > best_gain) {
            best_gain = gain;
            best_f = static_cast<int32_t>(f);
            best_p = static_cast<int32_t>(p);
            best_q = static_cast<int32_t>(q);
          }
        }
      }
    }
    if (best_f < 0) break;
    const BlockFrontier& fr = in.frontiers[static_cast<size_t>(best_f)];
    room -= fr.points[static_cast<size_t>(best_q)].kept_bytes - fr.points[static_cast<size_t>(best_p)].kept_bytes;
    ch.cost -= best_gain;
    --ch.at[static_cast<size_t>(best_f)][static_cast<size_t>(best_p)];
    ++ch.at[static_cast<size_t>(best_f)][static_cast<size_t>(best_q)];
  }

  for (size_t f = 0; f < nf; ++f) {
    for (size_t p = 0; p < ch.at[f].size(); ++p) {
      if (ch.at[f][p] == 0) continue;
      const FrontierPoint& pt = in.frontiers[f].points[p];
      ch.kept += ch.at[f][p] * pt.kept_bytes;
      ch.max_ws = std::max(ch.max_ws, pt.working_set_bytes);
    }
  }
  *out = std::move(ch);
  return true;
}

// The plan of a choice over `at` (the frontiers of `in` seen under a cap, or `in` itself): points and schedules are
// mapped back to `in`'s.
StepPlan make_plan(const StepInput& in, const StepInput& at, const PeakModel& model, const Choice& ch) {
  StepPlan plan;
  std::vector<std::vector<int32_t>> left = ch.at;
  for (int32_t f : at.calls) {
    const BlockFrontier& fr = at.frontiers[static_cast<size_t>(f)];
    auto& counts = left[static_cast<size_t>(f)];
    const auto it = std::find_if(counts.begin(), counts.end(), [](int32_t n) { return n > 0; });
    TAPESAC_INTERNAL_ASSERT(it != counts.end(), "step plan assigns fewer points than calls of frontier ", f);
    --*it;
    const int32_t p = static_cast<int32_t>(it - counts.begin());
    const FrontierPoint& pt = fr.points[static_cast<size_t>(p)];
    const int32_t origin = pt.origin >= 0 ? pt.origin : p;
    const KeepMask& keep = in.frontiers[static_cast<size_t>(f)].points[static_cast<size_t>(origin)].keep;
    plan.calls.push_back(CallPlan{f, origin, pt.schedule, keep, pt.kept_bytes, pt.working_set_bytes,
                                  pt.replay_cost_ns});
    plan.sum_kept_bytes += pt.kept_bytes;
    plan.max_working_set_bytes = std::max(plan.max_working_set_bytes, pt.working_set_bytes);
    plan.replay_cost_ns += pt.replay_cost_ns;
  }
  plan.predicted_peak_bytes = model.predict(plan.sum_kept_bytes, plan.max_working_set_bytes);
  plan.replay_cost_lower_bound_ns = ch.lower_bound;
  return plan;
}

// The cheapest schedule of `pt` whose working set fits `cap` (-1: the single replay, when the point has no
// schedules and fits); false when none fits.
bool cheapest_under(const FrontierPoint& pt, int64_t cap, int32_t* schedule, double* cost, int64_t* ws) {
  if (pt.schedules.empty()) {
    *schedule = -1;
    *cost = pt.replay_cost_ns;
    *ws = pt.working_set_bytes;
    return pt.working_set_bytes <= cap;
  }
  for (size_t k = 0; k < pt.schedules.size(); ++k) {  // ascending cost
    if (pt.schedules[k].working_set_bytes > cap) continue;
    *schedule = static_cast<int32_t>(k);
    *cost = pt.schedules[k].replay_cost_ns;
    *ws = pt.schedules[k].working_set_bytes;
    return true;
  }
  return false;
}

// `in` seen under a working-set cap: every point at its cheapest schedule that fits (points where none fits left
// out), remembering which point and schedule it stands for. Keep masks are not copied (make_plan maps back).
StepInput at_cap(const StepInput& in, int64_t cap) {
  StepInput at;
  at.calls = in.calls;
  at.frontiers.resize(in.frontiers.size());
  for (size_t f = 0; f < in.frontiers.size(); ++f) {
    const BlockFrontier& fr = in.frontiers[f];
    BlockFrontier& out = at.frontiers[f];
    out.signature = fr.signature;
    out.exact = fr.exact;
    for (size_t p = 0; p < fr.points.size(); ++p) {
      FrontierPoint q;
      if (!cheapest_under(fr.points[p], cap, &q.schedule, &q.replay_cost_ns, &q.working_set_bytes)) continue;
      q.kept_bytes = fr.points[p].kept_bytes;
      q.origin = static_cast<int32_t>(p);
      out.points.push_back(std::move(q));
    }
  }
  return at;
}

// Every working set a point can have (its schedules', or its own).
std::vector<int64_t> working_set_caps(const StepInput& in, const std::vector<int32_t>& n_calls) {
  std::vector<int64_t> caps{0};
  for (size_t f = 0; f < in.frontiers.size(); ++f) {
    if (n_calls[f] == 0) continue;
    for (const FrontierPoint& pt : in.frontiers[f].points) {
      caps.push_back(pt.working_set_bytes);
      for (const ScheduleChoice& c : pt.schedules) caps.push_back(c.working_set_bytes);
    }
  }
  std::sort(caps.begin(), caps.end());
  caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
  return caps;
}

}  // namespace

InfeasibleLimitError::InfeasibleLimitError(int64_t limit_bytes, int64_t smallest_feasible_bytes)
    : Error(ErrorKind::kMemoryLimit,
            "memory limit " + human_bytes(limit_bytes) + " is below the smallest feasible predicted step peak " +
                human_bytes(smallest_feasible_bytes) +
                " (baseline + the minimum kept bytes of every block + one block's replay working set); raise the "
                "limit to at least that"),
      limit_bytes_(limit_bytes),
      smallest_feasible_bytes_(smallest_feasible_bytes) {}

StepInput build_step_input(const std::vector<const BlockProblem*>& calls, const FrontierOptions& options,
                           const std::vector<const UnpackOrder*>& orders) {
  StepInput in;
  std::map<std::string, int32_t> by_signature;
  std::vector<const BlockProblem*> first;
  for (size_t j = 0; j < calls.size(); ++j) {
    const BlockProblem* p = calls[j];
    TAPESAC_CHECK(p != nullptr, kConfig, "build_step_input: block call ", j, " has no problem (null)");
    auto [it, inserted] = by_signature.emplace(p->signature, static_cast<int32_t>(first.size()));
    if (inserted) {
      first.push_back(p);
      in.frontiers.push_back(block_frontier(*p, options));
      if (j < orders.size() && orders[j] != nullptr) add_schedules(in.frontiers.back(), *p, *orders[j]);
    } else {
      const BlockProblem& q = *first[static_cast<size_t>(it->second)];
      TAPESAC_CHECK(q.ops.size() == p->ops.size() && q.values.size() == p->values.size() &&
                        q.candidates.size() == p->candidates.size(),
                    kConfig, "build_step_input: block calls with signature '", p->signature,
                    "' differ: (ops, values, candidates) = (", q.ops.size(), ", ", q.values.size(), ", ",
                    q.candidates.size(), ") vs (", p->ops.size(), ", ", p->values.size(), ", ", p->candidates.size(),
                    ") at call ", j, "; blocks with one signature must have identical tapes");
    }
    in.calls.push_back(it->second);
  }
  return in;
}

StepInput fixed_step_input(const std::vector<const BlockProblem*>& calls, const std::vector<KeepMask>& masks,
                           const std::vector<const UnpackOrder*>& orders) {
  TAPESAC_CHECK(masks.size() == calls.size(), kConfig, "fixed_step_input: ", masks.size(), " masks for ",
                calls.size(), " calls");
  StepInput in;
  std::map<std::string, int32_t> by_signature;
  for (size_t j = 0; j < calls.size(); ++j) {
    const BlockProblem* p = calls[j];
    TAPESAC_CHECK(p != nullptr, kConfig, "fixed_step_input: block call ", j, " has no problem (null)");
    auto [it, inserted] = by_signature.emplace(p->signature, static_cast<int32_t>(in.frontiers.size()));
    if (inserted) {
      validate_problem(*p);
      FrontierPoint pt;
      pt.keep = masks[j];
      pt.kept_bytes = kept_bytes(*p, pt.keep);
      pt.replay_cost_ns = replay_cost_ns(*p, pt.keep);
      pt.working_set_bytes = replay_working_set_bytes(*p, pt.keep);
      if (j < orders.size() && orders[j] != nullptr) pt.schedules = schedule_choices(*p, pt.keep, *orders[j]);
      BlockFrontier f;
      f.signature = p->signature;
      f.points.push_back(std::move(pt));
      in.frontiers.push_back(std::move(f));
    }
    in.calls.push_back(it->second);
  }
  return in;
}

StepPlan plan_step(const StepInput& in, const PeakModel& model, int64_t limit_bytes) {
  std::vector<int32_t> n_calls(in.frontiers.size(), 0);
  for (size_t j = 0; j < in.calls.size(); ++j) {
    const int32_t f = in.calls[j];
    TAPESAC_CHECK(f >= 0 && static_cast<size_t>(f) < in.frontiers.size(), kConfig, "plan_step: block call ", j,
                  " references frontier ", f, ", expected an index in [0, ", in.frontiers.size(), ")");
    TAPESAC_CHECK(!in.frontiers[static_cast<size_t>(f)].points.empty(), kConfig, "plan_step: frontier ", f, " ('",
                  in.frontiers[static_cast<size_t>(f)].signature, "') has no points");
    ++n_calls[static_cast<size_t>(f)];
  }
  // Keep everything: the last point of every frontier (it replays nothing).
  Choice all;
  all.at.resize(in.frontiers.size());
  for (size_t f = 0; f < in.frontiers.size(); ++f) {
    if (n_calls[f] == 0) continue;
    all.at[f].assign(in.frontiers[f].points.size(), 0);
    all.at[f].back() = n_calls[f];
  }
  const std::vector<int64_t> caps = working_set_caps(in, n_calls);
  std::vector<StepInput> views;
  views.reserve(caps.size());
  for (int64_t cap : caps) views.push_back(at_cap(in, cap));

  // Smallest feasible peak: per cap, every call at its least-bytes point under the cap.
  int64_t min_feasible = std::numeric_limits<int64_t>::max();
  for (size_t c = 0; c < caps.size(); ++c) {
    int64_t kept = 0;
    bool ok = true;
    for (size_t f = 0; f < in.frontiers.size() && ok; ++f) {
      if (n_calls[f] == 0) continue;
      const BlockFrontier& fr = views[c].frontiers[f];
      ok = !fr.points.empty();
      if (ok) kept += n_calls[f] * fr.points.front().kept_bytes;
    }
    if (ok) min_feasible = std::min(min_feasible, model.predict(kept, caps[c]));
  }
  if (limit_bytes < min_feasible) throw InfeasibleLimitError(limit_bytes, min_feasible);

  const StepPlan keep_all_plan = make_plan(in, in, model, all);
  StepPlan plan;
  if (limit_bytes >= keep_all_plan.predicted_peak_bytes) {
    plan = keep_all_plan;
    plan.keeps_everything = true;
    plan.replay_cost_lower_bound_ns = plan.replay_cost_ns;
  } else {
    Choice best;
    size_t best_view = 0;
    bool found = false;
    double lower_bound = std::numeric_limits<double>::infinity();
    int64_t best_peak = 0;
    for (size_t c = 0; c < caps.size(); ++c) {
      Choice ch;
      if (!solve_cap(views[c], n_calls, caps[c], limit_bytes - model.baseline_bytes - caps[c], &ch)) continue;
      lower_bound = std::min(lower_bound, ch.lower_bound);
      const int64_t peak = model.predict(ch.kept, ch.max_ws);
      if (!found || ch.cost < best.cost || (ch.cost == best.cost && peak < best_peak)) {
        best = std::move(ch);
        best_view = c;
        best_peak = peak;
        found = true;
      }
    }
    TAPESAC_INTERNAL_ASSERT(found, "plan_step found no choice although the limit ", limit_bytes,
                            " is above the smallest feasible peak ", min_feasible);
    plan = make_plan(in, views[best_view], model, best);
    plan.replay_cost_lower_bound_ns = lower_bound;
  }
  plan.min_feasible_peak_bytes = min_feasible;
  plan.keep_all_peak_bytes = keep_all_plan.predicted_peak_bytes;
  return plan;
}

StepPlan least_memory_plan(const StepInput& in) {
  StepPlan plan;
  for (int32_t f : in.calls) {
    TAPESAC_CHECK(f >= 0 && static_cast<size_t>(f) < in.frontiers.size() &&
                      !in.frontiers[static_cast<size_t>(f)].points.empty(),
                  kConfig, "least_memory_plan: a call references frontier ", f, " of ", in.frontiers.size(),
                  " (missing or empty)");
    const FrontierPoint& pt = in.frontiers[static_cast<size_t>(f)].points[0];
    plan.calls.push_back(CallPlan{f, 0, -1, pt.keep, pt.kept_bytes, pt.working_set_bytes, pt.replay_cost_ns});
    plan.sum_kept_bytes += pt.kept_bytes;
    plan.max_working_set_bytes = std::max(plan.max_working_set_bytes, pt.working_set_bytes);
    plan.replay_cost_ns += pt.replay_cost_ns;
  }
  plan.replay_cost_lower_bound_ns = plan.replay_cost_ns;
  return plan;
}

void plan_profile(const StepPlan& plan, std::vector<int64_t>* kept, std::vector<int64_t>* ws) {
  kept->clear();
  ws->clear();
  for (const CallPlan& c : plan.calls) {
    kept->push_back(c.kept_bytes);
    ws->push_back(c.working_set_bytes);
  }
}

namespace {

// The schedules of call j's point in ascending cost (its own single replay when it has none).
struct CallChoices {
  std::vector<int64_t> ws;
  std::vector<double> cost;
};
CallChoices call_choices(const StepInput& in, const CallPlan& c) {
  const FrontierPoint& pt = in.frontiers[static_cast<size_t>(c.frontier)].points[static_cast<size_t>(c.point)];
  CallChoices out;
  if (pt.schedules.empty()) {
    out.ws.push_back(pt.working_set_bytes);
    out.cost.push_back(pt.replay_cost_ns);
  }
  for (const ScheduleChoice& s : pt.schedules) {
    out.ws.push_back(s.working_set_bytes);
    out.cost.push_back(s.replay_cost_ns);
  }
  return out;
}

// Sets call j of `plan` to schedule k of its point (k indexes call_choices).
void set_schedule(const StepInput& in, StepPlan& plan, size_t j, size_t k, const CallChoices& ch) {
  CallPlan& c = plan.calls[j];
  const FrontierPoint& pt = in.frontiers[static_cast<size_t>(c.frontier)].points[static_cast<size_t>(c.point)];
  c.schedule = pt.schedules.empty() ? -1 : static_cast<int32_t>(k);
  c.working_set_bytes = ch.ws[k];
  c.replay_cost_ns = ch.cost[k];
}

void total_up(StepPlan& plan) {
  plan.replay_cost_ns = 0;
  plan.max_working_set_bytes = 0;
  plan.sum_kept_bytes = 0;
  for (const CallPlan& c : plan.calls) {
    plan.replay_cost_ns += c.replay_cost_ns;
    plan.max_working_set_bytes = std::max(plan.max_working_set_bytes, c.working_set_bytes);
    plan.sum_kept_bytes += c.kept_bytes;
  }
}

// Per call, the cheapest schedule whose working set keeps predict(ws) <= target, the other calls as they are.
void cheapest_fitting(const StepInput& in, StepPlan& plan, int64_t target,
                      const std::function<int64_t(const std::vector<int64_t>&)>& predict) {
  std::vector<int64_t> ws;
  for (const CallPlan& c : plan.calls) ws.push_back(c.working_set_bytes);
  for (size_t j = 0; j < plan.calls.size(); ++j) {
    const CallChoices ch = call_choices(in, plan.calls[j]);
    for (size_t k = 0; k < ch.ws.size(); ++k) {
      const int64_t before = ws[j];
      ws[j] = ch.ws[k];
      if (predict(ws) <= target || ch.ws[k] <= before) {  // the current one always fits: it is never passed over
        set_schedule(in, plan, j, k, ch);
        break;
      }
      ws[j] = before;
    }
  }
  total_up(plan);
  plan.predicted_peak_bytes = predict(ws);
}

std::function<int64_t(const std::vector<int64_t>&)> sequence_predictor(const SequencePeakModel& model,
                                                                      const StepPlan& plan) {
  std::vector<int64_t> kept;
  for (const CallPlan& c : plan.calls) kept.push_back(c.kept_bytes);
  return [&model, kept](const std::vector<int64_t>& ws) { return model.predict(kept, ws); };
}

// Every call at the cheapest schedule that keeps the sequence prediction under the limit (the others as they are).
void refine_schedules(const StepInput& in, const SequencePeakModel& model, int64_t limit_bytes, StepPlan& plan) {
  if (plan.predicted_peak_bytes > limit_bytes) return;  // nothing fits better than the least-memory plan itself
  cheapest_fitting(in, plan, limit_bytes, sequence_predictor(model, plan));
}

}  // namespace

// Note [Sequence search]. Under the sequence model a plan's peak depends on where its kept bytes sit, not only on
// their total. The additive model's plans (min cost s.t. kept + max ws <= B) are the candidates: as B grows they
// keep more and replay less; make_plan puts the points that keep more on later calls, which the backward frees
// first (what the sequence model rewards). The sequence peak of these plans grows with B except for small
// non-monotone steps, so a bisection on B finds the largest fitting budget; every evaluated plan that fits is a
// candidate, and the cheapest wins. About 40 plan_step calls per search.
StepPlan plan_step(const StepInput& in, const SequencePeakModel& model, int64_t limit_bytes, bool keep_all) {
  TAPESAC_CHECK(model.valid && model.backward_c.size() == in.calls.size(), kConfig,
                "plan_step: the sequence peak model has ", model.backward_c.size(), " calls, the step ",
                in.calls.size());
  const PeakModel additive{0};
  std::vector<int64_t> kept, ws;
  auto seq_peak = [&](StepPlan& p) {
    plan_profile(p, &kept, &ws);
    p.predicted_peak_bytes = model.predict(kept, ws);
    return p.predicted_peak_bytes;
  };
  StepPlan all = plan_step(in, additive, std::numeric_limits<int64_t>::max());
  const int64_t keep_all_peak = seq_peak(all);
  int64_t lo = all.min_feasible_peak_bytes;  // the additive budget of the least-memory plan
  int64_t hi = all.keep_all_peak_bytes;
  StepPlan least = plan_step(in, additive, lo);
  const int64_t min_feasible = seq_peak(least);
  auto finish = [&](StepPlan p) {
    p.min_feasible_peak_bytes = min_feasible;
    p.keep_all_peak_bytes = keep_all_peak;
    return p;
  };
  // A limit at the measured no-checkpoint peak must not make the plan replay: the runtime takes keeping everything
  // at the lower of this prediction and the keep-everything ceiling, which reads the measured timeline (Note
  // [Keep-everything ceiling] in peak_model.h; it used to be kept within max(4 KiB, 0.01%) below this prediction,
  // which on the random programs of a few KB ran a third of the planned steps over their limits).
  if (keep_all && limit_bytes >= keep_all_peak) {
    all.keeps_everything = true;
    return finish(std::move(all));
  }
  if (limit_bytes < min_feasible) throw InfeasibleLimitError(limit_bytes, min_feasible);
  StepPlan best = std::move(least);
  for (int it = 0; it < 40 && hi - lo > 1; ++it) {
    const int64_t mid = lo + (hi - lo) / 2;
    StepPlan p = plan_step(in, additive, mid);
    if (seq_peak(p) <= limit_bytes) {
      lo = mid;
      if (p.replay_cost_ns < best.replay_cost_ns ||
          (p.replay_cost_ns == best.replay_cost_ns && p.predicted_peak_bytes < best.predicted_peak_bytes)) {
        best = std::move(p);
      }
    } else {
      hi = mid;
    }
  }
  // best.replay_cost_lower_bound_ns stays the additive problem's LP bound at the chosen budget: a bound among the
  // plans of that budget, not over every plan the sequence model would accept.
  best.keeps_everything = false;
  refine_schedules(in, model, limit_bytes, best);
  return finish(std::move(best));
}

const ScheduleChoice* call_schedule(const StepInput& input, const StepPlan& plan, size_t j) {
  const CallPlan& c = plan.calls.at(j);
  if (c.schedule < 0) return nullptr;
  const FrontierPoint& pt = input.frontiers.at(static_cast<size_t>(c.frontier)).points.at(static_cast<size_t>(c.point));
  return &pt.schedules.at(static_cast<size_t>(c.schedule));
}

namespace {

// Note [Fixed masks]. With the keep masks fixed, a call's schedule changes only its own working set, which enters
// the predicted peak through one term (its backward, or the largest working set under the additive model). So every
// call starts at its least-memory schedule, which gives the least peak any choice reaches; then each call in turn
// takes its cheapest schedule that keeps the prediction under the target: the limit, or without one the least peak
// plus a slack. The last bytes of the least peak can cost many times the replay (recomputing everything for each
// segment); the slack (AutoPlannerOptions::least_peak_slack) trades them for time.
StepPlan plan_fixed(const StepInput& in, int64_t limit_bytes, double slack, double time_budget,
                    const std::function<std::function<int64_t(const std::vector<int64_t>&)>(const StepPlan&)>& model) {
  StepPlan plan;
  for (int32_t f : in.calls) {
    TAPESAC_CHECK(f >= 0 && static_cast<size_t>(f) < in.frontiers.size() &&
                      in.frontiers[static_cast<size_t>(f)].points.size() == 1,
                  kConfig, "plan_schedules: expected one point per frontier (fixed_step_input)");
    const FrontierPoint& pt = in.frontiers[static_cast<size_t>(f)].points[0];
    plan.calls.push_back(CallPlan{f, 0, -1, pt.keep, pt.kept_bytes, pt.working_set_bytes, pt.replay_cost_ns});
  }
  const auto predict = model(plan);
  std::vector<int64_t> ws;
  for (size_t j = 0; j < plan.calls.size(); ++j) {
    ws.push_back(plan.calls[j].working_set_bytes);
  }
  plan.keep_all_peak_bytes = predict(ws);  // the single replays
  double single_cost = 0;
  for (const CallPlan& c : plan.calls) single_cost += c.replay_cost_ns;
  for (size_t j = 0; j < plan.calls.size(); ++j) {
    const CallChoices ch = call_choices(in, plan.calls[j]);
    const size_t least = static_cast<size_t>(std::min_element(ch.ws.begin(), ch.ws.end()) - ch.ws.begin());
    set_schedule(in, plan, j, least, ch);
    ws[j] = ch.ws[least];
  }
  const int64_t least_peak = predict(ws);
  if (limit_bytes > 0 && least_peak > limit_bytes) throw InfeasibleLimitError(limit_bytes, least_peak);
  auto cheapest_under = [&](int64_t target) {
    StepPlan p = plan;
    cheapest_fitting(in, p, target, predict);
    return p;
  };
  StepPlan out;
  if (limit_bytes <= 0 && time_budget >= 0) {
    // Note [Replay time budget]: the least target whose cheapest schedules cost at most (1 + budget) x the single
    // replays. The cost of cheapest_under(target) falls as the target rises (each call takes the cheapest schedule
    // that fits), so a bisection between the least peak and the single replays' peak finds it.
    const double allowed = single_cost * (1 + time_budget);
    int64_t lo = least_peak;
    int64_t hi = std::max(least_peak, plan.keep_all_peak_bytes);
    out = cheapest_under(hi);
    for (int it = 0; it < 48 && lo < hi; ++it) {
      const int64_t mid = lo + (hi - lo) / 2;
      StepPlan p = cheapest_under(mid);
      if (p.replay_cost_ns <= allowed) {
        out = std::move(p);
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
  } else {
    out = cheapest_under(limit_bytes > 0 ? limit_bytes
                                         : least_peak + static_cast<int64_t>(slack * static_cast<double>(least_peak)));
  }
  out.min_feasible_peak_bytes = least_peak;
  out.replay_cost_lower_bound_ns = out.replay_cost_ns;
  return out;
}

}  // namespace

StepPlan plan_schedules(const StepInput& input, const SequencePeakModel& model, int64_t limit_bytes, double slack,
                        double time_budget) {
  TAPESAC_CHECK(model.valid && model.backward_c.size() == input.calls.size(), kConfig,
                "plan_schedules: the sequence peak model has ", model.backward_c.size(), " calls, the step ",
                input.calls.size());
  return plan_fixed(input, limit_bytes, slack, time_budget,
                    [&model](const StepPlan& p) { return sequence_predictor(model, p); });
}

StepPlan plan_schedules(const StepInput& input, const PeakModel& model, int64_t limit_bytes, double slack,
                        double time_budget) {
  return plan_fixed(input, limit_bytes, slack, time_budget, [&model](const StepPlan& p) {
    int64_t kept = 0;
    for (const CallPlan& c : p.calls) kept += c.kept_bytes;
    return std::function<int64_t(const std::vector<int64_t>&)>([&model, kept](const std::vector<int64_t>& ws) {
      return model.predict(kept, ws.empty() ? 0 : *std::max_element(ws.begin(), ws.end()));
    });
  });
}

}  // namespace tapesac::planner
