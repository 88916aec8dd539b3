// Graph pruning, capturability checks, relaunch liveness and the graph replayer (see graph_prune.h).
#include "tapesac/replay/graph_prune.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace tapesac::replay {

using capture::can_disable;
using capture::kUnowned;
using capture::OpRecord;

const char* to_string(GraphFallback reason) {
  switch (reason) {
    case GraphFallback::kNone: return "none";
    case GraphFallback::kNoDevice: return "no_device";
    case GraphFallback::kCaptureInvalidated: return "capture_invalidated";
    case GraphFallback::kShapesChanged: return "shapes_changed";
    case GraphFallback::kMemoryNodes: return "memory_nodes";
    case GraphFallback::kConditionalNodes: return "conditional_nodes";
    case GraphFallback::kHostNodes: return "host_nodes";
    case GraphFallback::kNotPrunable: return "not_prunable";
    case GraphFallback::kOutputsLive: return "outputs_live";
    case GraphFallback::kNotInGraph: return "not_in_graph";
    case GraphFallback::kStagingConflict: return "staging_conflict";
    case GraphFallback::kRngMismatch: return "rng_mismatch";
    case GraphFallback::kUnsupportedArgs: return "unsupported_args";
    case GraphFallback::kGraphLimit: return "graph_limit";
    case GraphFallback::kMemoryLimit: return "memory_limit";
  }
  return "unknown";
}

namespace {

GraphVerdict refuse(GraphFallback reason, int32_t where, std::string detail) {
  GraphVerdict v;
  v.reason = reason;
  v.where = where;
  v.detail = std::move(detail);
  return v;
}

bool same_inputs(const OpRecord& a, const OpRecord& b) {
  if (a.inputs.size() != b.inputs.size()) return false;
  for (size_t i = 0; i < a.inputs.size(); ++i) {
    const auto& x = a.inputs[i];
    const auto& y = b.inputs[i];
    if (x.arg != y.arg || x.elem != y.elem || x.value != y.value || x.state != y.state || x.meta_only != y.meta_only) {
      return false;
    }
  }
  return true;
}

}  // namespace

GraphVerdict check_capturable(const GraphTopology& topo) {
  for (size_t i = 0; i < topo.node_count(); ++i) {
    const NodeKind k = topo.kinds[i];
    const auto n = static_cast<int32_t>(i);
    const std::string where = "node " + std::to_string(i) + " (" + capture::to_string(k) + ", op " +
                              std::to_string(i < topo.owner.size() ? topo.owner[i] : kUnowned) + ")";
    if (k == NodeKind::kMemAlloc || k == NodeKind::kMemFree) {
      return refuse(GraphFallback::kMemoryNodes, n,
                    where + ": graphs with memory nodes cannot be pruned safely; expected PyTorch's native caching "
                            "allocator, found a cudaMallocAsync allocation (PYTORCH_CUDA_ALLOC_CONF="
                            "backend:cudaMallocAsync?); the block replays eagerly");
    }
    if (k == NodeKind::kConditional) {
      return refuse(GraphFallback::kConditionalNodes, n,
                    where + ": conditional nodes (torch.cond under capture) are not supported; the block replays "
                            "eagerly");
    }
    if (k == NodeKind::kHost) {
      return refuse(GraphFallback::kHostNodes, n,
                    where + ": a host-function node would repeat its side effect at every launch; the block "
                            "replays eagerly");
    }
  }
  return {};
}

GraphVerdict compare_tapes(const Tape& warmup, const Tape& captured) {
  const auto& a = warmup.ops();
  const auto& b = captured.ops();
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const OpRecord& x = a[i];
    const OpRecord& y = b[i];
    const auto op = static_cast<int32_t>(i);
    if (x.kind != y.kind || x.flags != y.flags || !same_inputs(x, y) || x.outputs.size() != y.outputs.size()) {
      return refuse(GraphFallback::kShapesChanged, op,
                    "op " + std::to_string(i) + " differs between the warm-up and the capture (the block's op "
                    "sequence depends on data); the block replays eagerly");
    }
    for (size_t j = 0; j < x.outputs.size(); ++j) {
      const auto vx = x.outputs[j];
      const auto vy = y.outputs[j];
      if ((vx < 0) != (vy < 0)) {
        return refuse(GraphFallback::kShapesChanged, op, "op " + std::to_string(i) + " output " + std::to_string(j) +
                                                             " is defined in one run only");
      }
      if (vx >= 0 && !warmup.value(vx).meta.same_view(captured.value(vy).meta)) {
        return refuse(GraphFallback::kShapesChanged, op,
                      "op " + std::to_string(i) + " output " + std::to_string(j) +
                          " has another shape, stride or dtype under capture than at warm-up (data-dependent "
                          "shapes); the block replays eagerly");
      }
    }
  }
  if (a.size() != b.size()) {
    return refuse(GraphFallback::kShapesChanged, static_cast<int32_t>(n),
                  "the warm-up recorded " + std::to_string(a.size()) + " ops, the capture " +
                      std::to_string(b.size()) + " (the block's op sequence depends on data); the block replays "
                      "eagerly");
  }
  return {};
}

GraphPrune prune_graph(const Tape& tape, const GraphTopology& topo, const std::vector<OpIndex>& needed_ops) {
  const size_t n_ops = tape.ops().size();
  if (topo.owner.size() != topo.kinds.size()) {
    throw std::invalid_argument("prune_graph: topology has " + std::to_string(topo.kinds.size()) + " kinds but " +
                                std::to_string(topo.owner.size()) + " owners");
  }
  std::vector<uint8_t> needed(n_ops, 0);
  for (const OpIndex op : needed_ops) {
    if (op < 0 || static_cast<size_t>(op) >= n_ops) {
      throw std::invalid_argument("prune_graph: needed op " + std::to_string(op) + " is outside the tape (" +
                                  std::to_string(n_ops) + " ops)");
    }
    needed[static_cast<size_t>(op)] = 1;
  }
  GraphPrune out;
  out.enabled.assign(topo.node_count(), 1);
  for (size_t i = 0; i < topo.node_count(); ++i) {
    const OpIndex owner = topo.owner[i];
    if (owner == kUnowned) {
      ++out.enabled_nodes;
      continue;
    }
    if (owner < 0 || static_cast<size_t>(owner) >= n_ops) {
      throw std::invalid_argument("prune_graph: node " + std::to_string(i) + " is attributed to op " +
                                  std::to_string(owner) + ", outside the tape (" + std::to_string(n_ops) + " ops)");
    }
    if (needed[static_cast<size_t>(owner)]) {
      ++out.enabled_nodes;
      continue;
    }
    const NodeKind k = topo.kinds[i];
    if (can_disable(k)) {
      out.enabled[i] = 0;
      ++out.disabled_nodes;
      continue;
    }
    const OpRecord& rec = tape.op(owner);
    if (k != NodeKind::kEmpty && (rec.has(capture::kWritesExternal) || rec.has(capture::kNonReplayable))) {
      out.verdict = refuse(GraphFallback::kNotPrunable, static_cast<int32_t>(i),
                           "node " + std::to_string(i) + " (" + capture::to_string(k) + ") of op " +
                               std::to_string(owner) + " cannot be disabled, and that op must not run again (it "
                               "writes external state or is not replayable); the block replays eagerly");
      return out;
    }
    ++out.enabled_nodes;
    if (k != NodeKind::kEmpty) ++out.forced_nodes;
  }
  return out;
}

RelaunchGuard::RelaunchGuard(std::vector<int64_t> slot_bytes)
    : bytes_(std::move(slot_bytes)), live_(bytes_.size(), 0) {}

RelaunchGuard::Decision RelaunchGuard::before_launch(int64_t copy_budget_bytes) const {
  Decision d;
  for (size_t i = 0; i < live_.size(); ++i) {
    if (live_[i]) {
      d.live.push_back(i);
      d.live_bytes += bytes_[i];
    }
  }
  if (d.live.empty()) {
    d.action = Action::kLaunch;
  } else if (d.live_bytes <= copy_budget_bytes) {
    d.action = Action::kCopyLive;
  } else {
    d.action = Action::kFallBack;
  }
  return d;
}

void RelaunchGuard::launched() {
  live_.assign(bytes_.size(), 1);
  ++launches_;
}

void RelaunchGuard::released(size_t slot) { live_.at(slot) = 0; }

void RelaunchGuard::sync(const std::vector<uint8_t>& referenced) {
  if (referenced.size() != live_.size()) {
    throw std::invalid_argument("RelaunchGuard::sync: expected " + std::to_string(live_.size()) +
                                " referenced flags, got " + std::to_string(referenced.size()));
  }
  for (size_t i = 0; i < live_.size(); ++i) {
    if (!referenced[i]) live_[i] = 0;
  }
}

std::vector<size_t> inputs_to_stage(const std::vector<StaticInput>& captured, const std::vector<uint64_t>& ptrs,
                                    const std::vector<int64_t>& nbytes) {
  if (ptrs.size() != captured.size() || nbytes.size() != captured.size()) {
    throw std::invalid_argument("inputs_to_stage: the graph was captured with " + std::to_string(captured.size()) +
                                " inputs, got " + std::to_string(ptrs.size()) + " addresses and " +
                                std::to_string(nbytes.size()) + " sizes");
  }
  std::vector<size_t> out;
  for (size_t i = 0; i < captured.size(); ++i) {
    if (nbytes[i] != captured[i].nbytes) {
      throw std::invalid_argument("inputs_to_stage: input " + std::to_string(i) + " was captured with " +
                                  std::to_string(captured[i].nbytes) + " bytes, got " + std::to_string(nbytes[i]) +
                                  "; a new shape needs a new capture");
    }
    if (ptrs[i] != captured[i].captured_ptr) out.push_back(i);
  }
  return out;
}

GraphReplayer::GraphReplayer(const Tape& tape, ExecGraph& exec, std::vector<StaticInput> inputs,
                             std::vector<int64_t> output_bytes, Options options)
    : tape_(&tape), exec_(&exec), inputs_(std::move(inputs)), guard_(std::move(output_bytes)), options_(options) {
  const size_t n = exec.topology().node_count();
  applied_.resize(n);
  for (size_t i = 0; i < n; ++i) applied_[i] = exec.enabled(static_cast<NodeId>(i)) ? 1 : 0;
}

GraphReplayer::Result GraphReplayer::replay(const std::vector<OpIndex>& needed_ops,
                                            const std::vector<uint64_t>& input_ptrs,
                                            const std::vector<int64_t>& input_nbytes, Io& io) {
  Result r;
  GraphPrune pruned = prune_graph(*tape_, exec_->topology(), needed_ops);
  if (!pruned.ok()) {
    r.verdict = std::move(pruned.verdict);
    return r;
  }
  const RelaunchGuard::Decision d = guard_.before_launch(options_.copy_budget_bytes);
  if (d.action == RelaunchGuard::Action::kFallBack) {
    r.verdict = refuse(GraphFallback::kOutputsLive, static_cast<int32_t>(d.live.front()),
                       std::to_string(d.live.size()) + " output(s) of the previous launch (" +
                           std::to_string(d.live_bytes) + " bytes) are still referenced and exceed the copy budget "
                           "of " + std::to_string(options_.copy_budget_bytes) + " bytes; the block replays eagerly");
    return r;
  }
  // Validate inputs before touching anything, so a refused replay leaves the graph as it was.
  try {
    r.staged = inputs_to_stage(inputs_, input_ptrs, input_nbytes);
  } catch (const std::invalid_argument& e) {
    r.verdict = refuse(GraphFallback::kShapesChanged, -1, std::string(e.what()) + "; the block replays eagerly");
    return r;
  }
  for (const size_t slot : d.live) {
    io.copy_out(slot);
    guard_.released(slot);
    r.copied.push_back(slot);
  }
  for (size_t i = 0; i < pruned.enabled.size(); ++i) {
    if (pruned.enabled[i] != applied_[i]) {
      exec_->set_enabled(static_cast<NodeId>(i), pruned.enabled[i] != 0);
      applied_[i] = pruned.enabled[i];
      ++r.toggled;
    }
  }
  for (const size_t slot : r.staged) io.stage_input(slot);
  exec_->launch();
  guard_.launched();
  r.launched = true;
  r.enabled_nodes = pruned.enabled_nodes;
  return r;
}

}  // namespace tapesac::replay
