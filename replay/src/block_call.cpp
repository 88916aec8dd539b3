// A block call's forward side: recording, pack, the keep/drop decision, and release (see block_call.h). The
// backward side (unpack and replay) is in block_call_replay.cpp.
#include "tapesac/replay/block_call.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "tapesac/allocator/telemetry.h"
#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/errors.h"

namespace tapesac::replay {
namespace {

using capture::kExternal;
using capture::storage_bytes;
using capture::storage_key;
using capture::Tape;

}  // namespace

BlockCall::BlockCall(std::string name, BlockContext context)
    : name_(std::move(name)),
      ctx_(std::move(context)),
      options_(*ctx_.options),
      recorder_(capture::RecorderOptions{true, true, ctx_.expected_ops}),
      contract_(name_, ContractOptions{options_.check_versions, options_.check_bytes}, ctx_.watcher, this) {
  closed_stats_.name = name_;
}

BlockCall::~BlockCall() { recorder_.stop(); }

void BlockCall::start_forward() {
  if (ctx_.watcher) {
    ctx_.watcher->resume();
    ctx_.watcher->check_allocations();  // Note [a storage reallocated unseen] (preserve.cpp)
  }
  if (ctx_.memory) {
    ctx_.memory->counter().set_phase(allocator::Phase::kForward);
    forward_begin_ns_ = ctx_.memory->elapsed_ns();
  }
  recorder_.set_listener(this);
  if (options_.op_timers) {  // device op times (capture/op_timer.h); none: the recorder's CPU clock
    std::string why;
    std::unique_ptr<capture::OpTimer> timer = options_.op_timers->make(name_, &why);
    recorder_.set_op_timer(std::move(timer), std::move(why));
  }
  try {
    recorder_.start();
  } catch (const std::runtime_error& e) {
    throw Error(ErrorKind::kGeneric,
                std::string(e.what()) + ". Only one TapeSAC step can record on a thread at a time; close the other "
                                        "`sac.step()` first.");
  }
}

void BlockCall::on_op_recorded(capture::Recorder& /*recorder*/, capture::OpIndex /*op*/) {
  if (!pending_.empty()) resolve_pending(false);
}

void BlockCall::resolve_pending(bool final) {
  const Tape& tape = recorder_.tape();
  auto keep = pending_.begin();
  for (int32_t idx : pending_) {
    Slot& s = slots_[static_cast<size_t>(idx)];
    ValueId v = s.pending_impl != nullptr ? recorder_.find_value_of_impl(s.pending_impl) : -1;
    if (v < 0) v = recorder_.find_value(s.tensor);
    if (v >= 0) {
      s.value = v;
      s.state = tape.state_of(tape.value(v).storage);
    } else if (!final && recorder_.op_open()) {
      *keep++ = idx;
      continue;
    }
    // Resolved, or opaque: the tape did not produce it.
    s.pending = false;
    s.pending_impl = nullptr;
    s.pending_ref.reset();
  }
  pending_.erase(keep, pending_.end());
}

int32_t BlockCall::pack(const at::Tensor& t, bool as_itself) {
  std::lock_guard<std::mutex> lock(mu_);
  TAPESAC_INTERNAL_ASSERT(!forward_closed_, "pack after the forward of block ", name_, " closed");
  Slot s;
  s.tensor = capture::detached_alias(t);
  s.as_itself = as_itself;
  if (as_itself && t.defined()) s.held_origin = t.getIntrusivePtr();
  if (t.defined()) s.origin = c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
  if (t.defined() && !t.is_inference()) {
    s.version = t.unsafeGetTensorImpl()->version_counter();
    s.saved_version = s.version.current_version();
  }
  const auto idx = static_cast<int32_t>(slots_.size());
  if (recorder_.active() && recorder_.op_open()) {
    // Saved inside an op's autograd kernel: resolved when the op exits, because the op may still write the tensor
    // (an in-place op that saves its own result, e.g. tanh_) or create it (an op saving its output).
    s.pending = true;
    s.pending_impl = t.defined() ? t.unsafeGetTensorImpl() : nullptr;
    if (t.defined()) s.pending_ref.emplace(t.getIntrusivePtr());
    pending_.push_back(idx);
  } else if (const ValueId v = recorder_.find_value(t); v >= 0) {
    s.value = v;
    s.state = recorder_.tape().state_of(recorder_.tape().value(v).storage);
  }
  slots_.push_back(std::move(s));
  ++alive_slots_;
  return idx;
}

int BlockCall::forward_died() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (slots_.empty()) return -1;
  return forward_closed_ && alive_slots_ == 0 && closed_stats_.unpacks == 0 ? 1 : 0;
}

void BlockCall::release(int32_t slot) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (step_closed_ || slot < 0 || static_cast<size_t>(slot) >= slots_.size()) return;
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.released) return;
  s.released = true;
  if (s.unpacked && ctx_.unpack_clock != nullptr) {  // Note [A graph held through its backward]
    first_served_release_at_ =
        std::min(first_served_release_at_, ctx_.unpack_clock->load(std::memory_order_relaxed));
  }
  s.tensor.reset();
  if (s.dropped) {
    const ValueId v = s.value;
    --handles_[static_cast<size_t>(v)];
    if (s.last_round != round_ && --remaining_[static_cast<size_t>(v)] <= 0) note_last_unpack(v);
  }
  if (--alive_slots_ == 0 && forward_closed_) {
    release_all();
  } else if (s.dropped && handles_[static_cast<size_t>(s.value)] == 0) {
    release_kept_live();  // a dropped value's last handle went (Note [Kept values freed with their slots])
  }
}

// Note [Kept values freed with their slots]. A replay reads the call's kept values from live_ (its own references,
// taken at the drop). Held there until the last slot went (release_all), a kept value outlived the graph node that
// saved it whenever no replay could read it any more: its bytes stayed in use through the rest of the call's backward,
// where keeping everything had freed them (random program 2314 at its no-checkpoint peak: two kept 72-byte values of
// the second block alive to its end, so the measured "full" step, and the keep-everything ceiling read from it, were 72
// bytes too high there, and auto dropped values at a limit that fits keeping everything). A replay of a dropped value
// runs no op after the one that wrote the state it was saved at, and reads a kept value only after the op that produced
// it (a view reads its metadata at any later state): so once no dropped value with a handle left (a saved slot autograd
// has not released: it may be unpacked, in this backward or, on a retained graph, the next) was saved after a kept
// value's producer ran, no replay can read that kept value, and live_ lets go of it: it is freed with its own slots, as
// without tapesac. (Taking a view's position from the writes to its storage, or a kept value's from its last write, let
// a view replayed under a lazy schedule find its input gone: random programs 1843, 2091, 2527, 2838.) Checked when a
// dropped value's last handle goes (the backward runs the calls' nodes last to first, so the kept values go from the
// last). Externals (block inputs, parameters, values held only for the replay) stay to the step's end, as the planner
// models them; so does everything under approximate replay, which reads more than the tape's closure.
//
// Note [Externals freed with their readers]. An external a replay reads — a value no recorded op produced: the output
// of a kernel that wrote outside the dispatcher (kept, opaque), a wrapped Python number a recorded op took as a 0-dim
// tensor, a block input, a parameter — was held in live_ to the step's end. Without tapesac it lives as long as the
// graph nodes that saved it (and whoever else holds it): random program 1336's second block held an opaque 216-byte
// output and two 8-byte scalars through the rest of its backward, which keeping everything had freed when the nodes
// that saved them ran; the measured step, and the keep-everything ceiling read from it, were 232 bytes too high
// there, and auto dropped values at a limit that fits keeping everything. A replay runs no op after `latest`, so an
// external whose first reader comes after it cannot be read any more, and live_ lets go of it — except the ones
// nothing but live_ held when the backward began (held_for_replay_): the peak models count those from the forward's
// end to the step's (Note [Sequence model in unusual steps], planner/peak_model.h), so they stay to the step's end.
// Block inputs and parameters are read by the first ops: they stay while any dropped value has a handle.
namespace {

// Per value: the first op of the tape that reads it (max() for a value no op reads).
std::vector<capture::OpIndex> first_readers(const Tape& tape) {
  std::vector<capture::OpIndex> out(tape.values().size(), std::numeric_limits<capture::OpIndex>::max());
  for (size_t i = 0; i < tape.ops().size(); ++i) {
    for (const capture::ArgRef& a : tape.ops()[i].inputs) {
      if (a.value < 0 || static_cast<size_t>(a.value) >= out.size()) continue;
      capture::OpIndex& r = out[static_cast<size_t>(a.value)];
      r = std::min(r, static_cast<capture::OpIndex>(i));
    }
  }
  return out;
}

}  // namespace

void BlockCall::release_kept_live() noexcept {
  if (!forward_closed_ || step_closed_ || approx_ != nullptr) return;
  const Tape& tape = recorder_.tape();
  // The last op a replay of a dropped value with a handle left may run: the one that produced it (a view op writes
  // nothing) or the writer of the state it was saved at, whichever is later.
  capture::OpIndex latest = -1;
  for (ValueId w : dropped_values_) {
    if (handles_[static_cast<size_t>(w)] <= 0) continue;
    const capture::ValueInfo& info = tape.value(w);
    const auto& writers = tape.storage(info.storage).writers;
    const int32_t state = value_state_[static_cast<size_t>(w)];
    latest = std::max(latest, info.producer);
    if (state >= 1 && static_cast<size_t>(state) <= writers.size()) {
      latest = std::max(latest, writers[static_cast<size_t>(state) - 1]);
    }
  }
  if (first_reader_.size() != tape.values().size()) first_reader_ = first_readers(tape);
  for (size_t k = 0; k < live_.size() && k < tape.values().size(); ++k) {
    if (!live_[k].defined()) continue;
    const capture::ValueInfo& info = tape.value(static_cast<ValueId>(k));
    if (info.producer != kExternal) {
      if (info.producer >= latest) live_[k].reset();
    } else if (first_reader_[k] > latest && !held_for_replay_.count(storage_key(live_[k]))) {
      live_[k].reset();  // Note [Externals freed with their readers]
    }
  }
}

int32_t BlockCall::saved_state(ValueId v) const {
  TAPESAC_INTERNAL_ASSERT(dropped(v), "block ", name_, ": v", v, " is not a dropped value");
  return value_state_[static_cast<size_t>(v)];
}

void BlockCall::release_all() noexcept {
  // No handle is left: nothing of this block call can be unpacked any more.
  cache_.clear();
  held_.clear();
  live_.clear();
  contract_.clear();
  available_.clear();
  std::fill(remaining_.begin(), remaining_.end(), 0);
  std::fill(handles_.begin(), handles_.end(), 0);
  recorder_.clear();
}

// Note [A block call whose forward raised]. A block whose forward raises, caught by the model (a kernel or
// out-of-memory fallback that runs the block again on halves), leaves a partial call: its graph dies with the
// exception, so it is never backwarded or replayed. It keeps what it saved (its tensors go with the graph) and is kept
// out of the planner: observed like a complete call, its must-keep bytes and replay entered the planner's floor, and
// "auto" refused a limit at the no-checkpoint peak (an adversarial test: 122,520 bytes named for 119,448 measured).
void BlockCall::close_forward(bool aborted) {
  aborted_ = aborted;
  recorder_.stop();
  {
    // Released outside the lock, and before drop(): the last reference to a saved tensor can free autograd nodes
    // whose saved slots call release(), which takes the lock (a deadlock in test_hf_zoo's Qwen3-Next, found by the
    // fresh-clone CI); and while held, the dropped storages looked alive to drop() (the planner's model then
    // predicted test_planner_auto's peaks 8% high).
    std::vector<c10::intrusive_ptr<c10::TensorImpl>> origins;
    std::lock_guard<std::mutex> lock(mu_);
    if (forward_closed_) return;
    resolve_pending(true);
    keep_rebound(origins);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (forward_closed_) return;
  forward_closed_ = true;
  take_recording();
  KeepDecision d = decide();
  observe(d);
  prepare_approx(d);
  const std::vector<Read> targets = drop(d);
  trim_live(targets);
  resolve_schedule(targets);
  // The span ends once the dropped tensors are freed: the planner's peak model reads the forward's windows.
  if (ctx_.memory) {
    ctx_.memory->add_span(TimelineSpan{"forward", name_, forward_begin_ns_, ctx_.memory->elapsed_ns(), ctx_.plan_key});
  }
  if (alive_slots_ == 0) release_all();
}

// Note [Rebound inside the block]. A tensor autograd saves as itself (Note [Saved as itself]) and the block then
// rebinds to another storage (`t.data = t.data * 2`, `t.data.set_(...)` on it) is read by its backward with the new
// data; the tape's value is the old bytes, which a replay rebuilds (random programs with such a write: every
// gradient off, silently). The saved tensor is held from its pack until the forward closes (no memory: the slot's
// alias holds its storage anyway); one whose storage changed meanwhile is kept as its new data, opaque to the tape.
void BlockCall::keep_rebound(std::vector<c10::intrusive_ptr<c10::TensorImpl>>& origins) {
  for (Slot& s : slots_) {
    if (!s.held_origin) continue;
    origins.push_back(std::move(s.held_origin));
    const c10::intrusive_ptr<c10::TensorImpl>& impl = origins.back();
    if (!impl->has_storage() || !s.tensor.defined() || !s.tensor.has_storage()) continue;
    if (impl->storage().unsafeGetStorageImpl() == s.tensor.storage().unsafeGetStorageImpl()) continue;
    s.tensor = capture::detached_alias(at::Tensor(impl));
    s.value = -1;  // opaque: kept as it is now
  }
}

void BlockCall::take_recording() {
  const Tape& tape = recorder_.tape();
  BlockStats& st = closed_stats_;
  st.ops_recorded = static_cast<int64_t>(tape.ops().size());
  st.saved_tensors = static_cast<int64_t>(slots_.size());
  st.capture_error = recorder_.error();
  st.op_timing = capture::op_timing_name(tape.op_timing());
  st.op_timing_note = recorder_.op_timing_note();
  live_ = recorder_.take_live();
  live_.resize(tape.values().size());
}

KeepDecision BlockCall::decide() {
  const Tape& tape = recorder_.tape();
  DecisionInput in;
  in.tape = &tape;
  for (const Slot& s : slots_) {
    if (s.value >= 0 && !s.released) in.saved.push_back(SavedValue{s.value, s.state});
  }
  in.capture_failed = !closed_stats_.capture_error.empty() || aborted_;
  in.policy = options_.policy;
  if (in.policy == PolicyKind::kSaveOps) {
    in.keep_op = [this](capture::OpKind k) {
      SaveOpCache& cache = *ctx_.save_cache;
      if (cache.size() <= static_cast<size_t>(k)) cache.resize(static_cast<size_t>(k) + 1, -1);
      int8_t& answer = cache[static_cast<size_t>(k)];
      if (answer < 0) answer = options_.save_op && options_.save_op(capture::op_kind_name(k)) ? 1 : 0;
      return answer == 1;
    };
  }
  if (in.policy == PolicyKind::kPlan && ctx_.plans != nullptr) {
    auto it = ctx_.plans->find(ctx_.plan_key);
    if (it != ctx_.plans->end()) in.plan = &it->second;
  }
  if (ctx_.keep_dependents != nullptr && !ctx_.keep_dependents->empty()) {
    in.kept_externals.assign(tape.values().size(), 0);
    for (size_t v = 0; v < live_.size() && v < in.kept_externals.size(); ++v) {
      if (live_[v].defined() && tape.value(static_cast<ValueId>(v)).producer == kExternal &&
          ctx_.keep_dependents->count(storage_key(live_[v]))) {
        in.kept_externals[v] = 1;
      }
    }
  }
  in.observed = ctx_.observer != nullptr && static_cast<bool>(*ctx_.observer);
  in.want_signature = in.observed || ctx_.graphs != nullptr;
  KeepDecision d;
  memo_ = nullptr;
  // Note [Decisions reused]; approximation changes the decision after it is made (prepare_approx), so it decides
  // afresh.
  if (ctx_.decisions != nullptr && ctx_.approx == nullptr) {
    DecisionMemo& m = (*ctx_.decisions)[name_];
    std::vector<int64_t>& key = m.scratch;
    decision_key(in, key);
    if (!m.key.empty() && m.key == key) {
      d = m.decision;
      closed_stats_.decision_reused = 1;
    } else {
      d = decide_keep(in);
      m.has_needed = false;
      if (d.policy_failed) {
        m.key.clear();
      } else {
        m.key.swap(key);
        m.decision = d;
      }
    }
    if (!m.key.empty()) memo_ = &m;
  } else {
    d = decide_keep(in);
  }
  signature_ = d.signature;
  closed_stats_.planned = d.planned;
  if (d.policy_failed && closed_stats_.capture_error.empty()) {
    closed_stats_.capture_error = "the policy callable raised; kept everything";
  }
  return d;
}

void BlockCall::observe(const KeepDecision& d) {
  if (ctx_.observer == nullptr || !*ctx_.observer || aborted_) return;
  const std::vector<uint8_t> kept = d.kept_mask();
  try {
    (*ctx_.observer)(BlockTapeView{name_, d.signature, recorder_.tape(), d.decidable, d.must_keep, kept, ctx_.plan_key});
  } catch (...) {
    // Planning input only: a failure to observe (out of memory) must not undo the block's drops; the planner
    // sees fewer calls and re-plans.
  }
}

void BlockCall::prepare_approx(KeepDecision& d) {
  if (ctx_.approx == nullptr) return;
  // Before the drop: importance is measured on the tensors the forward saved.
  std::vector<const at::Tensor*> tensor_of(recorder_.tape().values().size(), nullptr);
  for (const Slot& s : slots_) {
    if (s.value >= 0 && !s.released && tensor_of[static_cast<size_t>(s.value)] == nullptr) {
      tensor_of[static_cast<size_t>(s.value)] = &s.tensor;
    }
  }
  std::vector<ValueId> keep;
  try {
    approx_ = ctx_.approx->prepare(ApproxInput{recorder_.tape(), recorder_.payloads(), d.keep, tensor_of, d.state},
                                   keep, closed_stats_.approx);
  } catch (...) {
    approx_.reset();  // an optimisation only: on failure (out of memory) this call replays exactly
    keep.clear();
  }
  for (ValueId v : keep) d.force_keep(v);  // their replay would read an approximated component's output
}

std::vector<Read> BlockCall::drop(const KeepDecision& d) {
  // Kept values are what replay starts from (with the externals); dropping releases the slots' references. Bytes
  // are counted by unique storage (a storage that a kept tensor still holds is not freed by dropping another view):
  // (storage, bytes) pairs are collected, then sorted and counted once each.
  available_ = d.available;
  BlockStats& st = closed_stats_;
  using Counted = std::vector<std::pair<const void*, int64_t>>;
  Counted kept_storages, opaque_storages, dropped_storages;
  std::vector<const Slot*> dropped_slots;  // one per entry of dropped_storages before deduplication
  const size_t n = live_.size();
  std::vector<uint8_t> served(n, 0);  // a kept value is read from its first slot's tensor
  for (Slot& s : slots_) {
    if (s.released || (s.value >= 0 && d.keep[static_cast<size_t>(s.value)] == 0)) continue;
    if (s.value >= 0 && !served[static_cast<size_t>(s.value)]) {
      served[static_cast<size_t>(s.value)] = 1;
      live_[static_cast<size_t>(s.value)] = s.tensor;
    }
    const void* key = s.tensor.defined() ? storage_key(s.tensor) : nullptr;
    const bool counted = key != nullptr && ctx_.param_storages->count(key) == 0;
    ++st.kept_tensors;
    if (s.value < 0) ++st.opaque_tensors;
    if (!counted) continue;
    const int64_t bytes = storage_bytes(s.tensor);
    if (s.value < 0) opaque_storages.emplace_back(key, bytes);
    kept_storages.emplace_back(key, bytes);
  }
  auto unique_sorted = [](Counted& c) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end(), [](const auto& a, const auto& b) { return a.first == b.first; }), c.end());
  };
  auto sum = [](const Counted& c) {
    int64_t total = 0;
    for (const auto& [key, bytes] : c) total += bytes;
    return total;
  };
  unique_sorted(kept_storages);
  unique_sorted(opaque_storages);
  st.kept_bytes += sum(kept_storages);
  st.opaque_bytes += sum(opaque_storages);
  std::vector<Read> targets;
  handles_.assign(n, 0);
  value_state_.assign(n, -1);
  dropped_values_.clear();
  for (Slot& s : slots_) {
    if (s.released || s.value < 0 || d.keep[static_cast<size_t>(s.value)] != 0) continue;
    ++st.dropped_tensors;
    s.dropped = true;
    const void* key = s.tensor.defined() ? storage_key(s.tensor) : nullptr;
    s.storage = key;
    if (key != nullptr) {
      s.storage_data = s.tensor.storage().data();
      s.storage_nbytes = s.tensor.storage().nbytes();
      s.storage_weak = s.tensor.storage().getWeakStorageImpl();
      const bool kept = std::binary_search(kept_storages.begin(), kept_storages.end(), std::make_pair(key, std::numeric_limits<int64_t>::min()),
                                           [](const auto& a, const auto& b) { return a.first < b.first; });
      if (!kept) {
        dropped_storages.emplace_back(key, storage_bytes(s.tensor));
        dropped_slots.push_back(&s);
        if (ctx_.watcher) ctx_.watcher->keep_if_written(s.tensor);  // Note [A dropped value on a live storage]
      }
    }
    if (handles_[static_cast<size_t>(s.value)]++ == 0) {
      targets.push_back(Read{s.value, s.state});
      value_state_[static_cast<size_t>(s.value)] = s.state;
      dropped_values_.push_back(s.value);
      const capture::OpIndex producer = recorder_.tape().value(s.value).producer;
      if (producer < 0 || (recorder_.tape().op(producer).flags & capture::kUnwrittenBytes) == 0) {
        contract_.remember_bytes(s.value, s.tensor);
      }
    }
    s.tensor.reset();
  }
  unique_sorted(dropped_storages);
  st.dropped_bytes += sum(dropped_storages);
  mark_alive(dropped_slots);
  std::sort(dropped_values_.begin(), dropped_values_.end());
  remaining_ = handles_;
  return targets;
}

void BlockCall::trim_live(const std::vector<Read>& targets) {
  // Keep only the live tensors that replay will read. Which ones follows from the decision (the targets are the
  // dropped saved values in slot order): a reused decision reuses the answer (Note [Decisions reused]).
  const Tape& tape = recorder_.tape();
  DecisionMemo* memo = std::exchange(memo_, nullptr);
  if (memo != nullptr && memo->has_needed && memo->needed.size() == live_.size()) {
    for (size_t v = 0; v < live_.size(); ++v) {
      if (!memo->needed[v]) live_[v].reset();
    }
    contract_.watch_live(live_, recorder_.take_origins());
    return;
  }
  std::vector<uint8_t> needed(live_.size(), 0);
  if (!targets.empty()) {
    const PruneResult all = prune(tape, targets, available_);
    for (capture::OpIndex i : all.ops) {
      for (const capture::ArgRef& a : tape.op(i).inputs) {
        if (classify_read(tape, available_, a.value, a.state, a.meta_only) == ReadSource::kLive) {
          needed[static_cast<size_t>(a.value)] = 1;
        }
      }
    }
  }
  for (size_t v = 0; v < live_.size(); ++v) {
    if (!needed[v]) live_[v].reset();
  }
  contract_.watch_live(live_, recorder_.take_origins());
  if (memo != nullptr) {
    memo->needed = std::move(needed);
    memo->has_needed = true;
  }
}

void BlockCall::close_step() noexcept {
  recorder_.stop();
  std::vector<c10::intrusive_ptr<c10::TensorImpl>> origins;  // a forward that never closed: released after the lock
  std::lock_guard<std::mutex> lock(mu_);
  for (Slot& s : slots_) {
    if (s.held_origin) origins.push_back(std::move(s.held_origin));
  }
  closed_stats_.replays = replays_;
  closed_stats_.ops_replayed = replay_stats_.ops;
  closed_stats_.replay_ns = replay_stats_.ns;
  step_closed_ = true;
  unmark_alive();
  for (Slot& s : slots_) s.tensor.reset();
  cache_.clear();
  held_.clear();
  live_.clear();
  approx_.reset();
  recorder_.clear();
}

void BlockCall::mark_alive(const std::vector<const Slot*>& dropped_slots) {
  // Note [Dropped bytes still alive] (allocator/telemetry.h): what dropping did not free is marked on the memory
  // timeline, tagged with this call, until it is freed or the step ends, so the keep-everything ceiling does not
  // count it twice while the call's dropped bytes are pending (until its last replay begins; a value alive at
  // its unpack is served as it is and never rebuilt, Note [a dropped tensor still alive]).
  if (!dropped_slots.empty() && ctx_.memory) alive_tag_ = ctx_.memory->alive_tag(ctx_.plan_key);
  for (const Slot* s : dropped_slots) {
    if (storage_alive(*s) && allocator::mark_dropped_alive(s->storage_data, alive_tag_) > 0) {
      marked_alive_.push_back(s->storage_data);
    }
  }
}

void BlockCall::unmark_alive() noexcept {
  for (const void* data : marked_alive_) allocator::unmark_dropped_alive(data, alive_tag_);
  marked_alive_.clear();
}

void BlockCall::refresh_alive_dropped() {
  std::lock_guard<std::mutex> lock(mu_);
  refresh_alive_dropped_locked();
}

void BlockCall::refresh_alive_dropped_locked() {
  if (!forward_closed_ || step_closed_) return;
  std::vector<int32_t> alive;
  auto check = [&](int32_t k) {
    const Slot& s = slots_[static_cast<size_t>(k)];
    if (s.dropped && !s.released && storage_alive(s)) alive.push_back(k);
  };
  if (!alive_dropped_slots_) {
    for (size_t k = 0; k < slots_.size(); ++k) check(static_cast<int32_t>(k));
  } else {
    for (int32_t k : *alive_dropped_slots_) check(k);  // a value once dead stays dead
  }
  alive_dropped_slots_ = std::move(alive);
  // The inputs this call holds for its replay (live_) that nothing else holds: a plan that replays nothing would
  // not hold them.
  struct Ours {
    int64_t tensors = 0;       // our tensors on the storage
    int64_t storage_uses = 0;  // holders of the storage
    int64_t bytes = 0;
    bool only_us = true;       // no one else holds our tensors
  };
  // A storage a saved tensor of the call also has is held by a plan that keeps that tensor: not counted.
  std::unordered_set<const void*> saved;
  for (const Slot& s : slots_) {
    if (s.dropped) {
      saved.insert(s.storage);
    } else if (s.tensor.defined() && s.tensor.has_storage()) {
      saved.insert(storage_key(s.tensor));
    }
  }
  std::unordered_map<const void*, Ours> ours;
  for (const at::Tensor& t : live_) {
    if (!t.defined() || !t.has_storage()) continue;
    const void* key = storage_key(t);
    if (key == nullptr || ctx_.param_storages->count(key) || saved.count(key)) continue;
    Ours& o = ours[key];
    ++o.tensors;
    o.storage_uses = static_cast<int64_t>(t.storage().use_count());
    o.bytes = storage_bytes(t);
    o.only_us = o.only_us && t.use_count() == 1;
  }
  held_for_replay_bytes_ = 0;
  held_for_replay_.clear();
  for (const auto& [key, o] : ours) {
    if (o.only_us && o.storage_uses == o.tensors) {
      held_for_replay_bytes_ += o.bytes;
      held_for_replay_.insert(key);
    }
  }
}

void BlockCall::note_second_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  note_second_backward_locked();
}

void BlockCall::note_second_backward_locked() {
  for (const auto& [value, weak] : rebuilt_first_round_) {
    if (weak.lock() && !cache_.count(value) && !held_.count(value)) rebuilt_alive_at_second_.push_back(value);
  }
  rebuilt_first_round_.clear();
}

// Note [A graph held through its backward]. Autograd frees a node's saved tensors right after the node ran, unless
// the backward retains the graph (retain_graph=True): then every saved tensor stays until the graph goes, after the
// backward. The planner's windows counted a call's kept bytes as freed once its backward had run, so with one
// `backward(retain_graph=True)` per step (and no second backward, which the unpack counts show) auto's plans were
// over the limit in the backward and refused there, on every step (a helper's finding). A call shows it: none of
// the slots it served was released before the step's later unpacks (other calls') happened; the planner then
// counts every call's kept bytes in every backward window (StepExtras::retained, planner/peak_model.h).
bool BlockCall::held_through_backward(int64_t final_unpacks) const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_unpack_at_ >= 0 && last_unpack_at_ < final_unpacks && first_served_release_at_ >= final_unpacks;
}

DroppedLiveness BlockCall::liveness() const {
  std::lock_guard<std::mutex> lock(mu_);
  DroppedLiveness out;
  out.name = name_;
  std::unordered_set<ValueId> seen;
  if (alive_dropped_slots_) {
    for (int32_t k : *alive_dropped_slots_) {
      const ValueId v = slots_[static_cast<size_t>(k)].value;
      if (seen.insert(v).second) out.alive_after_forward.push_back(v);
    }
  }
  out.held_for_replay_bytes = held_for_replay_bytes_;
  out.rebuilt_alive_at_second = rebuilt_alive_at_second_;
  out.second_backward_ns = second_backward_ns_;
  out.alive_at_unpack.assign(alive_at_unpack_.begin(), alive_at_unpack_.end());
  std::sort(out.alive_at_unpack.begin(), out.alive_at_unpack.end());
  return out;
}

BlockStats BlockCall::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  BlockStats st = closed_stats_;
  st.replays = replays_;
  st.ops_replayed = replay_stats_.ops;
  st.replay_ns = replay_stats_.ns;
  for (size_t i = 0; i < graph_op_ns_.size(); ++i) {  // the ops whose nodes ran in a timed launch
    if (graph_op_ns_[i] <= 0) continue;
    st.graph_op_ns.push_back(OpTime{static_cast<int64_t>(i), i < graph_op_names_.size() ? graph_op_names_[i] : "",
                                    graph_op_ns_[i]});
  }
  return st;
}

std::vector<std::string> BlockCall::op_names() const {
  std::vector<std::string> names;
  for (const capture::OpRecord& op : recorder_.tape().ops()) names.push_back(capture::op_kind_name(op.kind));
  return names;
}

}  // namespace tapesac::replay
