// The session's graph replayer (see graph_block.h).
#include "tapesac/replay/graph_block.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>

#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/fnv.h"
#include "tapesac/replay/eager_replayer.h"

namespace tapesac::replay {
namespace {

using capture::ArgRef;
using capture::OpFlag;
using capture::OpPayload;
using capture::ValueId;

uint64_t bits_of(double d) {
  uint64_t u = 0;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

/// Hashes one constant argument; false for kinds that cannot be compared by value.
bool hash_ivalue(const c10::IValue& v, common::Fnv64& h) {
  h.mix(static_cast<uint64_t>(v.tagKind().size()));
  if (v.isNone()) {
    h.mix(0);
  } else if (v.isBool()) {
    h.mix(1);
    h.mix(v.toBool() ? 1 : 0);
  } else if (v.isInt()) {
    h.mix(2);
    h.mix(static_cast<uint64_t>(v.toInt()));
  } else if (v.isDouble()) {
    h.mix(3);
    h.mix(bits_of(v.toDouble()));
  } else if (v.isComplexDouble()) {
    h.mix(4);
    const c10::complex<double> c = v.toComplexDouble();
    h.mix(bits_of(c.real()));
    h.mix(bits_of(c.imag()));
  } else if (v.isSymInt()) {
    const auto i = v.toSymInt().maybe_as_int();
    if (!i) return false;
    h.mix(2);
    h.mix(static_cast<uint64_t>(*i));
  } else if (v.isSymFloat()) {
    const c10::SymFloat f = v.toSymFloat();
    if (f.is_symbolic()) return false;
    h.mix(3);
    h.mix(bits_of(f.as_float_unchecked()));
  } else if (v.isString()) {
    h.mix(5);
    h.mix_bytes(v.toStringRef());
  } else if (v.isDevice()) {
    h.mix(6);
    h.mix(static_cast<uint64_t>(v.toDevice().type()));
    h.mix(static_cast<uint64_t>(static_cast<int64_t>(v.toDevice().index())));
  } else if (v.isGenerator()) {
    h.mix(7);  // which numbers it draws is the RNG check's business (GraphDevice::before_launch)
  } else if (v.isList()) {
    h.mix(8);
    const auto list = v.toListRef();
    h.mix(list.size());
    for (const c10::IValue& e : list) {
      if (!hash_ivalue(e, h)) return false;
    }
  } else if (v.isTuple()) {
    h.mix(9);
    const auto& elems = v.toTupleRef().elements();
    h.mix(elems.size());
    for (const c10::IValue& e : elems) {
      if (!hash_ivalue(e, h)) return false;
    }
  } else {
    return false;  // tensors (never left in a payload), objects, capsules, futures, ...
  }
  return true;
}

/// Stages `src` into `dst`. Dimensions of stride 0 (expanded views) are copied once. False (nothing copied) when
/// the sizes or dtypes differ (the live tensor was replaced by another shape) or `dst` overlaps itself otherwise.
bool stage_into(capture::GraphDevice& device, at::Tensor dst, at::Tensor src) {
  if (!dst.sizes().equals(src.sizes()) || dst.scalar_type() != src.scalar_type()) return false;
  // Below autograd: a static buffer must never join the autograd graph (a backward with create_graph runs with grad
  // mode on) nor have its version bumped.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (int64_t d = dst.dim() - 1; d >= 0; --d) {
    if (dst.stride(d) == 0 && dst.size(d) > 1) {
      if (src.stride(d) != 0) return false;
      dst = dst.select(d, 0);
      src = src.select(d, 0);
    }
  }
  if (at::has_internal_overlap(dst) == at::MemOverlap::Yes) return false;
  device.stage(dst, src);
  return true;
}

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) &&
         a.scalar_type() == b.scalar_type();
}

// Note [Handed-out storages]. A launch hands its replayed values out as tensors over the static memory, and the next
// launch that writes that memory must know whether any of them is still in use (Note [Static memory]): autograd may
// hold one (a double backward's graph saves what the first backward unpacked), a later segment of the same block
// call holds what it reads, and views of them hold only their storage. So each launch hands out its tensors through
// a storage of its own per static storage, over the same bytes (the static storage kept alive by the data pointer's
// context), and a handed-out value is in use exactly while that storage is. Comparing the static storage's
// reference count with a baseline taken at capture missed uses: the baseline counted references held only during
// the capture (the staged inputs), so a view handed out later brought the count back to it and the next launch
// overwrote bytes autograd was about to read (random program 3025, double backward, silently wrong gradients).
class HandOut {
 public:
  // A tensor over `t`'s bytes, its storage shared with this hand-out's other tensors over the same static storage.
  at::Tensor alias(const at::Tensor& t) {
    const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
    auto it = storages_.find(key);
    if (it == storages_.end()) it = storages_.emplace(key, own_storage(t.storage())).first;
    at::Tensor out = at::empty({0}, t.options());
    out.set_(it->second, t.storage_offset(), t.sizes(), t.strides());
    out._set_conj(t.is_conj());  // the view's lazy bits travel with it (a saved conj() or its .imag: a neg view)
    out._set_neg(t.is_neg());
    return out;
  }

 private:
  static c10::Storage own_storage(const c10::Storage& static_storage) {
    auto* keep = new c10::Storage(static_storage);
    void* data = const_cast<void*>(static_storage.data());
    c10::DataPtr ptr(data, keep, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); },
                     static_storage.device());
    return c10::Storage(c10::Storage::use_byte_size_t(), static_storage.nbytes(), std::move(ptr),
                        /*allocator=*/nullptr, /*resizable=*/false);
  }

  std::unordered_map<const c10::StorageImpl*, c10::Storage> storages_;
};

std::string describe_value(const capture::Tape& tape, ValueId v) {
  const OpIndex p = tape.value(v).producer;
  return p == capture::kExternal ? std::string("a block input")
                                 : "output of op #" + std::to_string(p) + " " + capture::op_kind_name(tape.op(p).kind);
}

// Records why this replay goes eager; returns false for the caller to return.
bool refuse(GraphReplayOutcome& out, GraphFallback reason, std::string detail) {
  out.reason = reason;
  out.detail = std::move(detail);
  return false;
}

// What a capture of `graph_ops` will hold: every storage a captured op creates, and a static buffer per value it
// reads live.
int64_t capture_bytes(const capture::Tape& tape, const std::vector<OpIndex>& graph_ops,
                      const std::vector<uint8_t>& capture_live) {
  int64_t bytes = 0;
  for (OpIndex i : graph_ops) {
    for (capture::StorageId s : tape.op(i).writes) {
      const capture::StorageInfo& st = tape.storage(s);
      if (!st.external && !st.writers.empty() && st.writers[0] == i) bytes += st.nbytes;
    }
  }
  for (size_t v = 0; v < capture_live.size(); ++v) {
    if (capture_live[v]) bytes += tape.values()[v].meta.nbytes;
  }
  return bytes;
}

// Static inputs of a capture, by ValueId, from the forward's metadata (the call may no longer hold the tensors its
// plan does not read).
std::vector<at::Tensor> static_inputs(const capture::Tape& tape, const std::vector<uint8_t>& capture_live) {
  std::vector<at::Tensor> inputs(tape.values().size());
  for (size_t v = 0; v < capture_live.size(); ++v) {
    if (!capture_live[v]) continue;
    const capture::TensorMeta& m = tape.values()[v].meta;
    const auto options = at::TensorOptions()
                             .dtype(static_cast<c10::ScalarType>(m.dtype))
                             .device(c10::Device(static_cast<c10::DeviceType>(m.device_type),
                                                 static_cast<c10::DeviceIndex>(m.device_index)));
    // At the forward's storage offset: a kernel's path (and its rounding) can depend on where its data starts
    // relative to the allocator's alignment — a BLAS call on a slice of a larger tensor, staged into a buffer at
    // offset 0, gave other last bits than the forward (random program 1651). Allocations share one alignment, so the
    // same offset into a fresh storage puts the data at the same alignment.
    const at::Tensor base = at::empty_strided(m.sizes.vec(), m.strides.vec(), options);
    const int64_t elems = static_cast<int64_t>(base.storage().nbytes()) / base.element_size() + m.storage_offset;
    at::Tensor storage = at::empty({elems}, options);
    storage.zero_();  // zeros, not garbage: the emulation runs the capture (an index read from garbage would fault)
    inputs[v] = storage.as_strided(m.sizes.vec(), m.strides.vec(), m.storage_offset);
  }
  return inputs;
}

// Tells the device each op a capture run executes (it attributes graph nodes to tape ops).
class DeviceForwarder final : public ReplayObserver {
 public:
  explicit DeviceForwarder(capture::GraphDevice& d) : d_(d) {}
  void after_op(OpIndex op, const std::vector<c10::IValue>& args, const std::vector<at::Tensor>& outs) override {
    d_.after_op(op, args, outs);
  }

 private:
  capture::GraphDevice& d_;
};

// Runs `graph_ops` of `call` under capture on `device`, reading `inputs` (by ValueId) for the values in
// `capture_live`; `env` receives every tensor the run made. Null, with `error` set, when the run or the capture
// failed (the capture is then abandoned).
std::unique_ptr<capture::ExecGraph> capture_ops(capture::GraphDevice& device, const GraphCall& call,
                                                const std::vector<OpIndex>& graph_ops,
                                                const std::vector<at::Tensor>& inputs,
                                                const std::vector<uint8_t>& capture_live,
                                                std::vector<at::Tensor>& env, std::string& error) {
  DeviceForwarder forward(device);
  ReplaySource src;
  src.tape = call.tape;
  src.payloads = call.payloads;
  src.live = &inputs;
  src.available = &capture_live;
  ReplayOptions ro;
  ro.set_rng = device.capture_executes();
  ro.check_device = false;  // check_captured_outputs() after the capture (Note [Host tensors under capture])
  ro.observer = &forward;
  bool began = false;
  try {
    device.begin_capture();
    began = true;
    env = run_ops(src, graph_ops, ro);
  } catch (const std::exception& ex) {
    if (began) device.abort_capture();
    error = ex.what();
  }
  if (!error.empty()) return nullptr;
  return device.end_capture(&error);
}

// Note [Graph RNG] (capture/cuda/graph_device.cpp): a launch gives the graph's random ops the forward's first
// offset plus their offsets within the graph. A random op left out of the graph but drawing between two of its
// random ops made the forward's later offsets larger than the graph's, and the offset check cannot see it (the
// captured call's deltas include it too): such a key is never captured. Returns why, or "" when no such op exists.
std::string random_op_left_out(const capture::Tape& tape, const std::vector<OpIndex>& graph_ops,
                               const std::vector<uint8_t>& tainted) {
  OpIndex first = -1, last = -1;
  for (OpIndex i : graph_ops) {
    if (!tape.op(i).has(OpFlag::kRandom)) continue;
    if (first < 0) first = i;
    last = i;
  }
  for (OpIndex i = first + 1; first >= 0 && i < last; ++i) {
    if (tainted[static_cast<size_t>(i)] && tape.op(i).has(OpFlag::kRandom)) {
      return "random op #" + std::to_string(i) + " (" + capture::op_kind_name(tape.op(i).kind) +
             ") cannot be in the graph but draws between its random ops #" + std::to_string(first) + " and #" +
             std::to_string(last) + ": the graph's offsets would skip its draws";
    }
  }
  return {};
}

}  // namespace

std::vector<uint8_t> tainted_ops(const capture::Tape& tape, const std::vector<uint8_t>& available,
                                 std::vector<uint8_t>* capture_live) {
  const size_t nvalues = tape.values().size();
  const size_t nops = tape.ops().size();
  std::vector<uint8_t> tainted(nops, 0), tainted_value(nvalues, 0), live(nvalues, 0);
  for (size_t v = 0; v < nvalues; ++v) {
    if (tape.values()[v].producer == capture::kExternal) live[v] = 1;
  }
  for (size_t i = 0; i < nops; ++i) {
    const capture::OpRecord& op = tape.ops()[i];
    bool bad = op.has(OpFlag::kNonReplayable) || op.has(OpFlag::kWritesExternal);
    for (size_t k = 0; !bad && k < op.inputs.size(); ++k) {
      const ArgRef& a = op.inputs[k];
      const ReadSource src = classify_read(tape, live, a.value, a.state, a.meta_only);
      if (src == ReadSource::kFail) {
        bad = true;
      } else if (src == ReadSource::kReplay) {
        if (tainted_value[static_cast<size_t>(a.value)]) {
          bad = true;
        } else {
          const capture::StorageInfo& st = tape.storage(tape.value(a.value).storage);
          for (int32_t w = 0; w < a.state && w < st.final_state(); ++w) {
            if (tainted[static_cast<size_t>(st.writers[static_cast<size_t>(w)])]) bad = true;
          }
        }
      }
    }
    if (!bad) continue;
    tainted[i] = 1;
    for (ValueId v : op.outputs) {
      if (v < 0) continue;
      tainted_value[static_cast<size_t>(v)] = 1;
      // A kept result of a tainted op is read from a static buffer, like an input.
      if (static_cast<size_t>(v) < available.size() && available[static_cast<size_t>(v)]) live[static_cast<size_t>(v)] = 1;
    }
  }
  if (capture_live != nullptr) {
    capture_live->assign(nvalues, 0);
    for (size_t i = 0; i < nops; ++i) {
      if (tainted[i]) continue;
      for (const ArgRef& a : tape.ops()[i].inputs) {
        if (classify_read(tape, live, a.value, a.state, a.meta_only) == ReadSource::kLive) {
          (*capture_live)[static_cast<size_t>(a.value)] = 1;
        }
      }
    }
  }
  return tainted;
}

std::string host_tensor_read(const capture::Tape& tape, const std::vector<OpIndex>& graph_ops,
                             std::optional<c10::DeviceType> bound, int device_index) {
  for (OpIndex i : graph_ops) {
    // meta_of() records strides for strided tensors only. A sparse input crashed the capture's static buffers with
    // torch's untyped error in the backward, every step (a helper's finding, emulated graph; the CUDA path shares it).
    auto non_strided = [&](ValueId v, const char* how) {
      return "op #" + std::to_string(i) + " " + capture::op_kind_name(tape.op(i).kind) + " " + how + " v" +
             std::to_string(v) + " (" + describe_value(tape, v) +
             "), a tensor without strides (sparse or another non-strided layout), which a graph's static buffers "
             "cannot hold";
    };
    for (ValueId v : tape.op(i).outputs) {
      if (v >= 0 && tape.value(v).meta.strides.size() != tape.value(v).meta.sizes.size()) return non_strided(v, "makes");
    }
    for (const ArgRef& a : tape.op(i).inputs) {
      const capture::TensorMeta& m = tape.value(a.value).meta;
      if (m.strides.size() != m.sizes.size()) return non_strided(a.value, "reads");
      if (!bound.has_value()) continue;
      const c10::DeviceType graph_device = *bound;
      if (static_cast<c10::DeviceType>(m.device_type) == graph_device &&
          (device_index < 0 || m.device_index == device_index)) {
        continue;
      }
      if (static_cast<c10::DeviceType>(m.device_type) == graph_device) {
        return "op #" + std::to_string(i) + " " + capture::op_kind_name(tape.op(i).kind) + " reads v" +
               std::to_string(a.value) + " (" + describe_value(tape, a.value) + ", on " + device_of(m).str() +
               "); the graph is captured on " + c10::Device(graph_device, static_cast<c10::DeviceIndex>(device_index)).str() +
               ", whose stream would not see that device's kernels";
      }
      return "op #" + std::to_string(i) + " " + capture::op_kind_name(tape.op(i).kind) + " reads v" +
             std::to_string(a.value) + " (" + describe_value(tape, a.value) + (m.sizes.empty() ? ", a 0-dim" : ", a") +
             " tensor on " + device_of(m).str() + "); a " + c10::DeviceTypeName(graph_device, true) +
             " graph would bake the value it saw at capture into every launch";
    }
  }
  return {};
}

std::string check_captured_outputs(const capture::Tape& tape, const std::vector<OpIndex>& graph_ops,
                                   const std::vector<at::Tensor>& env, std::optional<c10::DeviceType> graph_device,
                                   std::vector<uint8_t>* copy_out, GraphFallback* reason) {
  copy_out->assign(tape.values().size(), 0);
  for (OpIndex i : graph_ops) {
    for (ValueId v : tape.op(i).outputs) {
      if (v < 0 || static_cast<size_t>(v) >= env.size() || !env[static_cast<size_t>(v)].defined()) continue;
      const at::Tensor& t = env[static_cast<size_t>(v)];
      const capture::TensorMeta& m = tape.value(v).meta;
      const std::string what = "output v" + std::to_string(v) + " of op #" + std::to_string(i) + " " +
                               capture::op_kind_name(tape.op(i).kind);
      if (static_cast<int16_t>(t.scalar_type()) != m.dtype || !same_layout(m, t)) {
        *reason = GraphFallback::kOutputMismatch;
        return what + " was captured as " + std::string(c10::toString(t.scalar_type())) + " " +
               c10::str(t.layout()) + ", the forward made " +
               std::string(c10::toString(static_cast<c10::ScalarType>(m.dtype))) +
               (m.strides.size() == m.sizes.size() ? " strided" : " non-strided");
      }
      if (!m.sizes.equals(t.sizes()) || (t.layout() == c10::kStrided && !m.strides.equals(t.strides()))) {
        // The static tensor changed shape after its op ran: a later op of the block resized its storage during the
        // capture (torch.empty(shape, out=buf) over a zeros(0) buffer). A launch would re-run the op into a static
        // tensor of another shape; eager replay runs the block as the forward did (random program 977).
        *reason = GraphFallback::kOutputMismatch;
        return what + " is " + c10::str(t.sizes()) + " after the capture, the forward made it " +
               c10::str(m.sizes.vec()) + ": a later op of the block resized it";
      }
      if (!graph_device || same_device(m, t)) {
        if (graph_device && t.device().type() != *graph_device) {
          *reason = GraphFallback::kHostTensors;
          return what + " is on " + t.device().str() + ": the op ran on the host once, during the capture";
        }
        continue;
      }
      if (t.device().type() != *graph_device) {
        *reason = GraphFallback::kHostTensors;
        return what + " was made on " + t.device().str() + " under capture (the forward: " + device_of(m).str() +
               "): the op ran on the host once, during the capture";
      }
      (*copy_out)[static_cast<size_t>(v)] = 1;  // e.g. a philox seed: on the graph's device, handed out as a copy
    }
  }
  return {};
}

std::vector<uint8_t> values_over_freed(const capture::Tape& tape, const std::vector<OpIndex>& graph_ops,
                                       const std::vector<at::Tensor>& env,
                                       const std::vector<capture::AddressRange>& freed) {
  std::vector<uint8_t> over(tape.values().size(), 0);
  if (freed.empty()) return over;
  for (OpIndex i : graph_ops) {
    for (ValueId v : tape.op(i).outputs) {
      if (v < 0 || static_cast<size_t>(v) >= env.size() || !env[static_cast<size_t>(v)].defined()) continue;
      const c10::Storage& st = env[static_cast<size_t>(v)].storage();
      const auto begin = reinterpret_cast<uintptr_t>(st.data());
      const uintptr_t end = begin + st.nbytes();
      if (begin == 0 || end == begin) continue;
      for (const capture::AddressRange& r : freed) {
        if (r.begin < end && begin < r.begin + r.bytes) over[static_cast<size_t>(v)] = 1;
      }
    }
  }
  return over;
}

bool hash_constants(const std::vector<OpPayload>& payloads, const std::vector<OpIndex>& ops, uint64_t* hash) {
  common::Fnv64 h;
  for (OpIndex i : ops) {
    const OpPayload& p = payloads.at(static_cast<size_t>(i));
    h.mix(static_cast<uint64_t>(i));
    h.mix(p.args.size());
    for (const c10::IValue& v : p.args) {
      if (!hash_ivalue(v, h)) return false;
    }
  }
  *hash = h.value();
  return true;
}

// One key's graph: the warm-up count or the failure, then the captured executable with its static tensors.
struct GraphCache::Entry {
  int eager = 0;
  GraphFallback failed = GraphFallback::kNone;
  std::string failed_detail;
  std::unique_ptr<capture::ExecGraph> exec;
  std::vector<uint8_t> in_graph;  // by OpIndex
  std::vector<OpIndex> ops;       // the captured ops, ascending
  std::vector<uint8_t> capture_live;
  std::vector<at::Tensor> statics;  // by ValueId
  std::vector<OpIndex> random_ops;
  std::vector<OpPayload> payloads;  // of the block call the graph was captured from
  std::vector<uint8_t> applied;     // the node mask the executable has now
  struct Handed {
    ValueId value;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // Note [Handed-out storages]
  };
  std::vector<Handed> handed;       // values earlier launches handed out, while in use
  std::vector<uint8_t> copy_out;    // by ValueId: handed out as a copy on the forward's device (check_captured_outputs)
  std::vector<uint8_t> unstageable;  // by ValueId: static storage over memory the capture freed (values_over_freed)
  int64_t bytes = 0;
  bool timing_asked = false;        // a timer was asked for a launch (LaunchTiming::kFirst: only the first)

  static bool referenced(const Handed& h) { return !h.storage.expired(); }

  // Takes a successful capture: the executable, what it ran and every tensor it made (`env`, by ValueId).
  void adopt(std::unique_ptr<capture::ExecGraph> graph, const capture::Tape& tape,
             const std::vector<OpIndex>& graph_ops, const std::vector<uint8_t>& live, std::vector<at::Tensor> env,
             const std::vector<OpPayload>& call_payloads) {
    exec = std::move(graph);
    ops = graph_ops;
    in_graph.assign(tape.ops().size(), 0);
    for (OpIndex i : graph_ops) {
      in_graph[static_cast<size_t>(i)] = 1;
      if (tape.op(i).has(OpFlag::kRandom)) random_ops.push_back(i);
    }
    capture_live = live;
    statics = std::move(env);
    payloads = call_payloads;
    applied.assign(exec->topology().node_count(), 1);
  }

  // Every op of `plan` was captured; `stage_list` receives the live values they read (to stage before the launch),
  // `needed` the plan's ops and `written` (per storage) what they write. False with the reason in `out` when an op was not captured, or a value to stage has
  // no static buffer or its storage is written by the replay.
  bool stage_list_for(const GraphCall& call, const PruneResult& plan, std::vector<uint8_t>& needed,
                      std::vector<uint8_t>& written, std::vector<ValueId>& stage_list, GraphReplayOutcome& out) const {
    const capture::Tape& tape = *call.tape;
    needed.assign(tape.ops().size(), 0);
    written.assign(tape.storages().size(), 0);
    for (OpIndex i : plan.ops) {
      if (!in_graph[static_cast<size_t>(i)]) {
        return refuse(out, GraphFallback::kNotInGraph,
                      "op #" + std::to_string(i) +
                          " reads the result of an op that must not re-run and was not kept, so the graph does not "
                          "hold it");
      }
      needed[static_cast<size_t>(i)] = 1;
      for (capture::StorageId s : tape.op(i).writes) written[static_cast<size_t>(s)] = 1;
    }
    // Note [Nodes that run anyway]: a node that cannot be disabled and may write memory (a child graph; kOther: a
    // batch-memory-op node, anything unknown) runs at every launch although its op is not needed (prune_graph
    // forces it on): what its op writes is written by the launch too. A value staged there would be overwritten from
    // stale inputs (a reviewer's finding). Event and semaphore nodes write no memory; host, allocation and
    // conditional nodes are refused at capture.
    const capture::GraphTopology& topo = exec->topology();
    for (size_t n = 0; n < topo.node_count(); ++n) {
      const OpIndex owner = topo.owner[n];
      const capture::NodeKind kind = topo.kinds[n];
      if (owner < 0 || static_cast<size_t>(owner) >= needed.size() || needed[static_cast<size_t>(owner)] ||
          (kind != capture::NodeKind::kChildGraph && kind != capture::NodeKind::kOther)) {
        continue;
      }
      for (capture::StorageId s : tape.op(owner).writes) written[static_cast<size_t>(s)] = 1;
    }
    std::vector<uint8_t> staged(tape.values().size(), 0);
    for (OpIndex i : plan.ops) {
      for (const ArgRef& a : tape.op(i).inputs) {
        const auto v = static_cast<size_t>(a.value);
        if (staged[v] || classify_read(tape, *call.available, a.value, a.state, a.meta_only) != ReadSource::kLive) {
          continue;
        }
        if (!statics[v].defined() || !(*call.live)[v].defined()) {
          return refuse(out, GraphFallback::kStagingConflict,
                        "value v" + std::to_string(v) + " read by op #" + std::to_string(i) +
                            " has no static buffer in the graph");
        }
        if (v < unstageable.size() && unstageable[v]) {
          return refuse(out, GraphFallback::kStagingConflict,
                        "op #" + std::to_string(i) + " reads v" + std::to_string(v) + " as kept, but its static buffer "
                        "reuses memory an earlier captured op freed during the capture (its scratch): that op would "
                        "overwrite the staged bytes");
        }
        if (written[static_cast<size_t>(tape.value(a.value).storage)]) {
          return refuse(out, GraphFallback::kStagingConflict,
                        "op #" + std::to_string(i) + " reads v" + std::to_string(v) +
                            " as kept, but the replay also writes its storage");
        }
        staged[v] = 1;
        stage_list.push_back(a.value);
      }
    }
    return true;
  }

  // False with the reason in `out` when a needed op writes a replayed target's storage past the state the target is
  // read at, or the graph does not hold a replayed target.
  bool targets_held(const GraphCall& call, const std::vector<Read>& targets, const std::vector<uint8_t>& needed,
                    GraphReplayOutcome& out) const {
    const capture::Tape& tape = *call.tape;
    for (const Read& r : targets) {
      if (classify_read(tape, *call.available, r.value, r.state, false) == ReadSource::kLive) continue;
      const capture::StorageInfo& st = tape.storage(tape.value(r.value).storage);
      for (int32_t w = r.state; w < st.final_state(); ++w) {
        if (needed[static_cast<size_t>(st.writers[static_cast<size_t>(w)])]) {
          return refuse(out, GraphFallback::kStagingConflict,
                        "target v" + std::to_string(r.value) + " is read at state " + std::to_string(r.state) +
                            " but the replay writes its storage later");
        }
      }
      if (!statics[static_cast<size_t>(r.value)].defined()) {
        return refuse(out, GraphFallback::kNotInGraph,
                      "target v" + std::to_string(r.value) + " is not held by the graph");
      }
    }
    return true;
  }

  // False with the reason in `out` while a tensor an earlier launch handed out is still referenced and this launch
  // writes its storage (`written`, per storage).
  bool handed_out_dead(const capture::Tape& tape, const std::vector<uint8_t>& written, GraphReplayOutcome& out) const {
    for (const Handed& h : handed) {
      if (written[static_cast<size_t>(tape.value(h.value).storage)] && referenced(h)) {
        return refuse(out, GraphFallback::kOutputsLive,
                      "v" + std::to_string(h.value) + " (" + describe_value(tape, h.value) +
                          "), handed out by an earlier launch of this graph, is still referenced (" +
                          std::to_string(h.storage.use_count()) + " storage references) and this launch writes it");
      }
    }
    return true;
  }

  // Copies the live tensors of `stage_list` into their static buffers (those not already there). False with the
  // reason in `out` when one cannot be staged (the values before it are staged).
  bool stage(capture::GraphDevice& device, const std::vector<at::Tensor>& live, const std::vector<ValueId>& stage_list,
             GraphReplayOutcome& out) const {
    for (ValueId v : stage_list) {
      const at::Tensor& dst = statics[static_cast<size_t>(v)];
      const at::Tensor& src = live[static_cast<size_t>(v)];
      if (same_memory(dst, src)) continue;
      if (!stage_into(device, dst, src)) {
        return refuse(out, GraphFallback::kStagingConflict,
                      "v" + std::to_string(v) + " cannot be staged: its live tensor has another shape or dtype than "
                      "at the forward, or it overlaps itself");
      }
      out.staged_bytes += capture::view_bytes(src);
    }
    return true;
  }

  // Sets the executable's node mask to `mask` (only the nodes that change).
  void apply(const GraphPrune& mask) {
    const auto& topo = exec->topology();
    for (size_t n = 0; n < topo.node_count(); ++n) {
      if (applied[n] == mask.enabled[n]) continue;
      exec->set_enabled(static_cast<capture::NodeId>(n), mask.enabled[n] != 0);
      applied[n] = mask.enabled[n];
    }
  }

  // Launches the executable, timed per op when `timing` asks for this launch (a failed timing is a note, not an
  // error).
  void launch(capture::GraphDevice& device, LaunchTiming timing, size_t tape_ops, GraphReplayOutcome& out) {
    std::unique_ptr<capture::LaunchTimer> timer;
    if (timing == LaunchTiming::kEvery || (timing == LaunchTiming::kFirst && !timing_asked)) {
      timing_asked = true;
      timer = device.time_launch(*exec, &out.timing_note);
    }
    exec->launch();
    out.launched = true;
    if (!timer) return;
    try {
      capture::OpKernelTimes t = timer->finish(tape_ops);
      out.timed = true;
      out.timing = timer->kind();
      out.op_ns = std::move(t.ns);
      out.unattributed_ns = t.unattributed_ns;
    } catch (const std::exception& ex) {
      out.timing_note = std::string("timing the launch failed: ") + ex.what();
    }
  }

  // The targets' tensors after a launch: live ones as they are, replayed ones over the static tensors' bytes
  // (Note [Handed-out storages], remembered in `handed`); and the extras the launch computed (`needed` ops produced
  // them), the same way.
  std::unordered_map<ValueId, at::Tensor> hand_out(const GraphCall& call, const std::vector<Read>& targets,
                                                   const std::vector<ValueId>* extras,
                                                   const std::vector<uint8_t>& needed) {
    std::unordered_map<ValueId, at::Tensor> result;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    HandOut hand;
    auto give = [&](ValueId v) {
      at::Tensor t = hand.alias(statics[static_cast<size_t>(v)]);
      handed.push_back(Handed{v, t.storage().getWeakStorageImpl()});
      result.emplace(v, std::move(t));
    };
    for (size_t k = 0; extras != nullptr && k < extras->size(); ++k) {
      const ValueId v = (*extras)[k];
      const OpIndex p = call.tape->value(v).producer;
      if (p < 0 || !needed[static_cast<size_t>(p)] || !statics[static_cast<size_t>(v)].defined()) continue;
      give(v);
    }
    for (const Read& r : targets) {
      const auto v = static_cast<size_t>(r.value);
      if (classify_read(*call.tape, *call.available, r.value, r.state, false) == ReadSource::kLive) {
        result.emplace(r.value, (*call.live)[v]);
      } else {
        if (v < copy_out.size() && copy_out[v]) {  // Note [Host tensors under capture]
          result.emplace(r.value, statics[v].to(device_of(call.tape->value(r.value).meta)));
          continue;
        }
        if (!result.count(r.value)) give(r.value);
      }
    }
    return result;
  }
};

GraphCache::GraphCache(std::shared_ptr<capture::GraphDevice> device, GraphOptions options)
    : device_(std::move(device)), options_(options) {}

GraphCache::~GraphCache() = default;

size_t GraphCache::graphs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return captured_;
}

int64_t GraphCache::static_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [key, e] : entries_) {
    if (e->exec) total += e->bytes;
  }
  // The device's capture overhead (GraphDevice::capture_overhead_bytes) is held from the first capture on.
  return captured_ > 0 ? total + device_->capture_overhead_bytes() : total;
}

int64_t GraphCache::pending_bytes() const {
  // Only what can still be captured: at most the graphs the cache has room for (max_graphs), the largest first. A
  // key refused because the cache is full stays refused, and every plan reserved its bytes (an adversarial test:
  // 99 MB reserved for 1 MB of graphs after 300 shapes).
  std::lock_guard<std::mutex> lock(mu_);
  const size_t room = options_.max_graphs > captured_ ? options_.max_graphs - captured_ : 0;
  std::vector<int64_t> pending;
  for (const auto& [key, e] : entries_) {
    if (!e->exec && e->failed == GraphFallback::kNone && e->bytes > 0) pending.push_back(e->bytes);
  }
  const size_t n = std::min(room, pending.size());
  std::partial_sort(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(n), pending.end(),
                    std::greater<int64_t>());
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += pending[i];
  return captured_ == 0 && total > 0 ? total + device_->capture_overhead_bytes() : total;
}

void GraphCache::set_capture_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  capture_enabled_ = enabled;
}

GraphCache::Entry* GraphCache::find_or_add(uint64_t key) {
  auto& slot = entries_[key];
  if (!slot) slot = std::make_unique<Entry>();
  return slot.get();
}

// Whether the key may be captured now (its warm-up done, room for its static memory). False when this replay goes
// eager: a warm-up (out.warmup) or a refusal (out.reason, out.detail).
bool GraphCache::ready_to_capture(Entry& e, const GraphCall& call, GraphReplayOutcome& out) {
  if (e.eager < options_.warmup) {
    ++e.eager;
    out.warmup = true;
    return false;
  }
  if (!capture_enabled_) {
    return refuse(out, GraphFallback::kMemoryLimit,
                  "the plan under memory_limit leaves no room for the graph's " + std::to_string(e.bytes) +
                      " bytes of static memory; this block replays eagerly");
  }
  if (captured_ >= options_.max_graphs) {
    return refuse(out, GraphFallback::kGraphLimit, "the session holds " + std::to_string(captured_) +
                                                       " graphs already (max_graphs); this block replays eagerly");
  }
  if (call.memory_limit > 0 && call.last_peak == 0) {
    out.warmup = true;  // no step measured yet: the statics' room under the limit is unknown
    return false;
  }
  const int64_t peak = std::max(call.in_use, call.last_peak);
  const int64_t needed = e.bytes + (captured_ == 0 ? device_->capture_overhead_bytes() : 0);
  if (call.memory_limit > 0 && peak + needed > call.memory_limit) {
    return refuse(out, GraphFallback::kMemoryLimit,
                  "capturing the block needs " + std::to_string(needed) + " bytes of static memory, held from "
                  "then on; the step peaks at " + std::to_string(peak) + " bytes under a limit of " +
                      std::to_string(call.memory_limit));
  }
  return true;
}

// Captures the key's graph once its warm-up is done (Note [What a graph captures]). False when this replay goes
// eager: a warm-up (out.warmup) or a refusal (out.reason, out.detail).
bool GraphCache::capture(Entry& e, const GraphCall& call, const std::vector<OpIndex>& graph_ops,
                         const std::vector<uint8_t>& capture_live, GraphReplayOutcome& out) {
  const capture::Tape& tape = *call.tape;
  e.bytes = capture_bytes(tape, graph_ops, capture_live);  // pending until captured (pending_bytes)
  std::string host = host_tensor_read(tape, graph_ops, device_->graph_device_type(), device_->graph_device_index());
  if (!host.empty()) {
    e.failed = GraphFallback::kHostTensors;
    e.failed_detail = std::move(host);
    return refuse(out, e.failed, e.failed_detail);
  }
  if (!ready_to_capture(e, call, out)) return false;
  const std::vector<at::Tensor> inputs = static_inputs(tape, capture_live);
  std::vector<at::Tensor> env;
  std::string error;
  std::unique_ptr<capture::ExecGraph> exec = capture_ops(*device_, call, graph_ops, inputs, capture_live, env, error);
  if (!exec) {
    e.failed = GraphFallback::kCaptureInvalidated;
    e.failed_detail = "capture failed: " + error;
    return refuse(out, e.failed, e.failed_detail);
  }
  const std::vector<capture::NodeKind>& kinds = exec->topology().kinds;
  if (std::all_of(kinds.begin(), kinds.end(), [](capture::NodeKind k) { return k == capture::NodeKind::kEmpty; })) {
    // Ops that compute (not views only) and a graph without a node: their work went elsewhere (another device's
    // stream, which a capture does not see: GraphDevice::graph_device_index()); every launch would do nothing.
    for (OpIndex i : graph_ops) {
      if (!tape.op(i).has(capture::kView)) {
        e.failed = GraphFallback::kCaptureInvalidated;
        e.failed_detail = "the capture recorded no work for op #" + std::to_string(i) + " " +
                          capture::op_kind_name(tape.op(i).kind) + " (its kernels ran outside the capture stream)";
        return refuse(out, e.failed, e.failed_detail);
      }
    }
  }
  const GraphVerdict verdict = check_capturable(exec->topology());
  if (!verdict.ok()) {
    e.failed = verdict.reason;
    e.failed_detail = verdict.detail;
    return refuse(out, e.failed, e.failed_detail);
  }
  std::vector<uint8_t> copy_out;
  GraphFallback mismatch = GraphFallback::kNone;
  std::string bad = check_captured_outputs(tape, graph_ops, env, device_->graph_device_type(), &copy_out, &mismatch);
  if (!bad.empty()) {
    e.failed = mismatch;
    e.failed_detail = std::move(bad);
    return refuse(out, e.failed, e.failed_detail);
  }
  std::vector<uint8_t> unstageable = values_over_freed(tape, graph_ops, env, device_->freed_during_capture());
  e.adopt(std::move(exec), tape, graph_ops, capture_live, std::move(env), *call.payloads);
  e.copy_out = std::move(copy_out);
  e.unstageable = std::move(unstageable);
  ++captured_;
  out.captured = true;
  return true;
}

// Checks a launch of the captured graph for `targets` (Note [Static memory]), then stages, masks and launches it.
// Nothing changes until every check passed; a failed check returns an empty map with the reason in `out`.
std::unordered_map<ValueId, at::Tensor> GraphCache::launch(Entry& e, const GraphCall& call,
                                                          const std::vector<Read>& targets, const PruneResult& plan,
                                                          const std::vector<ValueId>* extras,
                                                          GraphReplayOutcome& out) {
  std::vector<uint8_t> needed, written;
  std::vector<ValueId> stage_list;
  if (!e.stage_list_for(call, plan, needed, written, stage_list, out) || !e.targets_held(call, targets, needed, out)) {
    return {};
  }
  // Staging writes static storage too (Note [Static memory]): a handed-out tensor over it must be dead as well.
  std::vector<uint8_t> overwritten = written;
  for (ValueId v : stage_list) {
    if (!same_memory(e.statics[static_cast<size_t>(v)], (*call.live)[static_cast<size_t>(v)])) {
      overwritten[static_cast<size_t>(call.tape->value(v).storage)] = 1;
    }
  }
  if (!e.handed_out_dead(*call.tape, overwritten, out)) return {};
  const GraphPrune mask = prune_graph(*call.tape, e.exec->topology(), plan.ops);
  if (!mask.ok()) {
    refuse(out, mask.verdict.reason, mask.verdict.detail);
    return {};
  }
  const std::string rng = device_->before_launch(*e.exec, e.random_ops, e.payloads, *call.payloads);
  if (!rng.empty()) {
    refuse(out, GraphFallback::kRngMismatch, rng);
    return {};
  }

  struct AfterLaunch {
    capture::GraphDevice& d;
    capture::ExecGraph& x;
    ~AfterLaunch() { d.after_launch(x); }
  } after{*device_, *e.exec};
  // What earlier launches handed out and is dead, or is about to be overwritten (checked above: dead), is forgotten.
  e.handed.erase(std::remove_if(e.handed.begin(), e.handed.end(),
                                [&](const Entry::Handed& h) {
                                  return overwritten[static_cast<size_t>(call.tape->value(h.value).storage)] ||
                                         !Entry::referenced(h);
                                }),
                 e.handed.end());
  if (!e.stage(*device_, *call.live, stage_list, out)) return {};
  e.apply(mask);
  e.launch(*device_, options_.time_launches, call.tape->ops().size(), out);
  out.enabled_nodes = mask.enabled_nodes;
  out.disabled_nodes = mask.disabled_nodes;
  out.ops = plan.ops.size();
  return e.hand_out(call, targets, extras, needed);
}

std::unordered_map<ValueId, at::Tensor> GraphCache::replay(const GraphCall& call, const std::vector<Read>& targets,
                                                          const PruneResult& plan, GraphReplayOutcome* outcome,
                                                          const std::vector<ValueId>* extras) {
  std::lock_guard<std::mutex> lock(mu_);
  GraphReplayOutcome& out = *outcome;
  out = GraphReplayOutcome{};
  const capture::Tape& tape = *call.tape;

  // The key (Note [Graph keys]).
  std::vector<uint8_t> capture_live;
  const std::vector<uint8_t> tainted =
      tainted_ops(tape, call.key_available != nullptr ? *call.key_available : *call.available, &capture_live);
  std::vector<OpIndex> graph_ops;
  for (size_t i = 0; i < tainted.size(); ++i) {
    if (!tainted[i]) graph_ops.push_back(static_cast<OpIndex>(i));
  }
  uint64_t constants = 0;
  if (!hash_constants(*call.payloads, graph_ops, &constants)) {
    refuse(out, GraphFallback::kUnsupportedArgs,
           "an op of the block has a constant argument that cannot be compared between block calls");
    return {};
  }
  common::Fnv64 key;
  key.mix(call.signature);
  key.mix(constants);
  for (size_t v = 0; v < capture_live.size(); ++v) {
    if (capture_live[v]) key.mix(v);
  }
  Entry& e = *find_or_add(key.value());
  if (e.failed == GraphFallback::kNone && !e.exec) {
    std::string gap = random_op_left_out(tape, graph_ops, tainted);
    if (!gap.empty()) {
      e.failed = GraphFallback::kRngMismatch;
      e.failed_detail = std::move(gap);
    }
  }
  if (e.failed != GraphFallback::kNone) {
    refuse(out, e.failed, e.failed_detail);
    return {};
  }
  if (!e.exec && !capture(e, call, graph_ops, capture_live, out)) return {};
  return launch(e, call, targets, plan, extras, out);
}

}  // namespace tapesac::replay
