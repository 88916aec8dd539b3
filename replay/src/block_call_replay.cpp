// A block call's backward side: unpack, the replay of dropped values (graph or eager, under the memory limit and the
// replay contract), and its accounting (see block_call.h).
#include <algorithm>
#include <optional>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/clock.h"
#include "tapesac/common/errors.h"
#include "tapesac/replay/block_call.h"

namespace tapesac::replay {

using capture::Tape;

at::Tensor BlockCall::unpack(int32_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  TAPESAC_CHECK(!step_closed_, kGeneric, "tapesac: a tensor saved in block '", name_,
                "' was unpacked after its step ended: a backward spans two steps. Run each backward in the step of "
                "its forward: inside `with sac.step():` (forward and backward both inside the `with` block), or, "
                "with sac.attach(optimizer), before the optimizer.step() that ends the step.");
  TAPESAC_CHECK(slot >= 0 && static_cast<size_t>(slot) < slots_.size(), kGeneric, "tapesac: unknown saved slot ", slot);
  const Slot& s = slots_[static_cast<size_t>(slot)];
  TAPESAC_INTERNAL_ASSERT(!s.released, "slot ", slot, " of block ", name_, " unpacked after its handle was freed");
  begin_backward();
  contract_.check_saved(s.version, s.saved_version, slot, s.value);
  ++closed_stats_.unpacks;
  slots_[static_cast<size_t>(slot)].unpacked = true;
  if (ctx_.unpack_clock != nullptr) last_unpack_at_ = ctx_.unpack_clock->fetch_add(1, std::memory_order_relaxed) + 1;
  if (!s.dropped) return serve_kept(slot);
  const ValueId v = s.value;
  note_unpack(v);
  if (round_ == 0 && storage_alive(s)) alive_at_unpack_.insert(v);  // Note [dropped values alive elsewhere]
  at::Tensor alive = still_alive(s);  // Note [a dropped tensor still alive]
  if (!alive.defined()) alive = replaced_data(s);  // Note [Saved as itself]
  if (!alive.defined()) alive = on_live_storage(s);  // Note [A dropped value on a live storage]
  if (alive.defined()) {
    slots_[static_cast<size_t>(slot)].last_round = round_;
    --remaining_[static_cast<size_t>(v)];
    return alive;
  }
  if (!cache_.count(v)) replay_for(v);
  auto it = cache_.find(v);
  TAPESAC_INTERNAL_ASSERT(it != cache_.end(), "replay of block ", name_, " did not rebuild v", v);
  at::Tensor t = it->second;
  slots_[static_cast<size_t>(slot)].last_round = round_;
  if (--remaining_[static_cast<size_t>(v)] <= 0) note_last_unpack(v);
  return t;
}

void BlockCall::begin_backward() {
  // The first unpack of the step marks the start of the backward on the memory timeline.
  if (ctx_.memory && ctx_.memory->counter().phase() == allocator::Phase::kForward) {
    ctx_.memory->counter().set_phase(allocator::Phase::kBackward);
    if (ctx_.backward_starts != nullptr && *ctx_.backward_starts) {
      (*ctx_.backward_starts)(*this);  // Note [dropped values alive elsewhere] (block_call.h)
    }
    // The watcher keeps watching: see Note [watching the backward] (preserve.h).
  }
}

// Note [a dropped tensor still alive]: a dropped saved tensor whose tensor is still alive when the backward unpacks
// it (the block's output, which the next block holds as its input; an activation the user stored) is served as it
// is, not replayed. Plain autograd reads that very storage, so its current bytes are what a run without tapesac
// uses: a write to it after the forward that moves no version (through `.data`, in the forward, a backward hook or
// between two backwards) must reach the gradient, where a replay would rebuild the bytes from before the write
// (issue 18, random program 4322). Served only while it still has the storage and the view the forward saved (a
// `.data = ...` replacement replays the forward's bytes, as before); an in-place write the version counter saw was
// rejected above. Replaying it would only have cost time: it is alive, so dropping it freed nothing. The storage
// must also still hold the same allocation: FSDP2 frees an unsharded parameter's bytes after the forward
// (`untyped_storage().resize_(0)`) and refills them later, which moves no version and keeps the StorageImpl — such
// a tensor is replayed (test_distributed.py::test_fsdp2 read freed bytes, NaN gradients, when it was served).
at::Tensor BlockCall::still_alive(const Slot& s) const {
  if (s.storage == nullptr || s.value < 0) return {};
  c10::intrusive_ptr<c10::TensorImpl> impl = s.origin.lock();
  if (!impl || !impl->has_storage() || impl->storage().unsafeGetStorageImpl() != s.storage) return {};
  if (impl->storage().data() != s.storage_data || impl->storage().nbytes() != s.storage_nbytes) return {};
  at::Tensor t(std::move(impl));
  const capture::TensorMeta& m = recorder_.tape().value(s.value).meta;
  if (!t.is_cpu() && !t.is_cuda()) return {};
  if (t.layout() != c10::kStrided || t.storage_offset() != m.storage_offset ||
      static_cast<int16_t>(t.scalar_type()) != m.dtype || !m.sizes.equals(t.sizes()) ||
      !m.strides.equals(t.strides())) {
    return {};
  }
  return capture::detached_alias(t);
}

// Note [A dropped value on a live storage]. A dropped saved tensor whose TensorImpl is gone but whose storage
// still holds the allocation it had at the drop is served from that storage with the forward's view (sizes,
// strides, offset, dtype), not replayed. Autograd's saved tensor is that storage, so a write to it that moves no
// version (`h.data[0] = 0.25` at the next block's start, a pre-hook's `args[0].data.mul_(2)`, a hook's write to
// an activation it captured, `untyped_storage().fill_`) is what a run without tapesac reads; a replay rebuilt the
// bytes from before it (silently wrong gradients under every contract, strict too: its checksum was taken before
// the write; adversarial tests). Served when the write watcher saw a write to that storage while it was alive and
// kept it from then on (WriteWatcher::keep_if_written: plain autograd's saved tensor would have kept it too); a live
// storage nobody wrote holds the forward's bytes, rebuilt by the replay as before. A write that moved the version was
// refused by the contract above.
at::Tensor BlockCall::on_live_storage(const Slot& s) const {
  // Only a storage the watcher saw written: one alive and unwritten holds the forward's bytes, which the replay
  // rebuilds as the planner's memory model expects (serving those too lowered measured peaks under its predictions).
  if (s.value < 0 || s.storage == nullptr || !ctx_.watcher || !ctx_.watcher->kept_written(s.storage)) return {};
  c10::intrusive_ptr<c10::StorageImpl> impl = s.storage_weak.lock();
  if (!impl || impl->data() != s.storage_data || impl->nbytes() != s.storage_nbytes) return {};
  const capture::TensorMeta& m = recorder_.tape().value(s.value).meta;
  const c10::Device device = impl->device();
  if (device.type() != c10::DeviceType::CPU && device.type() != c10::DeviceType::CUDA) return {};
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(static_cast<c10::ScalarType>(m.dtype)).device(device));
  t.set_(c10::Storage(std::move(impl)), m.storage_offset, c10::IntArrayRef(m.sizes.data(), m.sizes.size()),
         c10::IntArrayRef(m.strides.data(), m.strides.size()));
  return t;
}

bool BlockCall::storage_alive(const Slot& s) const {
  const c10::intrusive_ptr<c10::StorageImpl> impl = s.storage_weak.lock();
  return impl && impl->data() == s.storage_data && impl->nbytes() == s.storage_nbytes;
}

at::Tensor BlockCall::serve_kept(int32_t slot) {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  TAPESAC_INTERNAL_ASSERT(s.tensor.defined(), "kept slot ", slot, " of block ", name_, " holds no tensor");
  if (at::Tensor replaced = replaced_data(s); replaced.defined()) return replaced;  // Note [Saved as itself]
  return s.tensor;
}

// Note [Saved as itself]. Autograd saves a leaf (a parameter, a tensor that requires no grad), or a tensor that is
// not an output of the node saving it, as the tensor itself; an output as a shallow copy (`tensor_data()`, else a
// reference cycle). So when `.data = ...` or set_ replaces such a tensor's storage between its forward and its
// backward, a run without tapesac reads the new data for the first kind and the forward's bytes for the second.
// An unpack serves the same: the tensor's current data for the first kind, kept or dropped (the pack says which:
// BlockCall::pack's `as_itself`), the bytes the forward saved for the second. Before, every slot served the forward's
// bytes and a `W.data = W.data * 0.5` between forward and backward gave other gradients than plain PyTorch under
// every policy, "none" included (an independent fuzzer). Replays still read the forward's bytes (the contract
// swaps them in): the activations autograd saved were computed from them.
at::Tensor BlockCall::replaced_data(const Slot& s) const {
  if (!s.as_itself) return {};
  c10::intrusive_ptr<c10::TensorImpl> impl = s.origin.lock();
  if (!impl || !impl->has_storage()) return {};
  const void* forward = s.tensor.defined() ? s.tensor.storage().unsafeGetStorageImpl() : s.storage;
  if (forward == nullptr || impl->storage().unsafeGetStorageImpl() == forward) return {};
  return capture::detached_alias(at::Tensor(std::move(impl)));
}

void BlockCall::replay_for(ValueId wanted) {
  if (remaining_[static_cast<size_t>(wanted)] <= 0) {  // a new backward over the same graph (retain_graph=True)
    if (round_ == 0) {  // Note [dropped values alive elsewhere] (block_call.h)
      if (ctx_.memory) second_backward_ns_ = ctx_.memory->elapsed_ns();
      if (ctx_.second_backward_starts != nullptr && *ctx_.second_backward_starts) {
        (*ctx_.second_backward_starts)(*this);
      }
    }
    ++round_;
    remaining_ = handles_;
    restart_schedule();
  }
  if (ctx_.watcher) ctx_.watcher->check_allocations();  // Note [a storage reallocated unseen] (preserve.cpp)
  SegmentInputs in = segment_inputs(wanted);
  const std::vector<at::Tensor>& base_live = in.live.empty() ? live_ : in.live;
  // Declared before the replay's tensors: the step's bytes are swapped back in only after the replay ends.
  ResolvedLive resolved = contract_.resolve_live(recorder_.tape(), available_, in.plan, base_live, wanted);
  std::vector<at::Tensor> live_with_subs;
  if (!resolved.subs.empty()) {
    live_with_subs = base_live;
    for (auto& [value, tensor] : resolved.subs) live_with_subs[static_cast<size_t>(value)] = std::move(tensor);
  }
  allocator::MemoryCounter* counter = ctx_.memory ? &ctx_.memory->counter() : nullptr;
  PhaseScope phase(counter, allocator::Phase::kReplay);
  const int64_t begin_ns = ctx_.memory ? ctx_.memory->elapsed_ns() : 0;
  const int64_t held_before = ctx_.memory ? block_held_bytes() : 0;
  const int64_t window_start = counter ? counter->begin_window() : 0;
  const int64_t allocated_before = counter ? counter->total().allocated : 0;
  const int64_t ns_before = replay_stats_.ns;
  auto out = run_replay(in, live_with_subs.empty() ? base_live : live_with_subs, wanted);
  if (approx_) approx_->finish(out);
  live_with_subs.clear();
  in.live.clear();
  resolved.swaps.clear();  // the step's bytes back in the storages the replay read
  account_replay(window_start, allocated_before, begin_ns, held_before);
  keep_rebuilt(out, resolved.recovered, replay_stats_.ns - ns_before);
  finish_segment(in.segment);
}

std::unordered_map<ValueId, at::Tensor> BlockCall::run_replay(SegmentInputs& in, const std::vector<at::Tensor>& live,
                                                              ValueId wanted) {
  // A graph launch allocates nothing (its memory is static), so the limit is applied to eager replays only.
  // The graph path runs before the eager replay's arena routing: a capture routes its own allocations into the
  // arena (the graph device's pool), and the allocator refuses a second routing to a pool already routed.
  const common::Stopwatch graph_clock;
  auto out = replay_graph(in, live);
  if (!out.empty()) {
    replay_stats_.ns += graph_clock.elapsed_ns();
    return out;
  }
  std::unique_ptr<capture::PoolRouting> arena;
  if (options_.has_arena() && ctx_.memory && ctx_.memory->device() != nullptr) {
    arena = ctx_.memory->device()->route(options_.arena_device, options_.arena_pool_id);
  }
  limit_targets(in, Read{wanted, saved_state(wanted)});
  ReplaySource src;
  src.tape = &recorder_.tape();
  src.payloads = &recorder_.payloads();
  src.live = &live;
  src.available = &in.available;
  ReplayOptions opts;
  opts.check_metadata = options_.check_metadata;
  opts.op_override = approx_.get();
  opts.extra_outputs = &in.extras;
  return replay(src, in.targets, opts, &replay_stats_);
}

void BlockCall::account_replay(int64_t window_start, int64_t allocated_before, int64_t begin_ns,
                               int64_t held_before) {
  if (!ctx_.memory) return;
  allocator::MemoryCounter& counter = ctx_.memory->counter();
  const int64_t ws = counter.window_peak() - window_start;
  closed_stats_.replay_peak_bytes = std::max(closed_stats_.replay_peak_bytes, ws);
  closed_stats_.backward_ws_bytes = std::max(closed_stats_.backward_ws_bytes, held_before + ws);
  // What the limit promises is the step peak: this replay's window peak on top of what was in use when it began.
  const int64_t limit = std::max(options_.memory_limit, options_.graph_memory_limit);
  if (limit > 0) {
    const int64_t peak = ctx_.memory->baseline() + window_start + ws;
    closed_stats_.over_limit_bytes = std::max(closed_stats_.over_limit_bytes, peak - limit);
  }
  closed_stats_.replayed_bytes += counter.total().allocated - allocated_before;
  ctx_.memory->arena().on_replay(name_, ws);
  ctx_.memory->add_span(TimelineSpan{"replay", name_, begin_ns, ctx_.memory->elapsed_ns(), ctx_.plan_key});
}

void BlockCall::keep_rebuilt(std::unordered_map<ValueId, at::Tensor>& out, const std::string& recovered,
                             int64_t replay_ns) {
  for (auto& [value, tensor] : out) {
    if (!dropped(value) || remaining_[static_cast<size_t>(value)] <= 0) {  // an intermediate a later segment holds (Note [Replay schedule])
      held_[value] = std::move(tensor);
      continue;
    }
    try {
      contract_.verify_bytes(value, tensor, replay_ns);
    } catch (...) {
      ++replays_;
      throw;
    }
    const int64_t nbytes = capture::view_bytes(tensor);
    const bool approximated = approx_ && approx_->approximates(value);
    record(value, approximated ? "approximated" : recovered.empty() ? "match" : "recovered", nbytes, replay_ns,
           recovered);
    if (round_ == 0 && tensor.has_storage() && ctx_.backward_starts != nullptr) {
      rebuilt_first_round_.emplace_back(value, tensor.storage().getWeakStorageImpl());
    }
    cache_.emplace(value, std::move(tensor));
  }
  ++replays_;
}

void BlockCall::record(ValueId v, const std::string& status, int64_t bytes, int64_t ns, std::string detail) const {
  if (!ctx_.memory) return;
  const Tape& tape = recorder_.tape();
  ReplayRecord r;
  r.block = name_;
  r.value = v;
  if (v >= 0 && static_cast<size_t>(v) < tape.values().size()) {
    const int32_t state = dropped(v) ? value_state_[static_cast<size_t>(v)] : tape.value(v).state;
    const capture::OpIndex p = tape.bytes_writer(v, state);
    r.op = p >= 0 ? capture::op_kind_name(tape.op(p).kind) : std::string("external");
  }
  r.status = status;
  r.bytes = bytes;
  r.ns = ns;
  r.replay = replays_;
  r.detail = std::move(detail);
  ctx_.memory->add_record(std::move(r));
}

void BlockCall::limit_targets(SegmentInputs& in, const Read& wanted) {
  const Tape& tape = recorder_.tape();
  std::vector<Read> pinned = in.targets;
  for (ValueId v : in.extras) pinned.push_back(Read{v, tape.value(v).state});
  int64_t whole = predict_working_set(tape, in.plan, pinned);
  const int64_t limit = options_.memory_limit;
  if (limit > 0 && ctx_.memory) {
    const int64_t in_use = ctx_.memory->in_use(live_cuda_device());
    if (in_use + whole > limit && !in.extras.empty()) whole = fit_extras(in, in_use, limit);
    int64_t piece = whole;
    std::vector<Read> piece_targets{wanted};
    PruneResult piece_plan;
    if (in.targets.size() > 1 && in_use + whole > limit) {
      piece_plan = prune(tape, piece_targets, in.available);
      piece = predict_working_set(tape, piece_plan, piece_targets);
    }
    const allocator::LimitDecision d = allocator::decide(limit, in_use, whole, piece);
    switch (d.verdict) {
      case allocator::LimitVerdict::kWhole:
        break;
      case allocator::LimitVerdict::kPieces:
        ++closed_stats_.replay_pieces;
        ctx_.memory->count_replay_piece();
        in.plan = std::move(piece_plan);
        in.targets = std::move(piece_targets);
        in.extras.clear();
        whole = piece;
        break;
      case allocator::LimitVerdict::kReject:
        throw Error(ErrorKind::kMemoryLimit, allocator::rejection_message(d, name_, "the backward (replay)"));
    }
  }
  closed_stats_.predicted_replay_bytes = std::max(closed_stats_.predicted_replay_bytes, whole);
}

int BlockCall::live_cuda_device() const {
  for (const at::Tensor& t : live_) {
    if (t.defined()) return t.is_cuda() ? t.get_device() : -1;
  }
  return -1;
}

std::unordered_map<ValueId, at::Tensor> BlockCall::replay_graph(const SegmentInputs& in,
                                                               const std::vector<at::Tensor>& live) {
  if (ctx_.graphs == nullptr) return {};
  BlockStats& st = closed_stats_;
  if (approx_) {  // approximate replays run their own kernels, eagerly
    ++st.graph_fallbacks;
    st.graph_fallback = "approx";
    st.graph_detail = "approximate rematerialization replays eagerly";
    return {};
  }
  GraphCall call;
  call.tape = &recorder_.tape();
  call.payloads = &recorder_.payloads();
  call.live = &live;
  call.available = &in.available;
  call.key_available = &available_;
  call.signature = signature_;
  call.memory_limit = std::max(options_.memory_limit, options_.graph_memory_limit);
  if (call.memory_limit > 0 && ctx_.memory) {
    // The graph's static memory stays for the rest of the step and every later one: it must fit on top of the
    // step's peak so far and of the previous step's measured peak, not only of what is in use now.
    const int dev = live_cuda_device();
    call.in_use = std::max(ctx_.memory->in_use(dev), ctx_.memory->peak_so_far(dev));
    call.last_peak = ctx_.last_peak;
  }
  GraphReplayOutcome outcome;
  auto out = ctx_.graphs->replay(call, in.targets, in.plan, &outcome, &in.extras);
  count_graph_outcome(outcome, in.plan);
  return out;
}

void BlockCall::count_graph_outcome(const GraphReplayOutcome& outcome, const PruneResult& plan) {
  BlockStats& st = closed_stats_;
  if (outcome.captured) ++st.graph_captures;
  if (!outcome.launched) {
    if (outcome.warmup) {
      ++st.graph_warmups;
    } else {
      ++st.graph_fallbacks;
      st.graph_fallback = to_string(outcome.reason);
      st.graph_detail = outcome.detail;
    }
    return;
  }
  ++st.graph_replays;
  st.graph_staged_bytes += outcome.staged_bytes;
  st.graph_nodes_enabled = static_cast<int64_t>(outcome.enabled_nodes);
  st.graph_nodes_disabled = static_cast<int64_t>(outcome.disabled_nodes);
  if (outcome.timed) {
    ++st.graph_timed_launches;
    st.graph_timing = capture::op_timing_name(outcome.timing);
    if (graph_op_ns_.size() < outcome.op_ns.size()) graph_op_ns_.resize(outcome.op_ns.size(), 0);
    if (graph_op_names_.empty()) graph_op_names_ = op_names();
    for (size_t i = 0; i < outcome.op_ns.size(); ++i) {
      graph_op_ns_[i] += outcome.op_ns[i];
      st.graph_device_ns += outcome.op_ns[i];
    }
    st.graph_unattributed_ns += outcome.unattributed_ns;
  } else if (!outcome.timing_note.empty()) {
    st.graph_timing_note = outcome.timing_note;
  }
  replay_stats_.ops += static_cast<int64_t>(plan.ops.size());
  for (capture::OpIndex i : plan.ops) ++replay_stats_.ops_by_kind[recorder_.tape().op(i).kind];
}

}  // namespace tapesac::replay
