// Bindings of runtime/: the Runtime the Python front calls around each step, its plans as dicts (one loop over
// runtime/plan_info.h's field list), the AutoPlanner's debugging views, and pick_preservation. Registration only.
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/replay/session.h"
#include "tapesac/runtime/runtime.h"

namespace py = pybind11;

namespace tapesac::python {
namespace {

using python::to_py;  // the scalars (bindings.h), beside the overload below
using runtime::Runtime;

py::object to_py(const std::vector<runtime::CallPlanInfo>& calls) {
  py::list out;
  for (const runtime::CallPlanInfo& c : calls) {
    py::dict d;
    runtime::for_each_call_field(c, [&](const char* name, const auto& v) { d[name] = to_py(v); });
    out.append(d);
  }
  return out;
}

/// The plan as the dict TapeSAC.plan returns; without `calls` for TapeSAC.plans.
py::dict plan_to_dict(const runtime::PlanInfo& p, bool with_calls) {
  py::dict d;
  runtime::for_each_plan_field(p, [&](const char* name, const auto& v) {
    if (with_calls || std::string_view(name) != "calls") d[name] = to_py(v);
  });
  return d;
}

using TrialTuple = std::tuple<std::string, int64_t, double>;  // (mode, peak bytes, cost ms)

std::unique_ptr<Runtime> make_runtime(replay::Session& session, bool plan, int64_t memory_limit,
                                      const std::string& preserve, bool schedules, double schedule_budget) {
  runtime::RuntimeOptions o;
  o.plan = plan;
  o.schedules = schedules;
  o.planner.schedule_time_budget = schedule_budget;  // < 0: the least peak (plus AutoPlannerOptions' peak slack)
  o.memory_limit = memory_limit;
  o.preservation.policy = runtime::parse_preserve_policy(preserve);
  return std::make_unique<Runtime>(session, o);
}

void bind_runtime_results(py::class_<Runtime>& c) {
  c.def_property_readonly("plan",
                          [](const Runtime& r) -> py::object {
                            return r.plan() ? py::object(plan_to_dict(*r.plan(), true)) : py::none();
                          })
      .def_property_readonly("plans",
                             [](const Runtime& r) {
                               py::list out;
                               for (const runtime::PlanInfo& p : r.plans()) out.append(plan_to_dict(p, false));
                               return out;
                             })
      .def(
          "frontier",
          [](const Runtime& r, int points) {
            std::vector<std::tuple<int64_t, int64_t, double, int64_t>> out;
            for (const auto& p : r.frontier(points))
              out.emplace_back(p.limit_bytes, p.predicted_peak_bytes, p.replay_cost_ns, p.kept_bytes);
            return out;
          },
          py::arg("points") = 12, "(limit, predicted peak, predicted replay ns, kept bytes) per point")
      .def_property_readonly("preservation",
                             [](const Runtime& r) {
                               std::unordered_map<uintptr_t, std::string> out;
                               for (const auto& [key, choice] : r.preservation().choices())
                                 out[reinterpret_cast<uintptr_t>(key)] = runtime::preserve_choice_name(choice);
                               return out;
                             })
      .def_property_readonly("preservation_trials", [](const Runtime& r) {
        std::vector<std::tuple<std::string, int64_t, double, bool>> out;  // TrialTuple and whether it was measured
        for (const auto& t : r.preservation().trials())
          out.emplace_back(runtime::preserve_choice_name(t.mode), t.peak_bytes, t.cost_ms, t.measured);
        return out;
      });
}

std::string pick_preservation(const std::vector<TrialTuple>& trials, int64_t limit) {
  std::vector<runtime::PreservationTrial> ts;
  for (const auto& [mode, peak, cost] : trials) ts.push_back({runtime::parse_preserve_choice(mode), peak, cost});
  return runtime::preserve_choice_name(runtime::pick_preservation(ts, limit));
}

}  // namespace

void bind_runtime(py::module_& m) {
  py::class_<runtime::AutoPlanner>(m, "AutoPlanner")
      .def("dump_problem", &runtime::AutoPlanner::dump_problem, py::arg("index"))
      .def_property_readonly("observed_calls", &runtime::AutoPlanner::observed_calls);
  py::class_<Runtime> c(m, "Runtime");
  c.def(py::init(&make_runtime), py::arg("session"), py::arg("plan"), py::arg("memory_limit"),
        py::arg("preserve"), py::arg("schedules") = false, py::arg("schedule_budget") = -1.0,
        py::keep_alive<1, 2>())
      .def("before_step", py::overload_cast<>(&Runtime::before_step))
      .def("before_step", py::overload_cast<const std::vector<at::Tensor>&>(&Runtime::before_step), py::arg("params"))
      .def("after_step", &Runtime::after_step, py::arg("measured_peak_bytes"), py::arg("step"))
      .def("set_memory_limit", &Runtime::set_memory_limit, py::arg("bytes"))
      .def_property_readonly("memory_limit", &Runtime::memory_limit)
      .def_property_readonly("planner", &Runtime::planner, py::return_value_policy::reference_internal);
  bind_runtime_results(c);
  m.def("pick_preservation", &pick_preservation, py::arg("trials"), py::arg("limit"),
        "The preservation mode to keep from (mode, peak bytes, cost ms) trials; limit 0: none.");
}

}  // namespace tapesac::python
