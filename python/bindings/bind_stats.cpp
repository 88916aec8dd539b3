// Bindings of the step's results: block statistics, the step summary and memory, execution records, preserved
// storages. Statistics are converted by one generic loop over their field list (Note [Statistics defined once] in
// replay/stats_fields.h); Python builds its dataclasses from block_stats_schema().
#include <type_traits>

#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/replay/session.h"

namespace py = pybind11;

namespace tapesac::python {
namespace {

using replay::Session;
using python::to_py;  // the scalars (bindings.h), beside the overload below

py::object to_py(const replay::OpTimes& v) {
  py::list out;  // (tape op, op name, ns)
  for (const replay::OpTime& t : v) out.append(py::make_tuple(t.op, t.name, t.ns));
  return out;
}

/// Every field of `s`; with `totals_only`, only the fields a step combines (sums or maxima).
py::dict block_stats_to_dict(const replay::BlockStats& s, bool totals_only = false) {
  py::dict d;
  replay::for_each_block_field(s, [&](const replay::FieldInfo& f, const auto& value) {
    if (!totals_only || f.combine != replay::Combine::kNone) d[f.name] = to_py(value);
  });
  return d;
}

/// Every field of `s` in schema order (block_stats_schema()): Python pairs them with the names it read once, so
/// a step does not build one key string per field per block call.
py::tuple block_stats_row(const replay::BlockStats& s) {
  std::vector<py::object> values;
  values.reserve(64);
  replay::for_each_block_field(s, [&](const replay::FieldInfo&, const auto& value) { values.push_back(to_py(value)); });
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = std::move(values[i]);
  return out;
}

py::dict summary_to_dict(const replay::StepSummary& s) {
  py::dict d;
  d["totals"] = block_stats_to_dict(s.totals, true);
  d["block_calls"] = s.block_calls;
  d["graph_fallback_reasons"] = s.graph_fallback_reasons;
  d["op_timing"] = s.op_timing;
  d["record_counts"] = s.record_counts;
  return d;
}

py::dict memory_to_dict(const replay::StepMemoryStats& m, bool with_timeline) {
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
  py::list timeline, spans;
  if (with_timeline) {
    for (const auto& p : m.timeline) timeline.append(py::make_tuple(p.t_ns, p.bytes, allocator::phase_name(p.phase)));
    for (const auto& sp : m.spans) spans.append(py::make_tuple(sp.kind, sp.block, sp.begin_ns, sp.end_ns));
  }
  d["timeline"] = timeline;
  d["spans"] = spans;
  return d;
}

py::dict record_to_dict(const replay::ReplayRecord& r) {
  py::dict d;
  d["block"] = r.block;
  d["value"] = r.value;
  d["op"] = r.op;
  d["status"] = r.status;
  d["bytes"] = r.bytes;
  d["time_ns"] = r.ns;
  d["replay"] = r.replay;
  d["detail"] = r.detail;
  return d;
}

py::dict preserved_to_dict(const replay::PreservedStorage& p) {
  py::dict d;
  d["storage"] = reinterpret_cast<uintptr_t>(p.key);
  d["mode"] = replay::preserve_mode_name(p.mode);
  d["nbytes"] = p.nbytes;
  d["writes"] = p.writes;
  d["held_bytes"] = p.held_bytes;
  d["save_ns"] = p.save_ns;
  d["restores"] = p.restores;
  d["restore_ns"] = p.restore_ns;
  return d;
}

template <class T, class F>
py::list to_list(const std::vector<T>& xs, F&& f) {
  py::list out;
  for (const T& x : xs) out.append(f(x));
  return out;
}

py::list block_stats_schema() {
  py::list out;  // (name, type, how a step combines it, doc)
  replay::for_each_block_field(replay::BlockStats{}, [&](const replay::FieldInfo& f, const auto&) {
    out.append(py::make_tuple(f.name, f.type, replay::combine_name(f.combine), f.doc));
  });
  return out;
}

}  // namespace

void bind_session_results(py::class_<Session>& c) {
  c.def("last_stats", [](const Session& s) { return to_list(s.last_stats(), [](const auto& b) {
           return block_stats_to_dict(b);
         }); })
      .def("last_stats_rows", [](const Session& s) { return to_list(s.last_stats(), block_stats_row); })
      .def("last_summary", [](const Session& s) { return summary_to_dict(s.last_summary()); })
      .def("last_replayed_by_name", [](const Session& s) { return s.last_replayed_by_name(); })
      .def("last_memory", [](const Session& s, bool timeline) { return memory_to_dict(s.last_memory(), timeline); },
           py::arg("timeline") = true)
      .def("last_records", [](const Session& s) { return to_list(s.last_records(), record_to_dict); })
      .def_property_readonly("last_record_count", [](const Session& s) { return s.last_records().size(); })
      .def("last_preserved", [](const Session& s) { return to_list(s.last_preserved(), preserved_to_dict); })
      .def(
          "set_preservation",
          [](Session& s, const std::unordered_map<uintptr_t, std::string>& modes, const std::vector<uintptr_t>& keep) {
            std::unordered_map<const void*, replay::PreserveMode> m;
            for (const auto& [key, mode] : modes) m[reinterpret_cast<const void*>(key)] = replay::parse_preserve(mode);
            std::unordered_set<const void*> k;
            for (uintptr_t key : keep) k.insert(reinterpret_cast<const void*>(key));
            s.set_preservation(std::move(m), std::move(k));
          },
          py::arg("modes"), py::arg("keep"),
          "Per storage (keys from last_preserved): 'regions'/'snapshots', and the storages whose dependents are "
          "kept instead.");
}

void bind_stats(py::module_& m) {
  m.def("block_stats_schema", &block_stats_schema,
        "The BlockStats fields as (name, type, combine, doc): type is 'int', 'bool', 'str' or 'op_times' ((op "
        "index, op name, ns) tuples); combine is how a step totals the field over its block calls: 'sum', 'max' or "
        "'' (per block call only); names ending in _ns are nanoseconds.");
}

}  // namespace tapesac::python
