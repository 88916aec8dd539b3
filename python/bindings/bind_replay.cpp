// Bindings of replay/: the step Session and the graph devices. The saved-tensor hooks are saved_hooks.cpp's,
// statistics are converted by bind_stats.cpp.
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/common/errors.h"
#include "tapesac/replay/graph_emulation.h"
#include "tapesac/replay/session.h"

namespace py = pybind11;

namespace tapesac::python {
namespace {

using replay::Session;
using replay::SessionOptions;

std::unique_ptr<Session> make_session(const std::string& policy, py::object save_op, bool check_versions,
                                      bool check_metadata, bool check_bytes, int64_t memory_limit,
                                      size_t timeline_points, py::object arena_pool, int arena_device,
                                      const std::string& preserve, std::shared_ptr<capture::GraphDevice> graph_device,
                                      int graph_warmup, size_t max_graphs, bool device_timing,
                                      const std::string& graph_timing) {
  SessionOptions o;
  o.policy = replay::parse_policy(policy);
  if (o.policy == replay::PolicyKind::kSaveOps) {
    TAPESAC_CHECK(!save_op.is_none(), kConfig, "policy 'save_ops' needs a save_op callable");
    o.save_op = [fn = py::function(save_op)](const std::string& name) {
      py::gil_scoped_acquire gil;
      return fn(name).cast<bool>();
    };
  }
  o.check_versions = check_versions;
  o.check_metadata = check_metadata;
  o.check_bytes = check_bytes;
  TAPESAC_CHECK(memory_limit >= 0, kConfig, "memory_limit must be >= 0 bytes (0: none), got ", memory_limit);
  o.memory_limit = memory_limit;
  o.timeline_points = timeline_points;
  o.preserve = replay::parse_preserve(preserve);
  if (!arena_pool.is_none()) {
    o.arena_pool_id = arena_pool.cast<capture::PoolId>();
    o.arena_device = arena_device;
  }
  TAPESAC_CHECK(graph_warmup >= 0, kConfig, "graph_warmup must be >= 0 replays, got ", graph_warmup);
  TAPESAC_CHECK(max_graphs >= 1, kConfig, "max_graphs must be >= 1, got ", max_graphs);
  o.graph_device = std::move(graph_device);
  o.graph.warmup = graph_warmup;
  o.graph.max_graphs = max_graphs;
  o.graph.time_launches = replay::parse_graph_timing(graph_timing);
  if (device_timing) o.op_timers = capture::device_op_timers(arena_device);  // CUDA device index
  return std::make_unique<Session>(std::move(o));
}

void bind_session_step(py::class_<Session>& c) {
  c.def("begin_step", &Session::begin_step, py::arg("params"))
      .def("end_step", &Session::end_step)
      .def_property_readonly("in_step", &Session::in_step)
      .def(
          "begin_block", [](Session& s, const std::string& name) { return s.begin_block(name) != nullptr; },
          py::arg("name"), "Opens a block call and starts recording; False when a block is already open (nested).")
      .def("end_block", &Session::end_block, py::arg("aborted") = false)
      .def("forwards_died", &Session::forwards_died)
      .def_property_readonly("block_open", [](const Session& s) { return s.current_block() != nullptr; })
      .def_property_readonly("backward_failed", &Session::backward_failed)
      .def("current_op_names",
           [](const Session& s) {
             auto b = s.current_block();
             return b ? b->op_names() : std::vector<std::string>{};
           })
      .def("shutdown", &Session::shutdown);
}

void bind_session_config(py::class_<Session>& c) {
  c.def("set_memory_limit", &Session::set_memory_limit, py::arg("bytes"))
      .def_property_readonly("memory_limit", [](const Session& s) { return s.options().memory_limit; })
      .def("set_graph_memory_limit", &Session::set_graph_memory_limit, py::arg("bytes"))
      .def_property_readonly("graph_count",
                             [](const Session& s) { return s.graph_cache() ? s.graph_cache()->graphs() : size_t{0}; })
      .def_property_readonly("graph_static_bytes",
                             [](const Session& s) { return s.graph_cache() ? s.graph_cache()->static_bytes() : 0; })
      .def_property_readonly("graph_pending_bytes",
                             [](const Session& s) { return s.graph_cache() ? s.graph_cache()->pending_bytes() : 0; })
      .def(
          "set_graph_capture",
          [](Session& s, bool enabled) {
            if (s.graph_cache()) s.graph_cache()->set_capture_enabled(enabled);
          },
          py::arg("enabled"))
      .def(
          "set_approx",
          [](Session& s, double fraction, const std::string& method, bool mlp, bool attn, uint64_t seed,
             bool reweight) { s.set_approx(replay::make_approx(fraction, method, mlp, attn, seed, reweight)); },
          py::arg("fraction"), py::arg("method"), py::arg("mlp") = true, py::arg("attn") = false, py::arg("seed") = 0,
          py::arg("reweight") = true)
      .def("clear_approx", [](Session& s) { s.set_approx(nullptr); })
      .def(
          "force_schedule", [](Session& s, const std::string& shape) { s.force_schedule(replay::parse_forced_schedule(shape)); },
          py::arg("shape"), "Every block call follows this replay schedule shape: 'none' (plans, else the default), "
          "'one_segment', 'hold_all' or 'lazy' (one segment per value, nothing held). Between steps.");
}

}  // namespace

void bind_replay(py::module_& m) {
  // Opaque: made by emulated_graph_device() here or cuda_graph_device() (CUDA builds), passed to Session.
  py::class_<capture::GraphDevice, std::shared_ptr<capture::GraphDevice>>(m, "GraphDevice")
      .def_property_readonly("name", [](const capture::GraphDevice& d) { return std::string(d.name()); });
  m.def(
      "emulated_graph_device",
      [](const std::optional<std::string>& bound) {
        return replay::make_emulated_graph_device(
            bound ? std::optional<c10::DeviceType>(c10::Device(*bound).type()) : std::nullopt);
      },
      py::arg("graph_device_type") = py::none(),
      "A graph device that emulates executable graphs with eager ops over static tensors (tests, any device); "
      "graph_device_type (\"cuda\", \"cpu\"): act as a graph bound to that device type (its device checks).");
  py::class_<Session> session(m, "Session");
  session.def(py::init(&make_session), py::arg("policy"), py::arg("save_op") = py::none(),
              py::arg("check_versions") = true, py::arg("check_metadata") = true, py::arg("check_bytes") = false,
              py::arg("memory_limit") = 0, py::arg("timeline_points") = 8192, py::arg("arena_pool") = py::none(),
              py::arg("arena_device") = 0, py::arg("preserve") = "regions", py::arg("graph_device") = nullptr,
              py::arg("graph_warmup") = 1, py::arg("max_graphs") = 8, py::arg("device_timing") = false,
              py::arg("graph_timing") = "first");
  bind_session_step(session);
  bind_saved_hooks(m, session);
  bind_session_config(session);
  bind_session_results(session);
}

}  // namespace tapesac::python
