// Bindings of replay/: the step Session and the saved-tensor pack/unpack functions handed to
// torch.autograd.graph.saved_tensors_hooks (one C++ call per saved tensor, no Python logic).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/capture/errors.h"
#include "tapesac/capture/recorder.h"
#include "tapesac/replay/graph_emulation.h"
#include "tapesac/replay/session.h"

namespace py = pybind11;

namespace tapesac::python {
namespace {

constexpr const char* kSlotCapsule = "tapesac.SavedSlot";

using replay::BlockCall;
using replay::PolicyKind;
using replay::Session;
using replay::SessionOptions;


py::dict stats_to_dict(const replay::BlockStats& s) {
  py::dict d;
  d["name"] = s.name;
  d["ops_recorded"] = s.ops_recorded;
  d["saved"] = s.saved;
  d["kept"] = s.kept;
  d["dropped"] = s.dropped;
  d["opaque"] = s.opaque;
  d["kept_bytes"] = s.kept_bytes;
  d["dropped_bytes"] = s.dropped_bytes;
  d["opaque_bytes"] = s.opaque_bytes;
  d["replays"] = s.replays;
  d["ops_replayed"] = s.ops_replayed;
  d["replay_ns"] = s.replay_ns;
  d["replayed_bytes"] = s.replayed_bytes;
  d["replay_peak_bytes"] = s.replay_peak_bytes;
  d["predicted_replay_bytes"] = s.predicted_replay_bytes;
  d["replay_pieces"] = s.replay_pieces;
  d["planned"] = s.planned;
  d["capture_error"] = s.capture_error;
  d["op_timing"] = s.op_timing;
  d["op_timing_note"] = s.op_timing_note;
  d["approx_mlp"] = s.approx.mlp_applied;
  d["approx_mlp_skipped"] = s.approx.mlp_skipped;
  d["approx_units_total"] = s.approx.units_total;
  d["approx_units_recomputed"] = s.approx.units_recomputed;
  d["approx_attn"] = s.approx.attn_applied;
  d["approx_attn_skipped"] = s.approx.attn_skipped;
  d["approx_heads_total"] = s.approx.heads_total;
  d["approx_heads_recomputed"] = s.approx.heads_recomputed;
  d["approx_kv_heads_total"] = s.approx.kv_heads_total;
  d["approx_kv_heads_recomputed"] = s.approx.kv_heads_recomputed;
  d["approx_kept_values"] = s.approx.kept_values;
  d["graph_replays"] = s.graph_replays;
  d["graph_captures"] = s.graph_captures;
  d["graph_warmups"] = s.graph_warmups;
  d["graph_fallbacks"] = s.graph_fallbacks;
  d["graph_fallback"] = s.graph_fallback;
  d["graph_detail"] = s.graph_detail;
  d["graph_staged_bytes"] = s.graph_staged_bytes;
  d["graph_nodes_enabled"] = s.graph_nodes_enabled;
  d["graph_nodes_disabled"] = s.graph_nodes_disabled;
  d["graph_timed_launches"] = s.graph_timed_launches;
  d["graph_timing"] = s.graph_timing;
  d["graph_timing_note"] = s.graph_timing_note;
  d["graph_device_ns"] = s.graph_device_ns;
  d["graph_unattributed_ns"] = s.graph_unattributed_ns;
  py::list op_times;  // (tape op, op name, ns) of the ops whose nodes ran in a timed launch
  for (size_t i = 0; i < s.graph_op_ns.size(); ++i) {
    if (s.graph_op_ns[i] <= 0) continue;
    op_times.append(py::make_tuple(i, i < s.graph_op_names.size() ? s.graph_op_names[i] : std::string(),
                                   s.graph_op_ns[i]));
  }
  d["graph_op_ns"] = op_times;
  return d;
}

py::dict memory_to_dict(const replay::StepMemoryStats& m, bool with_timeline = true) {
  py::dict d;
  d["baseline_bytes"] = m.baseline;
  d["total"] = gauge_to_dict(m.total);
  py::dict phases;
  for (int p = 0; p < allocator::kNumPhases; ++p) {
    phases[allocator::phase_name(static_cast<allocator::Phase>(p))] = gauge_to_dict(m.phases[static_cast<size_t>(p)]);
  }
  d["phases"] = phases;
  d["arena_shared_bytes"] = m.arena_shared;
  d["arena_separate_bytes"] = m.arena_separate;
  d["replay_pieces"] = m.replay_pieces;
  d["memory_limit"] = m.memory_limit;
  py::list timeline;
  if (with_timeline) {
    for (const auto& p : m.timeline) timeline.append(py::make_tuple(p.t_ns, p.bytes, allocator::phase_name(p.phase)));
  }
  d["timeline"] = timeline;
  py::list spans;
  if (with_timeline) {
    for (const auto& sp : m.spans) spans.append(py::make_tuple(sp.kind, sp.block, sp.begin_ns, sp.end_ns));
  }
  d["spans"] = spans;
  return d;
}

replay::LaunchTiming parse_graph_timing(const std::string& timing) {
  if (timing == "off") return replay::LaunchTiming::kOff;
  if (timing == "first") return replay::LaunchTiming::kFirst;
  if (timing == "every") return replay::LaunchTiming::kEvery;
  TAPESAC_CHECK(false, kConfig, "unknown graph_timing '", timing, "'; expected 'off', 'first' or 'every'");
  return replay::LaunchTiming::kOff;
}

replay::PreserveMode parse_preserve(const std::string& mode) {
  if (mode == "off") return replay::PreserveMode::kOff;
  if (mode == "regions") return replay::PreserveMode::kRegions;
  if (mode == "snapshots") return replay::PreserveMode::kSnapshots;
  TAPESAC_CHECK(false, kConfig, "unknown preservation '", mode, "'; expected 'off', 'regions' or 'snapshots'");
  return replay::PreserveMode::kOff;
}

}  // namespace

void bind_replay(py::module_& m) {
  // Opaque: made by emulated_graph_device() here or cuda_graph_device() (CUDA builds), passed to Session.
  py::class_<capture::GraphDevice, std::shared_ptr<capture::GraphDevice>>(m, "GraphDevice")
      .def_property_readonly("name", [](const capture::GraphDevice& d) { return std::string(d.name()); });
  m.def("emulated_graph_device", &replay::make_emulated_graph_device,
        "A graph device that emulates executable graphs with eager ops over static tensors (tests, any device).");
  py::class_<Session>(m, "Session")
      .def(py::init([](const std::string& policy, py::object save_op, bool check_versions, bool check_metadata,
                       bool check_bytes, int64_t memory_limit, size_t timeline_points, py::object arena_pool,
                       int arena_device, const std::string& preserve,
                       std::shared_ptr<capture::GraphDevice> graph_device, int graph_warmup, size_t max_graphs,
                       bool device_timing, const std::string& graph_timing) {
             SessionOptions o;
             if (policy == "none") {
               o.policy = PolicyKind::kNone;
             } else if (policy == "full") {
               o.policy = PolicyKind::kFull;
             } else if (policy == "save_ops") {
               o.policy = PolicyKind::kSaveOps;
               TAPESAC_CHECK(!save_op.is_none(), kConfig, "policy 'save_ops' needs a save_op callable");
               o.save_op = [fn = py::function(save_op)](const std::string& name) {
                 py::gil_scoped_acquire gil;
                 return fn(name).cast<bool>();
               };
             } else if (policy == "plan") {
               o.policy = PolicyKind::kPlan;
             } else {
               TAPESAC_CHECK(false, kConfig, "unknown policy '", policy,
                             "'; expected 'none', 'full', 'save_ops' or 'plan'");
             }
             o.check_versions = check_versions;
             o.check_metadata = check_metadata;
             o.check_bytes = check_bytes;
             TAPESAC_CHECK(memory_limit >= 0, kConfig, "memory_limit must be >= 0 bytes (0: none), got ", memory_limit);
             o.memory_limit = memory_limit;
             o.timeline_points = timeline_points;
             o.preserve = parse_preserve(preserve);
             if (!arena_pool.is_none()) {
               o.arena_pool_id = arena_pool.cast<std::pair<uint64_t, uint64_t>>();
               o.arena_device = arena_device;
             }
             TAPESAC_CHECK(graph_warmup >= 0, kConfig, "graph_warmup must be >= 0 replays, got ", graph_warmup);
             TAPESAC_CHECK(max_graphs >= 1, kConfig, "max_graphs must be >= 1, got ", max_graphs);
             o.graph_device = std::move(graph_device);
             o.graph.warmup = graph_warmup;
             o.graph.max_graphs = max_graphs;
             o.graph.time_launches = parse_graph_timing(graph_timing);
             if (device_timing) o.op_timers = capture::device_op_timers(arena_device);  // CUDA device index
             return std::make_unique<Session>(std::move(o));
           }),
           py::arg("policy"), py::arg("save_op") = py::none(), py::arg("check_versions") = true,
           py::arg("check_metadata") = true, py::arg("check_bytes") = false, py::arg("memory_limit") = 0,
           py::arg("timeline_points") = 8192, py::arg("arena_pool") = py::none(), py::arg("arena_device") = 0,
           py::arg("preserve") = "regions", py::arg("graph_device") = nullptr, py::arg("graph_warmup") = 1,
           py::arg("max_graphs") = 8, py::arg("device_timing") = false, py::arg("graph_timing") = "first")
      .def("set_memory_limit", &Session::set_memory_limit, py::arg("bytes"))
      .def("set_graph_memory_limit", &Session::set_graph_memory_limit, py::arg("bytes"))
      .def_property_readonly("graph_count",
                             [](const Session& s) { return s.graph_cache() ? s.graph_cache()->graphs() : size_t{0}; })
      .def_property_readonly("graph_static_bytes", [](const Session& s) {
        return s.graph_cache() ? s.graph_cache()->static_bytes() : int64_t{0};
      })
      .def_property_readonly("graph_pending_bytes", [](const Session& s) {
        return s.graph_cache() ? s.graph_cache()->pending_bytes() : int64_t{0};
      })
      .def(
          "set_graph_capture",
          [](Session& s, bool enabled) {
            if (s.graph_cache()) s.graph_cache()->set_capture_enabled(enabled);
          },
          py::arg("enabled"))
      .def(
          "set_approx",
          [](Session& s, double fraction, const std::string& method, bool mlp, bool attn, uint64_t seed,
             bool reweight) {
            TAPESAC_CHECK(fraction > 0 && fraction <= 1, kConfig, "approx fraction must be in (0, 1], got ", fraction);
            TAPESAC_CHECK(method == "sketch" || method == "greedy", kConfig,
                          "approx method must be 'sketch' or 'greedy', got '", method, "'");
            replay::ApproxOptions o;
            o.fraction = fraction;
            o.method = method == "greedy" ? replay::ApproxMethod::kGreedy : replay::ApproxMethod::kSketch;
            o.mlp = mlp;
            o.attn = attn;
            o.seed = seed;
            o.reweight = reweight;
            s.set_approx(std::make_shared<replay::Approx>(o));
          },
          py::arg("fraction"), py::arg("method"), py::arg("mlp") = true, py::arg("attn") = false, py::arg("seed") = 0,
          py::arg("reweight") = true)
      .def("clear_approx", [](Session& s) { s.set_approx(nullptr); })
      .def("shutdown", &Session::shutdown)
      .def_property_readonly("memory_limit", [](const Session& s) { return s.options().memory_limit; })
      .def("last_memory", [](const Session& s, bool timeline) { return memory_to_dict(s.last_memory(), timeline); },
           py::arg("timeline") = true)
      .def("begin_step", &Session::begin_step, py::arg("params"))
      .def("end_step", &Session::end_step)
      .def_property_readonly("in_step", &Session::in_step)
      .def("begin_block",
           [](Session& s, const std::string& name) { return s.begin_block(name) != nullptr; }, py::arg("name"),
           "Opens a block call and starts recording; False when a block is already open (nested).")
      .def("end_block", &Session::end_block)
      .def_property_readonly("block_open", [](const Session& s) { return s.current_block() != nullptr; })
      .def("current_op_names",
           [](const Session& s) {
             auto b = s.current_block();
             return b ? b->op_names() : std::vector<std::string>{};
           })
      .def(
          "pack",
          [](Session& s, const at::Tensor& t) -> py::object {
            auto block = s.current_block();
            if (block == nullptr) return py::cast(capture::detached_alias(t));
            // A capsule is the cheapest Python object with a destructor: autograd drops it with the graph node that
            // saved the tensor, which releases the slot.
            auto slot = std::make_unique<replay::SavedSlot>(block, block->pack(t));
            return py::capsule(slot.release(), kSlotCapsule, [](PyObject* capsule) {
              std::unique_ptr<replay::SavedSlot>(
                  static_cast<replay::SavedSlot*>(PyCapsule_GetPointer(capsule, kSlotCapsule)));
            });
          },
          py::arg("tensor"))
      .def(
          "unpack",
          [](Session& /*s*/, const py::object& obj) -> at::Tensor {
            if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
            TAPESAC_CHECK(PyCapsule_IsValid(obj.ptr(), kSlotCapsule), kGeneric,
                          "tapesac: unpack expected a tensor or a tapesac saved slot, got ",
                          py::str(py::type::of(obj)).cast<std::string>());
            const auto* slot = static_cast<const replay::SavedSlot*>(PyCapsule_GetPointer(obj.ptr(), kSlotCapsule));
            py::gil_scoped_release no_gil;  // replay may be long; Python dispatch modes re-take the GIL
            return slot->unpack();
          },
          py::arg("packed"))
      .def("last_stats",
           [](const Session& s) {
             py::list out;
             for (const auto& b : s.last_stats()) out.append(stats_to_dict(b));
             return out;
           })
      .def("last_replayed_by_name", [](const Session& s) { return s.last_replayed_by_name(); })
      .def("last_records",
           [](const Session& s) {
             py::list out;
             for (const auto& r : s.last_records()) {
               py::dict d;
               d["block"] = r.block;
               d["value"] = r.value;
               d["op"] = r.op;
               d["status"] = r.status;
               d["bytes"] = r.bytes;
               d["time_ns"] = r.ns;
               d["replay"] = r.replay;
               d["detail"] = r.detail;
               out.append(d);
             }
             return out;
           })
      .def("last_preserved",
           [](const Session& s) {
             py::list out;
             for (const auto& p : s.last_preserved()) {
               py::dict d;
               d["storage"] = reinterpret_cast<uintptr_t>(p.key);
               d["mode"] = replay::preserve_mode_name(p.mode);
               d["nbytes"] = p.nbytes;
               d["writes"] = p.writes;
               d["held_bytes"] = p.held_bytes;
               d["save_ns"] = p.save_ns;
               d["restores"] = p.restores;
               d["restore_ns"] = p.restore_ns;
               out.append(d);
             }
             return out;
           })
      .def(
          "set_preservation",
          [](Session& s, const std::unordered_map<uintptr_t, std::string>& modes, const std::vector<uintptr_t>& keep) {
            std::unordered_map<const void*, replay::PreserveMode> m;
            for (const auto& [key, mode] : modes) m[reinterpret_cast<const void*>(key)] = parse_preserve(mode);
            std::unordered_set<const void*> k;
            for (uintptr_t key : keep) k.insert(reinterpret_cast<const void*>(key));
            s.set_preservation(std::move(m), std::move(k));
          },
          py::arg("modes"), py::arg("keep"),
          "Per storage (keys from last_preserved): 'regions'/'snapshots', and the storages whose dependents are "
          "kept instead.");
}

}  // namespace tapesac::python
