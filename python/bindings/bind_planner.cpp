// Bindings of planner/: AutoPlanner wires a replay Session to the planner for policy "auto". It observes every
// block call's tape (problem + measured op costs, in C++ on the forward thread), plans the next steps under one
// memory limit from the last step's problems and its measured peak, and installs the plan in the session.
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>
#include <unordered_set>

#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/allocator/limit.h"
#include "tapesac/common/bytes.h"
#include "tapesac/common/errors.h"
#include "tapesac/planner/evaluate.h"
#include "tapesac/planner/from_tape.h"
#include "tapesac/planner/problem_io.h"
#include "tapesac/planner/step.h"
#include "tapesac/replay/session.h"

namespace py = pybind11;

namespace tapesac::python {
namespace {

std::string hex_signature(uint64_t s) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(s));
  return buf;
}

class AutoPlanner {
 public:
  explicit AutoPlanner(replay::Session& session) : session_(session) {
    session_.set_tape_observer([this](const replay::BlockTapeView& view) { observe(view); });
  }
  ~AutoPlanner() { session_.set_tape_observer(nullptr); }
  AutoPlanner(const AutoPlanner&) = delete;
  AutoPlanner& operator=(const AutoPlanner&) = delete;

  /// Forget the calls of the previous step (called when a step starts).
  void begin_step() { calls_.clear(); }

  py::dict plan(int64_t limit, int64_t measured_peak, bool sequence) {
    TAPESAC_CHECK(!calls_.empty(), kGeneric,
                  "tapesac: the planner has no measured step yet; run one `with sac.step():` first");
    const auto t0 = std::chrono::steady_clock::now();
    const Prepared prep = prepare();
    const planner::StepInput& input = prep.input;
    const planner::PeakModel model = planner::PeakModel::calibrate(measured_peak, prep.sum_kept, prep.max_ws);
    // The sequence model, calibrated on the last step whose every block call replayed (its memory profile is
    // complete); kept while the calls stay the same.
    const planner::SequencePeakModel seq =
        planner::SequencePeakModel::calibrate(step_profile(), prep.kept_ref, prep.ws_ref);
    if (seq.valid) {
      seq_ = seq;
    } else if (seq_.backward_c.size() != calls_.size()) {
      seq_ = planner::SequencePeakModel{};
    }
    const bool use_seq = sequence && seq_.valid;
    planner::StepPlan plan;
    try {
      plan = use_seq ? planner::plan_step(input, seq_, limit) : planner::plan_step(input, model, limit);
    } catch (const planner::InfeasibleLimitError& e) {
      throw Error(ErrorKind::kMemoryLimit,
                  "tapesac: memory_limit " + common::format_bytes(limit) + " (" + std::to_string(limit) +
                      " bytes) is below the smallest feasible step peak " +
                      common::format_bytes(e.smallest_feasible_bytes()) + " (" +
                      std::to_string(e.smallest_feasible_bytes()) +
                      " bytes: parameters, gradients and activations outside the blocks as measured in the first "
                      "step, plus the least every block must keep, plus one block's replay). Raise memory_limit to "
                      "at least " + std::to_string(e.smallest_feasible_bytes()) +
                      " bytes, or lower the batch size or sequence length.");
    }
    std::unordered_map<std::string, replay::BlockPlan> plans;
    py::list calls;
    for (size_t i = 0; i < calls_.size(); ++i) {
      const planner::CallPlan& cp = plan.calls[i];
      plans.emplace(calls_[i].name, replay::BlockPlan{calls_[i].signature, cp.keep});
      py::dict d;
      d["name"] = calls_[i].name;
      d["kept_bytes"] = cp.kept_bytes;
      d["working_set_bytes"] = cp.working_set_bytes;
      d["replay_cost_ns"] = cp.replay_cost_ns;
      int64_t kept = 0;
      for (uint8_t k : cp.keep) kept += k;
      d["kept_candidates"] = kept;
      d["candidates"] = static_cast<int64_t>(cp.keep.size());
      calls.append(d);
    }
    session_.set_plans(std::move(plans));
    last_model_ = model;
    last_input_ = input;
    last_used_seq_ = use_seq;
    py::dict out;
    out["limit"] = limit;
    out["predicted_peak_bytes"] = plan.predicted_peak_bytes;
    out["replay_cost_ns"] = plan.replay_cost_ns;
    out["replay_cost_lower_bound_ns"] = plan.replay_cost_lower_bound_ns;
    out["sum_kept_bytes"] = plan.sum_kept_bytes;
    out["max_working_set_bytes"] = plan.max_working_set_bytes;
    out["min_feasible_peak_bytes"] = plan.min_feasible_peak_bytes;
    out["keep_all_peak_bytes"] = plan.keep_all_peak_bytes;
    out["keeps_everything"] = plan.keeps_everything;
    out["baseline_bytes"] = model.baseline_bytes;
    out["model"] = use_seq ? "sequence" : "additive";
    out["model_calibrated_now"] = seq.valid;
    out["calls"] = calls;
    out["signatures"] = static_cast<int64_t>(input.frontiers.size());
    out["planning_ms"] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  /// The step-level frontier of the last step's problems with the op costs measured so far: (predicted peak,
  /// predicted replay cost) of the best plan at `points` limits spread between the smallest feasible peak and the
  /// keep-everything peak, under the peak model of the last plan.
  py::list frontier(int points) const {
    TAPESAC_CHECK(!last_input_.frontiers.empty() && !calls_.empty(), kGeneric,
                  "tapesac: no plan yet; frontier() needs policy='auto' and one finished step");
    const Prepared prep = prepare();
    const bool seq = last_used_seq_ && seq_.backward_c.size() == prep.input.calls.size();
    py::list out;
    auto plan_at = [&](int64_t limit) {
      return seq ? planner::plan_step(prep.input, seq_, limit) : planner::plan_step(prep.input, last_model_, limit);
    };
    const planner::StepPlan lo = plan_at(INT64_MAX);
    const int64_t hi_peak = lo.keep_all_peak_bytes;
    const int64_t lo_peak = lo.min_feasible_peak_bytes;
    const int n = std::max(points, 2);
    for (int k = 0; k < n; ++k) {
      const int64_t limit = lo_peak + (hi_peak - lo_peak) * k / (n - 1);
      const planner::StepPlan p = plan_at(limit);
      out.append(py::make_tuple(limit, p.predicted_peak_bytes, p.replay_cost_ns, p.sum_kept_bytes));
    }
    return out;
  }

  /// The last observed problem of the block call `index` in planner text format (for fixtures and debugging).
  std::string dump_problem(size_t index) const {
    TAPESAC_CHECK(index < calls_.size(), kConfig, "no block call ", index, " in the last step");
    planner::BlockProblem p = *calls_[index].problem;
    const auto costs = cost_model_.costs(p.signature);
    for (size_t i = 0; i < p.ops.size() && i < costs.size(); ++i) p.ops[i].cost_ns = costs[i];
    std::ostringstream os;
    planner::write_problem(os, p);
    return os.str();
  }

  size_t observed_calls() const { return calls_.size(); }

 private:
  struct Call {
    std::string name;
    uint64_t signature;
    std::shared_ptr<const planner::BlockProblem> problem;
    std::vector<uint8_t> kept;
  };

  /// The problems of the last step's calls with the op costs measured so far (medians over recent calls), the
  /// step input built from them, and what the plan that ran kept per call.
  struct Prepared {
    planner::StepInput input;
    std::vector<int64_t> kept_ref, ws_ref;
    int64_t sum_kept = 0;
    int64_t max_ws = 0;
  };
  Prepared prepare() const {
    Prepared out;
    std::vector<planner::BlockProblem> problems;
    problems.reserve(calls_.size());
    for (const Call& c : calls_) {
      planner::BlockProblem p = *c.problem;
      const std::vector<double> costs = cost_model_.costs(p.signature);
      for (size_t i = 0; i < p.ops.size() && i < costs.size(); ++i) p.ops[i].cost_ns = costs[i];
      out.kept_ref.push_back(planner::kept_bytes(p, c.kept));
      out.ws_ref.push_back(planner::replay_working_set_bytes(p, c.kept));
      out.sum_kept += out.kept_ref.back();
      out.max_ws = std::max(out.max_ws, out.ws_ref.back());
      problems.push_back(std::move(p));
    }
    std::vector<const planner::BlockProblem*> ptrs;
    for (const auto& p : problems) ptrs.push_back(&p);
    out.input = planner::build_step_input(ptrs);
    return out;
  }

  /// The memory profile of the session's last step for the observed calls (invalid when a call did not replay or
  /// two calls share a name).
  planner::StepProfile step_profile() const {
    const replay::StepMemoryStats& m = session_.last_memory();
    std::unordered_map<std::string, int64_t> first_replay;
    std::unordered_map<std::string, std::pair<int64_t, int64_t>> forward;
    for (const replay::TimelineSpan& sp : m.spans) {
      if (sp.kind == "forward") {
        if (!forward.emplace(sp.block, std::make_pair(sp.begin_ns, sp.end_ns)).second) return {};
        continue;
      }
      if (sp.kind != "replay") continue;
      auto [it, inserted] = first_replay.emplace(sp.block, sp.begin_ns);
      if (!inserted) it->second = std::min(it->second, sp.begin_ns);
    }
    std::vector<int64_t> starts, fwd_begin, fwd_end;
    std::unordered_set<std::string> names;
    for (const Call& c : calls_) {
      if (!names.insert(c.name).second) return {};
      auto it = first_replay.find(c.name);
      starts.push_back(it == first_replay.end() ? -1 : it->second);
      auto f = forward.find(c.name);
      if (f == forward.end()) return {};
      fwd_begin.push_back(f->second.first);
      fwd_end.push_back(f->second.second);
    }
    std::vector<planner::TimedBytes> timeline;
    timeline.reserve(m.timeline.size());
    for (const auto& p : m.timeline) timeline.push_back(planner::TimedBytes{p.t_ns, p.bytes});
    return planner::profile_step(timeline, fwd_begin, fwd_end, starts, m.baseline);
  }

  void observe(const replay::BlockTapeView& v) {
    const std::string sig = hex_signature(v.signature);
    cost_model_.observe(sig, planner::measured_costs(v.tape));
    auto it = problems_.find(sig);
    if (it == problems_.end()) {
      if (problems_.size() > 256) problems_.clear();  // bounded: signatures change with shapes
      auto p = std::make_shared<const planner::BlockProblem>(planner::problem_from_tape(
          v.tape, v.candidates, v.must_keep, std::vector<double>(v.tape.ops().size(), 0.0), sig));
      it = problems_.emplace(sig, std::move(p)).first;
    }
    calls_.push_back(Call{v.name, v.signature, it->second, v.kept});
  }

  replay::Session& session_;
  planner::CostModel cost_model_;
  std::unordered_map<std::string, std::shared_ptr<const planner::BlockProblem>> problems_;
  std::vector<Call> calls_;
  planner::PeakModel last_model_;
  planner::SequencePeakModel seq_;
  bool last_used_seq_ = false;
  planner::StepInput last_input_;
};

}  // namespace

void bind_planner(py::module_& m) {
  py::class_<AutoPlanner>(m, "AutoPlanner")
      .def(py::init<replay::Session&>(), py::arg("session"), py::keep_alive<1, 2>())
      .def("begin_step", &AutoPlanner::begin_step)
      .def("plan", &AutoPlanner::plan, py::arg("limit"), py::arg("measured_peak"), py::arg("sequence") = true)
      .def("frontier", &AutoPlanner::frontier, py::arg("points") = 12)
      .def("dump_problem", &AutoPlanner::dump_problem, py::arg("index"))
      .def_property_readonly("observed_calls", &AutoPlanner::observed_calls);
}

}  // namespace tapesac::python
