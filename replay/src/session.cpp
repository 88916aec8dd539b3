// Block calls and the step session (see session.h).
#include "tapesac/replay/session.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#ifdef TAPESAC_WITH_CUDA
#include "tapesac/cuda/arena.h"
#endif

#include "tapesac/capture/errors.h"
#include "tapesac/capture/op_kinds.h"
#include "fnv.h"

namespace tapesac::replay {
namespace {

using capture::kExternal;
using capture::storage_key;
using capture::Tape;
using capture::ValueId;

int64_t storage_bytes(const at::Tensor& t) { return t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0; }

// FNV-1a over the tensor's bytes in logical (contiguous) order; CUDA tensors are copied to the host first.
uint64_t byte_checksum(const at::Tensor& t) {
  at::Tensor c = t.is_cpu() ? t.contiguous() : t.to(c10::kCPU).contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << " " << t.sizes();
  return os.str();
}

int64_t elapsed_ns(const StepMemory& m) { return m.counter ? m.counter->elapsed_ns() : 0; }

// Sets the counter's phase for a scope and puts the previous one back (also when the scope throws).
class PhaseScope {
 public:
  PhaseScope(allocator::MemoryCounter* c, allocator::Phase p) : c_(c), prev_(c ? c->phase() : p) {
    if (c_) c_->set_phase(p);
  }
  ~PhaseScope() {
    if (c_) c_->set_phase(prev_);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  allocator::MemoryCounter* c_;
  allocator::Phase prev_;
};

}  // namespace

void StepMemory::add_span(TimelineSpan span) {
  std::lock_guard<std::mutex> lock(spans_mu);
  if (spans.size() < 100000) spans.push_back(std::move(span));
}

void StepMemory::add_record(ReplayRecord record) {
  std::lock_guard<std::mutex> lock(spans_mu);
  if (records.size() < 100000) records.push_back(std::move(record));
}

BlockCall::BlockCall(std::string name, const SessionOptions* options,
                     const std::unordered_set<const void*>* param_storages, std::vector<int8_t>* save_cache,
                     size_t expected_ops, std::shared_ptr<StepMemory> memory, const Session* session)
    : name_(std::move(name)),
      memory_(std::move(memory)),
      session_(session),
      options_(options),
      param_storages_(param_storages),
      save_cache_(save_cache),
      recorder_(capture::RecorderOptions{true, true, expected_ops}) {
  closed_stats_.name = name_;
  if (session_ != nullptr) watcher_ = session_->watcher();
}

BlockCall::~BlockCall() { recorder_.stop(); }

void BlockCall::start_forward() {
  if (watcher_) watcher_->resume();
  if (memory_ && memory_->counter) {
    memory_->counter->set_phase(allocator::Phase::kForward);
    forward_begin_ns_ = memory_->counter->elapsed_ns();
  }
  recorder_.set_listener(this);
  if (options_->op_timers) {  // device op times (capture/op_timer.h); none: the recorder's CPU clock
    std::string why;
    std::unique_ptr<capture::OpTimer> timer = options_->op_timers->make(name_, &why);
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
      s.pending = false;
      s.pending_impl = nullptr;
      s.pending_ref.reset();
    } else if (final || !recorder_.op_open()) {
      s.pending = false;  // opaque: the tape did not produce it
      s.pending_impl = nullptr;
      s.pending_ref.reset();
    } else {
      *keep++ = idx;
    }
  }
  pending_.erase(keep, pending_.end());
}

int32_t BlockCall::pack(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  TAPESAC_INTERNAL_ASSERT(!forward_closed_, "pack after the forward of block ", name_, " closed");
  Slot s;
  s.tensor = capture::detached_alias(t);
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

void BlockCall::release(int32_t slot) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (step_closed_ || slot < 0 || static_cast<size_t>(slot) >= slots_.size()) return;
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.released) return;
  s.released = true;
  s.tensor.reset();
  if (s.dropped) {
    const ValueId v = s.value;
    --handles_[v];
    if (s.last_round != round_ && --remaining_[v] <= 0) cache_.erase(v);
  }
  if (--alive_slots_ == 0 && forward_closed_) release_all();
}

void BlockCall::release_all() noexcept {
  // No handle is left: nothing of this block call can be unpacked any more.
  cache_.clear();
  live_.clear();
  live_versions_.clear();
  available_.clear();
  remaining_.clear();
  handles_.clear();
  recorder_.clear();
}

bool BlockCall::keep_by_policy(ValueId v, int32_t state) {
  const Tape& tape = recorder_.tape();
  // The policy names the op that computed the bytes: for a view (e.g. _unsafe_view of an mm), the storage's last
  // writer before the read, not the view op.
  const capture::StorageInfo& storage = tape.storage(tape.value(v).storage);
  const capture::OpIndex p = (!storage.external && state > 0 && static_cast<size_t>(state) <= storage.writers.size())
                                 ? storage.writers[static_cast<size_t>(state) - 1]
                                 : tape.value(v).producer;
  switch (options_->policy) {
    case PolicyKind::kNone:
      return true;
    case PolicyKind::kFull:
    case PolicyKind::kPlan:
      return false;
    case PolicyKind::kSaveOps: {
      const capture::OpKind k = tape.op(p).kind;
      if (save_cache_->size() <= static_cast<size_t>(k)) save_cache_->resize(static_cast<size_t>(k) + 1, -1);
      int8_t& d = (*save_cache_)[static_cast<size_t>(k)];
      if (d < 0) d = options_->save_op && options_->save_op(capture::op_kind_name(k)) ? 1 : 0;
      return d == 1;
    }
  }
  return true;
}

void BlockCall::close_forward() {
  recorder_.stop();
  std::lock_guard<std::mutex> lock(mu_);
  if (forward_closed_) return;
  forward_closed_ = true;
  resolve_pending(true);
  const Tape& tape = recorder_.tape();
  BlockStats& st = closed_stats_;
  st.ops_recorded = static_cast<int64_t>(tape.ops().size());
  st.saved = static_cast<int64_t>(slots_.size());
  st.capture_error = recorder_.error();
  st.op_timing = capture::op_timing_name(tape.op_timing());
  st.op_timing_note = recorder_.op_timing_note();
  live_ = recorder_.take_live();
  live_.resize(tape.values().size());
  origins_ = recorder_.take_origins();
  available_.assign(tape.values().size(), 0);

  // Values a replay could start from: externals (always), values the policy keeps, values that cannot be rebuilt.
  // Pass 1: values nobody decides on (capture failed, external) are kept; the rest are the *decidable* values.
  std::vector<int8_t> decision(tape.values().size(), -1);  // 1 keep, 0 drop, 2 undecided
  std::vector<int32_t> state_of_value(tape.values().size(), 0);
  std::vector<ValueId> decidable;
  std::vector<const at::Tensor*> tensor_of(tape.values().size(), nullptr);
  for (Slot& s : slots_) {
    if (s.value < 0 || s.released) continue;
    const auto v = static_cast<size_t>(s.value);
    state_of_value[v] = s.state;
    if (tensor_of[v] == nullptr) tensor_of[v] = &s.tensor;
    if (decision[v] >= 0) continue;
    const capture::ValueInfo& info = tape.value(s.value);
    if (!st.capture_error.empty() || info.producer == kExternal || tape.storage(info.storage).external) {
      decision[v] = 1;
      available_[v] = 1;
      live_[v] = s.tensor;
    } else {
      decision[v] = 2;
      decidable.push_back(s.value);
    }
  }
  std::sort(decidable.begin(), decidable.end());
  // Values whose rebuild would read a storage the preservation plan keeps dependents of (see
  // Session::set_preservation): kept like the ones that cannot be rebuilt. Over-approximated by data flow.
  std::vector<uint8_t> tainted;
  if (session_ != nullptr && !session_->keep_dependents().empty()) {
    const auto& keep_of = session_->keep_dependents();
    tainted.assign(tape.values().size(), 0);
    for (size_t v = 0; v < live_.size() && v < tainted.size(); ++v) {
      if (live_[v].defined() && tape.value(static_cast<ValueId>(v)).producer == kExternal &&
          keep_of.count(storage_key(live_[v]))) {
        tainted[v] = 1;
      }
    }
    for (const capture::OpRecord& op : tape.ops()) {
      bool in = false;
      for (const capture::ArgRef& a : op.inputs) in = in || tainted[static_cast<size_t>(a.value)];
      if (!in) continue;
      for (ValueId o : op.outputs) {
        if (o >= 0) tainted[static_cast<size_t>(o)] = 1;
      }
    }
  }
  // Values that cannot be rebuilt (non-replayable producers, reads of external state at an earlier state) must be
  // kept whatever the policy says. In tape order, each one found is made available at once, so that later values
  // can be rebuilt from it.
  std::vector<uint8_t> must_keep(decidable.size(), 0);
  // policy "none" keeps every decidable value whatever must_keep says; only the tape observer (the planner) reads
  // must_keep then, so without one the per-value prunes (each O(tape)) are skipped.
  const bool observed = session_ != nullptr && static_cast<bool>(session_->tape_observer());
  const bool keep_all = options_->policy == PolicyKind::kNone && !observed;
  for (size_t i = 0; i < decidable.size() && !keep_all; ++i) {
    const ValueId v = decidable[i];
    const bool preserved_by_keeping = !tainted.empty() && tainted[static_cast<size_t>(v)];
    if (!preserved_by_keeping && prune(tape, {Read{v, state_of_value[static_cast<size_t>(v)]}}, available_).ok) {
      continue;
    }
    must_keep[i] = 1;
    available_[static_cast<size_t>(v)] = 1;
  }
  const bool planning = options_->policy == PolicyKind::kPlan;
  const bool graphed = session_ != nullptr && session_->graph_cache() != nullptr;
  const uint64_t signature = (planning || observed || graphed) ? tape_signature(tape, decidable) : 0;
  st.signature = signature;
  const BlockPlan* plan = planning ? find_plan() : nullptr;
  const bool plan_applies = plan != nullptr && plan->signature == signature && plan->keep.size() == decidable.size();
  st.planned = plan_applies ? 1 : 0;
  bool policy_failed = false;
  std::vector<ValueId> candidates;
  for (size_t i = 0; i < decidable.size(); ++i) {
    const ValueId v = decidable[i];
    bool keep = must_keep[i] != 0;
    if (!keep) {
      if (planning) {
        keep = plan_applies && plan->keep[i] != 0;  // no matching plan: run as "full" (the planner re-plans)
      } else {
        try {
          keep = keep_by_policy(v, state_of_value[static_cast<size_t>(v)]);
        } catch (...) {
          policy_failed = true;  // the policy callable raised: keep, and say so in the stats
          keep = true;
        }
      }
    }
    decision[static_cast<size_t>(v)] = keep ? 1 : 0;
    if (keep) {
      available_[static_cast<size_t>(v)] = 1;
      live_[static_cast<size_t>(v)] = *tensor_of[static_cast<size_t>(v)];
    } else {
      candidates.push_back(v);
    }
  }
  if (policy_failed && st.capture_error.empty()) st.capture_error = "the policy callable raised; kept everything";
  for (ValueId v : candidates) {
    const PruneResult r = prune(tape, {Read{v, state_of_value[static_cast<size_t>(v)]}}, available_);
    if (r.ok) continue;
    decision[static_cast<size_t>(v)] = 1;
    available_[static_cast<size_t>(v)] = 1;
    live_[static_cast<size_t>(v)] = *tensor_of[static_cast<size_t>(v)];
  }
  if (observed) {
    std::vector<uint8_t> kept(decidable.size(), 0);
    for (size_t i = 0; i < decidable.size(); ++i) kept[i] = decision[static_cast<size_t>(decidable[i])] == 1 ? 1 : 0;
    try {
      session_->tape_observer()(BlockTapeView{name_, signature, tape, decidable, must_keep, kept});
    } catch (...) {
      // Planning input only: a failure to observe (out of memory) must not undo the block's drops; the planner
      // sees fewer calls and re-plans.
    }
  }

  if (session_ != nullptr && session_->approx() != nullptr) {
    // Before the drop: importance is measured on the tensors the forward saved.
    std::vector<ValueId> keep;
    try {
      approx_ = session_->approx()->prepare(
          ApproxInput{tape, recorder_.payloads(), decision, tensor_of, state_of_value}, keep, st.approx);
    } catch (...) {
      approx_.reset();  // an optimisation only: on failure (out of memory) this call replays exactly
      keep.clear();
    }
    for (ValueId v : keep) {  // their replay would read an approximated component's output
      decision[static_cast<size_t>(v)] = 1;
      available_[static_cast<size_t>(v)] = 1;
      live_[static_cast<size_t>(v)] = *tensor_of[static_cast<size_t>(v)];
    }
  }

  // Drop: release the slots' references; count bytes by unique storage (a storage that a kept tensor still
  // holds is not freed by dropping another view of it).
  std::unordered_set<const void*> kept_storages, opaque_storages, dropped_storages;
  std::vector<Read> targets;
  for (Slot& s : slots_) {
    if (s.released || (s.value >= 0 && decision[static_cast<size_t>(s.value)] == 0)) continue;
    const void* key = s.tensor.defined() ? storage_key(s.tensor) : nullptr;
    const bool counted = key != nullptr && param_storages_->count(key) == 0;
    ++st.kept;
    if (s.value < 0) {
      ++st.opaque;
      if (counted && opaque_storages.insert(key).second) st.opaque_bytes += storage_bytes(s.tensor);
    }
    if (counted && kept_storages.insert(key).second) st.kept_bytes += storage_bytes(s.tensor);
  }
  for (Slot& s : slots_) {
    if (s.released || s.value < 0 || decision[static_cast<size_t>(s.value)] != 0) continue;
    ++st.dropped;
    s.dropped = true;
    const void* key = s.tensor.defined() ? storage_key(s.tensor) : nullptr;
    if (key && !kept_storages.count(key) && dropped_storages.insert(key).second) {
      st.dropped_bytes += storage_bytes(s.tensor);
    }
    if (handles_[s.value]++ == 0) {
      targets.push_back(Read{s.value, s.state});
      if (options_->check_bytes) checksums_[s.value] = byte_checksum(s.tensor);
    }
    s.tensor.reset();
  }
  remaining_ = handles_;

  // Keep only the live tensors that replay will read.
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
  live_versions_.assign(live_.size(), 0);
  live_marks_.assign(live_.size(), 0);
  for (size_t v = 0; v < live_.size(); ++v) {
    if (live_[v].defined() && !live_[v].is_inference()) {
      live_versions_[v] = live_[v].unsafeGetTensorImpl()->version_counter().current_version();
      if (watcher_ && options_->check_versions) live_marks_[v] = watcher_->watch(live_[v]);
    }
  }
  value_state_.clear();
  for (const Read& r : targets) value_state_[r.value] = r.state;
  // The span ends once the dropped tensors are freed: the planner's peak model reads the forward's windows.
  if (memory_) memory_->add_span(TimelineSpan{"forward", name_, forward_begin_ns_, elapsed_ns(*memory_)});
  if (alive_slots_ == 0) release_all();
}

const BlockPlan* BlockCall::find_plan() const {
  if (session_ == nullptr) return nullptr;
  auto it = session_->plans().find(name_);
  return it == session_->plans().end() ? nullptr : &it->second;
}

uint64_t tape_signature(const Tape& tape, const std::vector<ValueId>& candidates) {
  // FNV-1a over the structure; sizes included, durations and addresses not.
  Fnv64 fnv;
  auto mix = [&fnv](uint64_t x) { fnv.mix(x); };
  mix(tape.ops().size());
  mix(tape.values().size());
  for (const capture::OpRecord& op : tape.ops()) {
    mix(static_cast<uint64_t>(op.kind));
    mix(op.flags);
    for (const capture::ArgRef& a : op.inputs) {
      mix(static_cast<uint64_t>(a.value));
      mix(static_cast<uint64_t>(a.state));
    }
    for (ValueId v : op.outputs) mix(static_cast<uint64_t>(v));
  }
  for (const capture::ValueInfo& v : tape.values()) {
    mix(static_cast<uint64_t>(v.storage));
    mix(static_cast<uint64_t>(v.meta.nbytes));
  }
  for (const capture::StorageInfo& st : tape.storages()) mix(static_cast<uint64_t>(st.nbytes));
  mix(candidates.size());
  for (ValueId v : candidates) mix(static_cast<uint64_t>(v));
  return fnv.value();
}

void BlockCall::check_version(const Slot& s, int32_t slot) const {
  if (!options_->check_versions || !s.version.enabled()) return;
  const uint32_t now = s.version.current_version();
  if (now == s.saved_version) return;
  std::ostringstream msg;
  msg << "tapesac: tensor #" << slot << " saved for backward in block '" << name_
      << "' was modified by an in-place operation after the forward (its version went from " << s.saved_version
      << " to " << now
      << "); its gradient would be wrong. Do not modify tensors the backward needs before calling backward (use an "
         "out-of-place op, or .clone() before the in-place op).";
  record(s.value, "rejected", 0, 0, msg.str());
  throw Error(ErrorKind::kReplayContract, msg.str());
}

std::unordered_map<ValueId, at::Tensor> BlockCall::resolve_live(
    const PruneResult& plan, ValueId wanted, std::string* recovered,
    std::vector<std::unique_ptr<WriteWatcher::Swap>>* swaps) {
  std::unordered_map<ValueId, at::Tensor> subs;
  std::unordered_set<const void*> swapped;  // storages whose regions are already swapped back for this replay
  if (!options_->check_versions) return subs;
  const Tape& tape = recorder_.tape();
  for (capture::OpIndex i : plan.ops) {
    for (const capture::ArgRef& a : tape.op(i).inputs) {
      const auto v = static_cast<size_t>(a.value);
      if (v >= live_.size() || !live_[v].defined() || live_[v].is_inference() || subs.count(a.value)) continue;
      if (classify_read(tape, available_, a.value, a.state, a.meta_only) != ReadSource::kLive) continue;
      const uint32_t now = live_[v].unsafeGetTensorImpl()->version_counter().current_version();
      if (v < origins_.size()) {
        std::string replaced = replaced_storage(origins_[v], live_[v]);
        if (!replaced.empty() && recovered->find(replaced) == std::string::npos) {
          if (!recovered->empty()) *recovered += "; ";
          *recovered += "v" + std::to_string(a.value) + " (input of op #" + std::to_string(i) + " " +
                        capture::op_kind_name(tape.op(i).kind) + "): " + replaced;
        }
      }
      // Writes the watcher saw that bypassed the version counter (through `.data` or another detached alias).
      const int64_t seen = watcher_ ? watcher_->writes_since(live_[v], live_marks_[v]) : 0;
      if (now == live_versions_[v] && seen == 0) continue;
      std::string why = "preserve=\"off\"";
      if (swapped.count(storage_key(live_[v]))) continue;
      if (watcher_ && now >= live_versions_[v]) {
        WriteWatcher::Restored r = watcher_->restore(live_[v], live_marks_[v], now - live_versions_[v], &why);
        if (r.copy.defined() || r.swap) {
          if (!recovered->empty()) *recovered += "; ";
          *recovered += "v" + std::to_string(a.value) + " (" + describe_tensor(live_[v]) + ", input of op #" +
                        std::to_string(i) + " " + capture::op_kind_name(tape.op(i).kind) + ") written " +
                        std::to_string(now - live_versions_[v]) + "x after the forward: rebuilt from " +
                        preserve_mode_name(watcher_->mode());
          if (r.swap) {
            swapped.insert(storage_key(live_[v]));
            swaps->push_back(std::move(r.swap));
          } else {
            subs.emplace(a.value, std::move(r.copy));
          }
          continue;
        }
      }
      std::ostringstream msg;
      msg << "tapesac: replaying block '" << name_ << "' needs a tensor (" << describe_tensor(live_[v])
          << ", input of op #" << i << " " << capture::op_kind_name(tape.op(i).kind)
          << ") that was modified in place after the block's forward (version " << live_versions_[v] << " -> "
          << now << "), and it cannot be rebuilt as the forward saw it: " << why
          << ". Modify block inputs, parameters and buffers only after backward (e.g. optimizer.step() after "
             "loss.backward()), make the write on the step's thread with preserve=\"regions\" or "
             "\"snapshots\" (the default \"auto\" includes them), or .clone() the tensor before the block reads it.";
      record(wanted, "rejected", 0, 0, msg.str());
      throw Error(ErrorKind::kReplayContract, msg.str());
    }
  }
  return subs;
}

std::string BlockCall::replaced_storage(const c10::weak_intrusive_ptr<c10::TensorImpl>& origin,
                                        const at::Tensor& held) {
  if (!held.defined() || !held.has_storage()) return {};
  c10::intrusive_ptr<c10::TensorImpl> now = origin.lock();
  if (!now || !now->has_storage()) return {};
  if (now->storage().unsafeGetStorageImpl() == held.storage().unsafeGetStorageImpl()) return {};
  return "its tensor's storage was replaced after the forward (`.data = ...` or set_); tapesac served the bytes "
         "the forward used (the gradient of the loss as computed), where a run without tapesac would mix in the "
         "new data";
}

void BlockCall::record(ValueId v, const std::string& status, int64_t bytes, int64_t ns, std::string detail) const {
  if (!memory_) return;
  const Tape& tape = recorder_.tape();
  ReplayRecord r;
  r.block = name_;
  r.value = v;
  if (v >= 0 && static_cast<size_t>(v) < tape.values().size()) {
    const capture::ValueInfo& info = tape.value(v);
    const capture::StorageInfo& st = tape.storage(info.storage);
    const auto it = value_state_.find(v);
    const int32_t state = it != value_state_.end() ? it->second : info.state;
    const capture::OpIndex p = (!st.external && state > 0 && static_cast<size_t>(state) <= st.writers.size())
                                   ? st.writers[static_cast<size_t>(state) - 1]
                                   : info.producer;
    r.op = p >= 0 ? capture::op_kind_name(tape.op(p).kind) : std::string("external");
  }
  r.status = status;
  r.bytes = bytes;
  r.ns = ns;
  r.replay = replays_;
  r.detail = std::move(detail);
  memory_->add_record(std::move(r));
}

std::vector<Read> BlockCall::limit_targets(std::vector<Read> targets, const Read& wanted, PruneResult& plan) {
  const Tape& tape = recorder_.tape();
  const int64_t whole = predict_working_set(tape, plan, targets);
  closed_stats_.predicted_replay_bytes = std::max(closed_stats_.predicted_replay_bytes, whole);
  const int64_t limit = options_->memory_limit;
  if (limit <= 0 || !memory_) return targets;
  const int64_t in_use = in_use_now();
  int64_t piece = whole;
  std::vector<Read> piece_targets{wanted};
  PruneResult piece_plan;
  if (targets.size() > 1 && in_use + whole > limit) {
    piece_plan = prune(tape, piece_targets, available_);
    piece = predict_working_set(tape, piece_plan, piece_targets);
  }
  const allocator::LimitDecision d = allocator::decide(limit, in_use, whole, piece);
  switch (d.verdict) {
    case allocator::LimitVerdict::kWhole:
      return targets;
    case allocator::LimitVerdict::kPieces:
      ++closed_stats_.replay_pieces;
      ++memory_->replay_pieces;
      plan = std::move(piece_plan);
      return piece_targets;
    case allocator::LimitVerdict::kReject:
      break;
  }
  throw Error(ErrorKind::kMemoryLimit, allocator::rejection_message(d, name_, "the backward (replay)"));
}

int BlockCall::live_cuda_device() const {
  for (const at::Tensor& t : live_) {
    if (t.defined()) return t.is_cuda() ? t.get_device() : -1;
  }
  return -1;
}

int64_t BlockCall::in_use_now() const {
  int64_t in_use = memory_ ? memory_->in_use() : 0;
#ifdef TAPESAC_WITH_CUDA
  if (const int dev = live_cuda_device(); dev >= 0) in_use = cuda::allocated_bytes(dev);
#endif
  return in_use;
}

std::unordered_map<ValueId, at::Tensor> BlockCall::replay_graph(const std::vector<Read>& targets,
                                                               const PruneResult& plan,
                                                               const std::vector<at::Tensor>& live) {
  GraphCache* graphs = session_ != nullptr ? session_->graph_cache() : nullptr;
  if (graphs == nullptr) return {};
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
  call.available = &available_;
  call.signature = st.signature;
  call.memory_limit = std::max(options_->memory_limit, options_->graph_memory_limit);
  if (call.memory_limit > 0) {
    // The graph's static memory stays for the rest of the step and every later one: it must fit on top of the
    // step's peak so far and of the previous step's measured peak, not only of what is in use now.
    call.in_use = in_use_now();
    if (memory_ && memory_->counter) call.in_use = std::max(call.in_use, memory_->baseline + memory_->counter->total().peak);
    call.last_peak = session_->last_peak();
#ifdef TAPESAC_WITH_CUDA
    if (const int dev = live_cuda_device(); dev >= 0) {
      call.in_use = std::max(call.in_use, cuda::device_memory(dev).allocated_peak);
    }
#endif
  }
  GraphReplayOutcome outcome;
  auto out = graphs->replay(call, targets, plan, &outcome);
  if (outcome.captured) ++st.graph_captures;
  if (outcome.launched) {
    ++st.graph_replays;
    st.graph_staged_bytes += outcome.staged_bytes;
    st.graph_nodes_enabled = static_cast<int64_t>(outcome.enabled_nodes);
    st.graph_nodes_disabled = static_cast<int64_t>(outcome.disabled_nodes);
    if (outcome.timed) {
      ++st.graph_timed_launches;
      st.graph_timing = capture::op_timing_name(outcome.timing);
      if (st.graph_op_ns.size() < outcome.op_ns.size()) st.graph_op_ns.resize(outcome.op_ns.size(), 0);
      if (st.graph_op_names.empty()) st.graph_op_names = op_names();
      for (size_t i = 0; i < outcome.op_ns.size(); ++i) {
        st.graph_op_ns[i] += outcome.op_ns[i];
        st.graph_device_ns += outcome.op_ns[i];
      }
      st.graph_unattributed_ns += outcome.unattributed_ns;
    } else if (!outcome.timing_note.empty()) {
      st.graph_timing_note = outcome.timing_note;
    }
    replay_stats_.ops += static_cast<int64_t>(plan.ops.size());
    for (capture::OpIndex i : plan.ops) ++replay_stats_.ops_by_kind[recorder_.tape().op(i).kind];
  } else if (outcome.warmup) {
    ++st.graph_warmups;
  } else {
    ++st.graph_fallbacks;
    st.graph_fallback = to_string(outcome.reason);
    st.graph_detail = outcome.detail;
  }
  return out;
}

at::Tensor BlockCall::unpack(int32_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  TAPESAC_CHECK(!step_closed_, kGeneric, "tapesac: a tensor saved in block '", name_,
                "' was unpacked after its step ended. Run the backward inside `with sac.step():` (forward and "
                "backward of one step both belong inside the `with` block).");
  TAPESAC_CHECK(slot >= 0 && static_cast<size_t>(slot) < slots_.size(), kGeneric, "tapesac: unknown saved slot ", slot);
  const Slot& s = slots_[static_cast<size_t>(slot)];
  TAPESAC_INTERNAL_ASSERT(!s.released, "slot ", slot, " of block ", name_, " unpacked after its handle was freed");
  // The first unpack of the step marks the start of the backward on the memory timeline.
  if (memory_ && memory_->counter && memory_->counter->phase() == allocator::Phase::kForward) {
    memory_->counter->set_phase(allocator::Phase::kBackward);
    if (watcher_) watcher_->pause();
  }
  check_version(s, slot);
  if (!s.dropped) {
    TAPESAC_INTERNAL_ASSERT(s.tensor.defined(), "kept slot ", slot, " of block ", name_, " holds no tensor");
    if (!s.replaced_reported) {
      std::string replaced = replaced_storage(s.origin, s.tensor);
      if (!replaced.empty()) {
        slots_[static_cast<size_t>(slot)].replaced_reported = true;
        record(s.value, "recovered", 0, 0, "saved tensor #" + std::to_string(slot) + ": " + replaced);
      }
    }
    return s.tensor;
  }
  const ValueId v = s.value;
  auto it = cache_.find(v);
  if (it == cache_.end()) {
    if (remaining_[v] <= 0) {  // a new backward over the same graph (retain_graph=True)
      ++round_;
      remaining_ = handles_;
    }
    std::vector<Read> targets;
    for (const auto& [value, count] : remaining_) {
      if (count > 0 && !cache_.count(value)) targets.push_back(Read{value, value_state_.at(value)});
    }
    std::sort(targets.begin(), targets.end(), [](const Read& a, const Read& b) { return a.value < b.value; });
    PruneResult plan = prune(recorder_.tape(), targets, available_);
    std::string recovered;
    // Declared before the replay's tensors: the step's bytes are swapped back in only after the replay ends.
    std::vector<std::unique_ptr<WriteWatcher::Swap>> swaps;
    std::unordered_map<ValueId, at::Tensor> subs = resolve_live(plan, v, &recovered, &swaps);
    allocator::MemoryCounter* counter = memory_ ? memory_->counter.get() : nullptr;
    PhaseScope phase(counter, allocator::Phase::kReplay);
    const int64_t begin_ns = memory_ ? elapsed_ns(*memory_) : 0;
    const int64_t window_start = counter ? counter->begin_window() : 0;
    const int64_t allocated_before = counter ? counter->total().allocated : 0;
    ReplaySource src;
    src.tape = &recorder_.tape();
    src.payloads = &recorder_.payloads();
    std::vector<at::Tensor> live_with_subs;
    if (!subs.empty()) {
      live_with_subs = live_;
      for (auto& [value, tensor] : subs) live_with_subs[static_cast<size_t>(value)] = std::move(tensor);
      src.live = &live_with_subs;
    } else {
      src.live = &live_;
    }
    src.available = &available_;
    ReplayOptions opts;
    opts.check_metadata = options_->check_metadata;
    opts.op_override = approx_.get();
    const int64_t ns_before = replay_stats_.ns;
    // A graph launch allocates nothing (its memory is static), so the limit is applied to eager replays only.
    // The graph path runs before the eager replay's arena routing: a capture routes its own allocations into the
    // arena (the graph device's pool), and the allocator refuses a second routing to a pool already routed.
    const auto t_graph = std::chrono::steady_clock::now();
    auto out = replay_graph(targets, plan, *src.live);
    if (!out.empty()) {
      replay_stats_.ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t_graph).count();
    } else {
#ifdef TAPESAC_WITH_CUDA
      std::optional<cuda::ArenaRouting> arena_routing;
      if (options_->arena_pool_id.second != 0 || options_->arena_pool_id.first != 0) {
        arena_routing.emplace(options_->arena_device, options_->arena_pool_id.first, options_->arena_pool_id.second);
      }
#endif
      targets = limit_targets(std::move(targets), Read{v, value_state_.at(v)}, plan);
      out = replay(src, targets, opts, &replay_stats_);
    }
    if (approx_) approx_->finish(out);
    live_with_subs.clear();
    swaps.clear();  // the step's bytes back in the storages the replay read
    const int64_t replay_ns = replay_stats_.ns - ns_before;
    if (counter != nullptr) {
      const int64_t ws = counter->window_peak() - window_start;
      closed_stats_.replay_peak_bytes = std::max(closed_stats_.replay_peak_bytes, ws);
      closed_stats_.replayed_bytes += counter->total().allocated - allocated_before;
      memory_->arena.on_replay(name_, ws);
    }
    if (memory_) memory_->add_span(TimelineSpan{"replay", name_, begin_ns, elapsed_ns(*memory_)});
    for (auto& [value, tensor] : out) {
      const int64_t nbytes = static_cast<int64_t>(tensor.numel()) * static_cast<int64_t>(tensor.element_size());
      if (options_->check_bytes) {
        auto c = checksums_.find(value);
        if (c != checksums_.end() && c->second != byte_checksum(tensor)) {
          std::ostringstream msg;
          msg << "tapesac: replay of block '" << name_ << "' diverged: the rebuilt tensor v" << value << " ("
              << describe_tensor(tensor)
              << ") differs bytewise from the one the forward saved. A kernel in the block is not deterministic "
                 "(enable torch.use_deterministic_algorithms(True)) or state it reads changed without a version "
                 "bump (a .data write, a write through numpy); keep its outputs with a policy set to avoid "
                 "replaying it.";
          record(value, "divergent", nbytes, replay_ns, msg.str());
          ++replays_;
          throw Error(ErrorKind::kReplayContract, msg.str());
        }
      }
      const bool approximated = approx_ && approx_->approximates(value);
      record(value, approximated ? "approximated" : recovered.empty() ? "match" : "recovered", nbytes, replay_ns,
             recovered);
      cache_.emplace(value, std::move(tensor));
    }
    ++replays_;
    it = cache_.find(v);
    TAPESAC_INTERNAL_ASSERT(it != cache_.end(), "replay of block ", name_, " did not rebuild v", v);
  }
  at::Tensor t = it->second;
  slots_[static_cast<size_t>(slot)].last_round = round_;
  if (--remaining_[v] <= 0) cache_.erase(it);
  return t;
}

void BlockCall::close_step() noexcept {
  recorder_.stop();
  std::lock_guard<std::mutex> lock(mu_);
  closed_stats_.replays = replays_;
  closed_stats_.ops_replayed = replay_stats_.ops;
  closed_stats_.replay_ns = replay_stats_.ns;
  step_closed_ = true;
  for (Slot& s : slots_) s.tensor.reset();
  cache_.clear();
  live_.clear();
  approx_.reset();
  recorder_.clear();
}

BlockStats BlockCall::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  BlockStats st = closed_stats_;
  st.replays = replays_;
  st.ops_replayed = replay_stats_.ops;
  st.replay_ns = replay_stats_.ns;
  return st;
}

std::vector<std::string> BlockCall::op_names() const {
  std::vector<std::string> names;
  for (const capture::OpRecord& op : recorder_.tape().ops()) names.push_back(capture::op_kind_name(op.kind));
  return names;
}

Session::Session(SessionOptions options) : options_(std::move(options)) {
  if (options_.graph_device) graphs_ = std::make_unique<GraphCache>(options_.graph_device, options_.graph);
}

Session::~Session() { end_step(); }

void Session::begin_step(const std::vector<at::Tensor>& params) {
  TAPESAC_CHECK(!in_step_, kGeneric,
                "tapesac: sac.step() was entered while a step of the same TapeSAC is open; steps cannot nest. "
                "Close the first `with sac.step():` before opening the next.");
  param_storages_.clear();
  int64_t baseline = 0;
  std::unordered_set<const void*> counted;
  for (const at::Tensor& p : params) {
    if (!p.defined()) continue;
    param_storages_.insert(storage_key(p));
    if (counted.insert(storage_key(p)).second) baseline += storage_bytes(p);
    const at::Tensor& g = p.grad();
    if (g.defined() && g.has_storage() && counted.insert(storage_key(g)).second) baseline += storage_bytes(g);
  }
  if (graphs_) baseline += graphs_->static_bytes();  // captured graphs hold their static tensors between steps
  blocks_.clear();
  if (!allocator_use_) allocator_use_ = std::make_unique<allocator::CountingAllocatorUse>();
  memory_ = std::make_shared<StepMemory>();
  memory_->counter = std::make_shared<allocator::MemoryCounter>(options_.timeline_points);
  memory_->baseline = baseline;
  counter_scope_.emplace(memory_->counter);
  if (approx_) approx_->begin_step();
  if (options_.preserve != PreserveMode::kOff && options_.check_versions) {
    watcher_ = std::make_shared<WriteWatcher>(options_.preserve, preserve_modes_);
    watcher_->install();
  }
  in_step_ = true;
}

void Session::set_preservation(std::unordered_map<const void*, PreserveMode> modes,
                               std::unordered_set<const void*> keep) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: preservation can only be chosen between steps");
  preserve_modes_ = std::move(modes);
  keep_dependents_ = std::move(keep);
}

void Session::set_plans(std::unordered_map<std::string, BlockPlan> plans) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: a plan can only be set between steps");
  plans_ = std::move(plans);
}

void Session::set_approx(std::shared_ptr<Approx> approx) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: approximation can only be configured between steps");
  approx_ = std::move(approx);
}

void Session::shutdown() noexcept {
  end_step();
  allocator_use_.reset();
  graphs_.reset();  // the graphs' static memory goes now, not when the Session object does
}

void Session::set_memory_limit(int64_t bytes) {
  TAPESAC_CHECK(bytes >= 0, kConfig, "memory_limit must be a non-negative number of bytes (0: no limit), got ", bytes);
  options_.memory_limit = bytes;
}

std::shared_ptr<BlockCall> Session::begin_block(const std::string& name) {
  if (current_ != nullptr) return nullptr;
  auto hint = expected_ops_.find(name);
  auto block = std::make_shared<BlockCall>(name, &options_, &param_storages_, &save_cache_,
                                           hint == expected_ops_.end() ? 64 : hint->second + 8, memory_, this);
  block->start_forward();
  blocks_.push_back(block);
  current_ = block;
  return block;
}

void Session::end_block() {
  if (current_ == nullptr) return;
  std::shared_ptr<BlockCall> block = std::move(current_);  // closed even if deciding keep/drop throws
  block->close_forward();
}

void Session::end_step() noexcept {
  try {
    end_block();
  } catch (...) {
    // Closing the block's forward failed (e.g. out of memory while checksumming); the step is being torn down
    // anyway and close_step() below releases everything the block holds.
  }
  if (!in_step_) return;
  last_stats_.clear();
  last_replayed_.clear();
  last_records_.clear();
  last_preserved_.clear();
  for (const auto& b : blocks_) {
    b->close_step();
    last_stats_.push_back(b->stats());
    expected_ops_[last_stats_.back().name] = static_cast<size_t>(last_stats_.back().ops_recorded);
    for (const auto& [kind, count] : b->replayed_by_kind()) last_replayed_[capture::op_kind_name(kind)] += count;
  }
  blocks_.clear();
  if (watcher_) {
    try {
      last_preserved_ = watcher_->stats();
    } catch (...) {
      last_preserved_.clear();
    }
    watcher_->end();
    watcher_.reset();
  }
  counter_scope_.reset();
  try {
    StepMemoryStats m;
    if (memory_) {
      m.baseline = memory_->baseline;
      m.total = memory_->counter->total();
      for (int p = 0; p < allocator::kNumPhases; ++p) {
        m.phases[static_cast<size_t>(p)] = memory_->counter->phase_gauge(static_cast<allocator::Phase>(p));
      }
      m.arena_shared = memory_->arena.shared_bytes();
      m.arena_separate = memory_->arena.separate_bytes();
      m.replay_pieces = memory_->replay_pieces;
      m.timeline = memory_->counter->timeline();
      std::lock_guard<std::mutex> lock(memory_->spans_mu);
      m.spans = memory_->spans;
      last_records_ = std::move(memory_->records);
      memory_->records.clear();
    }
    m.memory_limit = options_.memory_limit;
    last_peak_ = m.baseline + m.total.peak;
#ifdef TAPESAC_WITH_CUDA
    if (options_.arena_pool_id.first != 0 || options_.arena_pool_id.second != 0) {
      last_peak_ = std::max(last_peak_, cuda::device_memory(options_.arena_device).allocated_peak);
    }
#endif
    last_memory_ = std::move(m);
  } catch (...) {
    last_memory_ = StepMemoryStats{};  // out of memory copying the timeline: the step's figures are lost
  }
  memory_.reset();
  in_step_ = false;
}

}  // namespace tapesac::replay
