// The recorder (see recorder.h). Hot path: enter()/exit() run for every dispatcher call on the recording thread,
// nested ones included, so the skip decision comes first and costs a TLS read and a pointer-keyed lookup.
#include "tapesac/capture/recorder.h"

#include <cstring>
#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <unordered_map>

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Type.h>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/clock.h"
#include "tapesac/common/errors.h"

namespace tapesac::capture {
namespace {

thread_local Recorder* t_current = nullptr;

// Note [Recorder scratch reused]. The identity maps and their weak references (RecorderIdentity) serve a recording
// only while it runs. Freed at every block call's end and allocated again at the next one's start, they cost each
// block call a few large allocations and frees (on glibc each large one also consolidates the fast bins). stop()
// hands them, emptied, to the next recording on the same thread instead: one spare per thread, since recordings on a
// thread do not nest.
struct SpareIdentity {
  bool filled = false;
  RecorderIdentity id;
};
thread_local SpareIdentity t_spare;

// Note [Recorder tables reused]. The tape's tables and the payloads grow with the block (a 200-op block: ~150 KiB
// in three allocations of 30-90 KiB) and lived as long as the block call, so every block call made and freed them;
// on glibc each allocation or free that size consolidates the fast bins, and the whole heap's small allocations
// got slower after it (callgrind on bench_record's 200 tiny ops: the same torch allocations cost 1.5-2x the
// instructions they cost in a plain forward). A recorder's destructor and clear() hand the emptied tables to the
// thread's next recording instead (one spare per thread; a recorder destroyed on another thread, as a CUDA
// backward's, fills that thread's spare).
struct SpareTables {
  bool filled = false;
  Tape tape;
  std::vector<OpPayload> payloads;
};
thread_local SpareTables t_spare_tables;

// Schema-name address -> OpInfo, per thread and kept across recordings (a recording looked each operator up again
// under op_info()'s lock); emptied when an operator was deregistered since (Note [Operators deregistered]).
struct InfoByName {
  uint64_t epoch = UINT64_MAX;
  std::unordered_map<const char*, const OpInfo*> map;
};
thread_local InfoByName t_info_by_name;

bool contains_tensor(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined();
  if (v.isTensorList()) return v.toTensorList().size() > 0;
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (contains_tensor(e)) return true;
    }
    return false;
  }
  if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      if (contains_tensor(e)) return true;
    }
    return false;
  }
  if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) {
      if (contains_tensor(kv.key()) || contains_tensor(kv.value())) return true;
    }
  }
  return false;
}

// The reason a recording failed, never empty: torch's python_error (a Python exception raised below the dispatcher)
// carries its message only once persisted, which needs the GIL, so its what() is "" here.
std::string reason_of(const std::exception& e) {
  // A c10::Error's what() carries the C++ backtrace (dozens of frames): the capture error is logged and reported.
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    const char* msg = c10_error->what_without_backtrace();
    if (msg != nullptr && *msg != '\0') return msg;
  }
  const char* what = e.what();
  if (what != nullptr && *what != '\0') return what;
  return "an exception without a message (" + c10::demangle(typeid(e).name()) +
         "; a Python error raised inside a tensor subclass or a dispatch mode)";
}

std::atomic<RecorderHook> g_default_hook{RecorderHook::kAuto};

}  // namespace

const char* recorder_hook_name(RecorderHook hook) {
  switch (hook) {
    case RecorderHook::kDefault: return "default";
    case RecorderHook::kAuto: return "auto";
    case RecorderHook::kDispatchKey: return "dispatch_key";
    case RecorderHook::kRecordFunction: return "record_function";
  }
  return "default";
}

RecorderHook parse_recorder_hook(const std::string& name) {
  for (RecorderHook h : {RecorderHook::kDefault, RecorderHook::kAuto, RecorderHook::kDispatchKey,
                         RecorderHook::kRecordFunction}) {
    if (name == recorder_hook_name(h)) return h;
  }
  throw std::invalid_argument("tapesac: unknown recorder hook '" + name +
                              "'; expected one of 'default', 'auto', 'dispatch_key', 'record_function'");
}

RecorderHook default_recorder_hook() { return g_default_hook.load(std::memory_order_relaxed); }

RecorderHook resolve_recorder_hook(RecorderHook hook) {
  if (hook == RecorderHook::kDefault) hook = default_recorder_hook();
  if (hook == RecorderHook::kAuto) {
    hook = dispatch_hook::available() ? RecorderHook::kDispatchKey : RecorderHook::kRecordFunction;
  }
  return hook;
}

void set_default_recorder_hook(RecorderHook hook) {
  if (hook == RecorderHook::kDefault) {
    throw std::invalid_argument(
        "tapesac: the default recorder hook must be 'auto', 'dispatch_key' or 'record_function', not 'default'");
  }
  g_default_hook.store(hook, std::memory_order_relaxed);
}

TensorMeta meta_of(const at::Tensor& t) {
  TensorMeta m;
  const auto sizes = t.sizes();
  m.sizes.assign(sizes.begin(), sizes.end());
  if (t.layout() == c10::kStrided) {
    const auto strides = t.strides();
    m.strides.assign(strides.begin(), strides.end());
    m.storage_offset = t.storage_offset();
  }
  m.dtype = static_cast<int16_t>(t.scalar_type());
  m.device_type = static_cast<int16_t>(t.device().type());
  m.device_index = static_cast<int16_t>(t.device().index());
  m.nbytes = static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
  return m;
}

Recorder::Recorder(RecorderOptions options) : options_(options) {}

Recorder::~Recorder() {
  stop();
  recycle_tables();
}

void Recorder::recycle_tables() noexcept {
  payloads_.clear();
  tape_.clear();
  if (!t_spare_tables.filled) {  // Note [Recorder tables reused]
    std::swap(tape_, t_spare_tables.tape);
    std::swap(payloads_, t_spare_tables.payloads);
    t_spare_tables.filled = true;
  }
}

Recorder* Recorder::current() { return t_current; }

void Recorder::start() {
  if (active_) return;
  if (t_current != nullptr) {
    // Typed (TapeSACError in Python): record_ops inside a block's forward or inside another record_ops raised a
    // bare RuntimeError (found by an adversarial test).
    throw Error(ErrorKind::kGeneric,
                "tapesac: a recorder is already active on this thread; blocks cannot record inside one another (call "
                "tapesac.record_ops outside a step's blocks and outside another record_ops)");
  }
  if (t_spare.filled) {  // Note [Recorder scratch reused]
    std::swap(id_, t_spare.id);
    t_spare.filled = false;
  }
  if (t_spare_tables.filled && tape_.ops().empty() && tape_.values().empty() && payloads_.empty()) {
    std::swap(tape_, t_spare_tables.tape);  // Note [Recorder tables reused]
    std::swap(payloads_, t_spare_tables.payloads);
    t_spare_tables.filled = false;
  }
  if (const uint64_t epoch = op_registry_epoch(); t_info_by_name.epoch != epoch) {
    t_info_by_name.map.clear();
    t_info_by_name.epoch = epoch;
  }
  const size_t n = std::max<size_t>(options_.expected_ops, 16);
  tape_.reserve(n, 3 * n, 2 * n);
  payloads_.reserve(n);
  live_.reserve(3 * n);
  call_stack_.reserve(64);
  open_.reserve(16);
  id_.impl_value.reserve(3 * n);
  id_.impl_refs.reserve(3 * n);
  id_.storage_id.reserve(2 * n);
  id_.storage_refs.reserve(2 * n);
  id_.storage_key.reserve(2 * n);
  id_.last_value_of_storage.reserve(2 * n);
  id_.prev_value_same_storage.reserve(3 * n);
  const RecorderHook hook = resolve_recorder_hook(options_.hook);
  if (hook == RecorderHook::kDispatchKey) {
    dispatch_hook::attach(this);  // throws std::logic_error when the hook is not available
  } else {
    callback_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&Recorder::on_enter, &Recorder::on_exit)
                                               .needsInputs(true)
                                               .needsOutputs(true)
                                               .scopes({at::RecordScope::FUNCTION}));
  }
  hook_ = hook;
  t_current = this;
  active_ = true;
  tape_.set_op_timing(options_.time_ops ? OpTiming::kCpuClock : OpTiming::kUntimed);
}

void Recorder::set_op_timer(std::unique_ptr<OpTimer> timer, std::string why) {
  if (active_) throw std::logic_error("Recorder::set_op_timer: set the timer before start()");
  if (timer_) timer_->cancel();
  timer_ = std::move(timer);
  timing_note_ = timer_ ? timer_->note() : std::move(why);
}

void Recorder::drop_timer(const std::string& why) noexcept {
  if (!timer_) return;
  timer_->cancel();
  timer_.reset();
  try {
    timing_note_ = why;
  } catch (...) {
    timing_note_.clear();
  }
}

void Recorder::finish_timer() noexcept {
  if (!timer_) return;
  try {
    size_t open = 0;
    for (const Frame& f : open_) open += f.timed ? 1 : 0;
    if (open > 0) {
      drop_timer("op timer dropped: recording stopped inside " + std::to_string(open) + " op(s)");
      return;
    }
    const OpTiming kind = timer_->kind();
    try {
      tape_.set_op_times(kind, timer_->finish(tape_.ops().size()));
      timer_.reset();
    } catch (const std::exception& e) {
      drop_timer(std::string("op timer (") + op_timing_name(kind) + ") failed: " + e.what());
    }
  } catch (...) {
    timing_note_.clear();  // out of memory building the note: the timer goes without one
    if (timer_) timer_->cancel();
    timer_.reset();
  }
}

void Recorder::stop() noexcept {
  if (!active_) return;
  if (hook_ == RecorderHook::kDispatchKey) {
    dispatch_hook::detach(this);
  } else {
    at::removeCallback(callback_);
    callback_ = 0;
  }
  if (t_current == this) t_current = nullptr;
  active_ = false;
  finish_timer();
  call_stack_.clear();
  open_.clear();
  // Identity maps are only needed while the block runs; emptying them releases the weak references. Emptied, they
  // go to the thread's next recording (Note [Recorder scratch reused]).
  id_.reset();
  if (!t_spare.filled) {
    std::swap(id_, t_spare.id);
    t_spare.filled = true;
  }
  cover_.clear();
}

void Recorder::clear() noexcept {
  stop();
  recycle_tables();
  live_.clear();
  origins_.clear();
  opaque_.clear();
}

std::optional<c10::OperatorName> Recorder::CallView::operator_name() const {
  if (op != nullptr) return op->operator_name();
  if (fn != nullptr) return fn->operator_name();
  return std::nullopt;
}

std::unique_ptr<at::ObserverContext> Recorder::on_enter(const at::RecordFunction& fn) {
  Recorder* r = t_current;
  if (r != nullptr) r->enter(CallView{fn.name(), fn.inputs(), &fn, nullptr});
  return nullptr;
}

void Recorder::on_exit(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  Recorder* r = t_current;
  if (r != nullptr) r->exit(CallView{fn.name(), {}, &fn, nullptr}, fn.outputs());
}

void Recorder::read_arguments(Frame& f, c10::ArrayRef<c10::IValue> inputs) {
  f.args.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const c10::IValue& v = inputs[i];
    const int arg = static_cast<int>(i);
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined()) {
        add_input(f, t, arg, -1);
        f.args.emplace_back();
      } else {
        f.args.push_back(v);
      }
    } else if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) add_input(f, list.get(j), arg, static_cast<int>(j));
      f.args.emplace_back(c10::List<at::Tensor>());
    } else if (v.isList() && contains_tensor(v)) {
      const auto list = v.toList();
      c10::impl::GenericList copy(list.elementType());
      copy.reserve(list.size());
      for (size_t j = 0; j < list.size(); ++j) {
        const c10::IValue e = list.get(j);
        if (e.isTensor() && e.toTensor().defined()) {
          add_input(f, e.toTensor(), arg, static_cast<int>(j));
          copy.push_back(c10::IValue());
        } else if (contains_tensor(e)) {
          f.non_replayable = true;
          copy.push_back(c10::IValue());
        } else {
          copy.push_back(e);
        }
      }
      f.args.emplace_back(std::move(copy));
    } else if (contains_tensor(v)) {
      f.non_replayable = true;  // tensors inside tuples or dicts: not tracked, so not replayable
      f.args.emplace_back();
    } else {
      f.args.push_back(v);
    }
  }
}

bool Recorder::on_call_enter(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int /*depth*/) noexcept {
  enter(CallView{op.schema().name().c_str(), args, nullptr, &op});
  // The calls made inside at autograd level (a composite op's children, the clone an in-place op's autograd kernel
  // saves) are ops autograd sees: the hook must show them, and skips those below autograd by itself.
  return error_.empty();
}

void Recorder::on_call_exit(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> returns) noexcept {
  exit(CallView{op.schema().name().c_str(), {}, nullptr, &op}, returns);
}

const OpInfo* Recorder::should_record(const CallView& call) {
  if (busy_) return nullptr;
  // torch.compile's tracing (the dispatch hook skips these calls before they get here; at::RecordFunction does not).
  if (call.fn != nullptr && dispatch_hook::tracing_fakes()) return nullptr;
  // Note [Which calls autograd sees]. The parent is the innermost enclosing call we track (recorded or
  // composite); open_ holds exactly those.
  //  * An op called from inside another op's kernel runs with the autograd keys excluded: autograd does not see
  //    it. A call with no enclosing tracked op is a top-level call from Python: torch's Python bindings of
  //    factory functions (torch.ones, torch.rand_like, ...) exclude the autograd keys themselves, yet autograd
  //    (and a TorchDispatchMode) sees those ops, so they are recorded.
  //  * An op without tensor arguments (a factory) never reaches an autograd kernel: whatever its kernel calls is
  //    below autograd even though the autograd keys are not excluded.
  const Frame* parent = open_.empty() ? nullptr : &open_.back();
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  if (parent != nullptr) {
    if (tls.excluded_.has_any(c10::autograd_dispatch_keyset)) return nullptr;
    if (!parent->composite && !parent->has_tensor_args) return nullptr;
  }
  const char* name = call.name;
  const OpInfo* info = nullptr;
  auto& by_name = t_info_by_name.map;
  auto it = by_name.find(name);
  if (it != by_name.end()) {
    info = it->second;
  } else {
    auto op_name = call.operator_name();
    info = op_name.has_value() ? op_info(*op_name) : nullptr;
    by_name.emplace(name, info);
  }
  if (info == nullptr) return nullptr;
  bool cuda = false;
  has_tensor_args_ = false;
  for (const c10::IValue& v : call.inputs) {
    if (v.isTensor() && v.toTensor().defined()) {
      cuda = v.toTensor().is_cuda();
      has_tensor_args_ = true;
      break;
    }
    if (v.isTensorList() && v.toTensorList().size() > 0) {
      has_tensor_args_ = true;
      break;
    }
  }
  composite_ = cuda ? info->decomposes_cuda : info->decomposes_cpu;
  // With autocast on, the autocast kernel casts and calls the op again; that inner call is the one autograd sees.
  if (cuda ? (info->autocast_cuda && !tls.excluded_.has(c10::DispatchKey::AutocastCUDA))
           : (info->autocast_cpu && !tls.excluded_.has(c10::DispatchKey::AutocastCPU))) {
    return nullptr;
  }
  return info;
}

StorageId Recorder::storage_of(const at::Tensor& t, bool create_external) {
  const auto* key = static_cast<const c10::StorageImpl*>(storage_key(t));
  const StorageId known = id_.storage_id.find(key);
  if (known != PtrIndexMap::kMissing) return known;
  if (!create_external) return -1;
  const int64_t nbytes = t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
  const StorageId s = tape_.add_storage(/*external=*/true, nbytes);
  id_.storage_id.assign(key, s);
  id_.storage_key.push_back(key);
  if (t.has_storage()) id_.storage_refs.emplace_back(t.storage().getWeakStorageImpl());
  id_.last_value_of_storage.push_back(-1);
  return s;
}

ValueId Recorder::find_value(const at::Tensor& t) const {
  const ValueId v = lookup(t);
  if (v < 0) return -1;
  const StorageId s = tape_.value(v).storage;
  const bool tracked = static_cast<size_t>(s) < cover_.size() && cover_[static_cast<size_t>(s)] != nullptr;
  return opaque(v, tracked ? meta_of(t) : tape_.value(v).meta) ? -1 : v;
}

bool Recorder::opaque(ValueId v, const TensorMeta& view) const {
  if (static_cast<size_t>(v) < opaque_.size() && opaque_[static_cast<size_t>(v)] != 0) return true;
  const ValueInfo& info = tape_.value(v);
  if (info.producer == kExternal) return false;
  const auto s = static_cast<size_t>(info.storage);
  return s < cover_.size() && cover_[s] != nullptr && !cover_[s]->covers(view);
}

ValueId Recorder::lookup(const at::Tensor& t, bool* by_impl) const {
  if (!t.defined()) return -1;
  const ValueId latest = id_.impl_value.find(t.unsafeGetTensorImpl());
  if (by_impl != nullptr) *by_impl = latest != PtrIndexMap::kMissing;
  if (latest != PtrIndexMap::kMissing) return latest;
  const StorageId storage = id_.storage_id.find(storage_key(t));
  if (storage == PtrIndexMap::kMissing) return -1;
  const TensorMeta m = meta_of(t);
  for (ValueId c = id_.last_value_of_storage[static_cast<size_t>(storage)]; c >= 0;
       c = id_.prev_value_same_storage[static_cast<size_t>(c)]) {
    if (tape_.value(c).meta.same_view(m)) return c;
  }
  return -1;
}

ValueId Recorder::find_value_of_impl(const c10::TensorImpl* impl) const {
  const ValueId v = id_.impl_value.find(impl);
  if (v == PtrIndexMap::kMissing) return -1;
  return opaque(v, tape_.value(v).meta) ? -1 : v;
}

ValueId Recorder::add_external(const at::Tensor& t, StorageId s) {
  const ValueId v = tape_.add_external_value(s, meta_of(t));
  if (live_.size() <= static_cast<size_t>(v)) live_.resize(static_cast<size_t>(v) + 1);
  live_[static_cast<size_t>(v)] = detached_alias(t);
  if (origins_.size() <= static_cast<size_t>(v)) {
    origins_.resize(static_cast<size_t>(v) + 1, c10::weak_intrusive_ptr<c10::TensorImpl>(c10::intrusive_ptr<c10::TensorImpl>()));
  }
  origins_[static_cast<size_t>(v)] = c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
  if (id_.impl_value.assign(t.unsafeGetTensorImpl(), v)) {
    id_.impl_refs.emplace_back(c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()));
  }
  link_value(v, s);
  return v;
}

void Recorder::link_value(ValueId v, StorageId s) {
  if (id_.prev_value_same_storage.size() <= static_cast<size_t>(v)) id_.prev_value_same_storage.resize(static_cast<size_t>(v) + 1, -1);
  id_.prev_value_same_storage[static_cast<size_t>(v)] = id_.last_value_of_storage[static_cast<size_t>(s)];
  id_.last_value_of_storage[static_cast<size_t>(s)] = v;
}

ValueId Recorder::value_for_input(const at::Tensor& t) {
  bool by_impl = false;
  const ValueId v = lookup(t, &by_impl);
  // Note [A storage replaced inside the block]: `a.data = other` (or `a.data.set_(...)`) gives a's TensorImpl another
  // storage through no operator call: the impl still maps to the value the tape made, and a later reader was
  // replayed from that value's producer, not from the new data (silently wrong under "check": adversarial tests and
  // random programs). Such a block call is not recorded further: it keeps its tensors, and says why.
  // Compared by the storage's key, kept per storage (no second hash lookup per input): the recording's weak references
  // to its storages (storage_refs) keep a StorageImpl's address from being reused while it runs.
  if (by_impl && t.has_storage() &&
      storage_key(t) != id_.storage_key[static_cast<size_t>(tape_.value(v).storage)]) {
    throw std::runtime_error(
        "an input's storage was replaced inside the block (`t.data = ...` or `t.data.set_(...)`), which no operator "
        "call shows; the block keeps its tensors. Assign a new tensor (`t = t * 2`) instead of its .data");
  }
  if (v >= 0) return v;
  // Not produced on this tape (block input, parameter, buffer, captured tensor), or a view of a tape storage made
  // where the recorder cannot see: held live, never replayed.
  return add_external(t, storage_of(t, /*create_external=*/true));
}

void Recorder::add_input(Frame& f, const at::Tensor& t, int arg, int elem) {
  // Note [Python tensor subclasses]: a tensor whose key set holds Python (a FakeTensor while torch.compile traces,
  // a FunctionalTensor, a __torch_dispatch__ subclass such as DTensor) would answer the detach() below, and every
  // replay, by running Python inside this callback. Its op is not recorded: the block keeps its tensors, and says why.
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) {
    throw std::runtime_error(
        "an input is a tensor subclass that dispatches to Python (a FakeTensor: torch.compile traced the block inside "
        "the step; or a FunctionalTensor, or a __torch_dispatch__ subclass such as DTensor), which tapesac does not "
        "record. Compile before the first step, or compile submodules inside the blocks");
  }
  const ValueId v = value_for_input(t);
  const auto& unread = f.info->bytes_unread_arg;
  const bool reads_bytes = !(static_cast<size_t>(arg) < unread.size() && unread[static_cast<size_t>(arg)]);
  const StorageId s = tape_.value(v).storage;
  if (reads_bytes && static_cast<size_t>(s) < cover_.size() && cover_[static_cast<size_t>(s)] != nullptr &&
      tape_.value(v).producer != kExternal && !cover_[static_cast<size_t>(s)]->covers(meta_of(t))) {
    f.unwritten.emplace_back(f.inputs.size(), t);  // see externalize_unwritten()
  }
  ArgRef a;
  a.arg = static_cast<int16_t>(arg);
  a.elem = static_cast<int16_t>(elem);
  a.value = v;
  a.state = tape_.state_of(s);
  a.overwritten = !reads_bytes;
  f.inputs.push_back(a);
}

void Recorder::externalize_unwritten(Frame& f, OpRecord& rec, c10::ArrayRef<c10::IValue> outputs, bool writes) {
  // A view call (it writes nothing and returns only aliases of storages the tape knows) takes metadata, not bytes:
  // its output is checked when something reads it.
  bool view = !writes;
  bool any_output = false;
  auto visit = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    any_output = true;
    if (id_.storage_id.find(storage_key(t)) == PtrIndexMap::kMissing) view = false;
  };
  for (const c10::IValue& o : outputs) {
    if (!view) break;
    if (o.isTensor()) {
      visit(o.toTensor());
    } else if (o.isTensorList()) {
      for (const at::Tensor& t : o.toTensorList().vec()) visit(t);
    } else if (o.isList()) {
      for (const c10::IValue& e : o.toListRef()) {
        if (e.isTensor()) visit(e.toTensor());
      }
    }
  }
  if (view && any_output) return;
  for (auto& [index, t] : f.unwritten) {
    ArgRef& a = rec.inputs[index];
    ValueId v = lookup(t);  // the same tensor read twice by this op is registered once
    if (v < 0 || tape_.value(v).producer != kExternal) {
      v = add_external(t, tape_.value(a.value).storage);
      if (opaque_.size() <= static_cast<size_t>(v)) opaque_.resize(static_cast<size_t>(v) + 1, 0);
      opaque_[static_cast<size_t>(v)] = 1;
    }
    a.value = v;
  }
}

bool Recorder::deterministic_fill(const OpInfo& info, const OpRecord& rec) const {
  if (!info.fill || rec.writes.size() != 1 || tape_.ops().empty()) return false;
  const at::Context& ctx = at::globalContext();
  if (!ctx.deterministicAlgorithms() || !ctx.deterministicFillUninitializedMemory()) return false;
  const OpRecord& prev = tape_.ops().back();
  return prev.has(kUninitialized) &&
         std::find(prev.writes.begin(), prev.writes.end(), rec.writes[0]) != prev.writes.end();
}

void Recorder::note_writes(const OpRecord& rec) {
  if (rec.has(kUninitialized)) {
    for (StorageId s : rec.writes) {
      if (tape_.storage(s).external) continue;  // never rebuilt anyway: a write to it is not replayed
      if (cover_.size() <= static_cast<size_t>(s)) cover_.resize(static_cast<size_t>(s) + 1);
      auto& c = cover_[static_cast<size_t>(s)];
      if (c) {
        c->clear();
      } else {
        c = std::make_unique<ByteCover>();
      }
    }
    return;
  }
  if (cover_.empty()) return;
  for (StorageId s : rec.writes) {
    if (static_cast<size_t>(s) >= cover_.size() || !cover_[static_cast<size_t>(s)]) continue;
    // What an op writes on a storage is its outputs there (an in-place op returns its self, an out= op its out).
    // An op that writes part of its output (index_put_, masked_fill_) reads the rest: if that was unwritten, the
    // read made the tensor external and the op cannot be replayed, so counting the whole output is safe.
    for (ValueId o : rec.outputs) {
      if (o >= 0 && tape_.value(o).storage == s) cover_[static_cast<size_t>(s)]->add(tape_.value(o).meta);
    }
  }
}

namespace {

// The default generator an op without a Generator argument draws from: its first tensor's device's, else its
// Device argument's, else the CPU's. nullopt for other devices.
std::optional<at::Generator> default_generator_for(c10::ArrayRef<c10::IValue> inputs) {
  c10::Device device(c10::kCPU);
  bool found = false;
  for (const c10::IValue& v : inputs) {
    if (v.isTensor() && v.toTensor().defined()) {
      device = v.toTensor().device();
      found = true;
      break;
    }
  }
  if (!found) {
    for (const c10::IValue& v : inputs) {
      if (v.isDevice()) {
        device = v.toDevice();
        break;
      }
    }
  }
  if (!device.is_cpu() && !device.is_cuda()) return std::nullopt;
  return at::globalContext().defaultGenerator(device);
}

bool same_state(const c10::TensorImpl& a, const c10::TensorImpl& b) {
  const size_t n = a.numel() * a.itemsize();
  return b.numel() * b.itemsize() == n && std::memcmp(a.data(), b.data(), n) == 0;
}

}  // namespace

void Recorder::capture_rng(Frame& f, c10::ArrayRef<c10::IValue> inputs) {
  const OpInfo& info = *f.info;
  auto arg = [&](int i) -> const c10::IValue* {
    return (i >= 0 && static_cast<size_t>(i) < inputs.size()) ? &inputs[static_cast<size_t>(i)] : nullptr;
  };
  if (const c10::IValue* tr = arg(info.train_arg); tr != nullptr && tr->isBool() && !tr->toBool()) return;
  // A dropout with p == 0 usually draws nothing, but not always (aten::native_dropout in training on CPU runs
  // bernoulli_(1.0), which draws: a helper's finding, the generator moved again at replay). It is probed as a custom
  // op is (Note [Random numbers drawn below a custom op]): a random op only if the call moved its generator.
  const c10::IValue* p = arg(info.p_arg);
  const bool probe = p != nullptr && p->isDouble() && p->toDouble() == 0.0;
  std::optional<at::Generator> gen;
  if (const c10::IValue* g = arg(info.generator_arg); g != nullptr && g->isGenerator()) gen = g->toGenerator();
  if (!gen.has_value()) gen = default_generator_for(inputs);
  if (!gen.has_value() || !gen->defined()) {
    // A random op whose generator we cannot restore must not be replayed (a p == 0 one that may draw neither).
    f.non_replayable = true;
    return;
  }
  std::lock_guard<std::mutex> lock(gen->mutex());
  f.generator_state = gen->unsafeGetGeneratorImpl()->get_state();
  f.generator = std::move(gen);
  f.rng_probe = probe;
}

// Note [Random numbers drawn below a custom op]
// An op registered outside aten (torch.library.custom_op, a C++ extension: a fused dropout, noise, stochastic
// rounding) is recorded as one op, and what its kernel calls runs below autograd, unseen. Its schema carries no
// nondeterministic_seeded tag, so it looked deterministic: a replay drew again from the generator's state of the
// moment — other numbers than the forward's (gradients off by 0.14 under "full": an adversarial test) — and advanced
// the run's random stream inside the backward. Such an op's entry snapshots its device's default generator (as a
// random op's does) and its exit compares: a call that moved the generator keeps the snapshot and is replayed as a
// random op (from the state it started from, the generator put back afterwards: use_recorded_rng); a call that did
// not drops it. The probe costs a state copy per call of such an op (5 KiB on CPU, 16 bytes on CUDA); aten ops are
// never probed. Unseen still: a kernel drawing from a generator that is neither its device's default one nor in its
// schema (contract="strict" compares the rebuilt bytes).
void Recorder::probe_rng(Frame& f, c10::ArrayRef<c10::IValue> inputs) {
  std::optional<at::Generator> gen = default_generator_for(inputs);
  if (!gen.has_value() || !gen->defined()) return;
  std::lock_guard<std::mutex> lock(gen->mutex());
  f.generator_state = gen->unsafeGetGeneratorImpl()->get_state();
  f.generator = std::move(gen);
  f.rng_probe = true;
}

void Recorder::settle_rng_probe(Frame& f) {
  if (!f.rng_probe || !f.generator.has_value()) return;
  f.rng_probe = false;
  c10::intrusive_ptr<c10::TensorImpl> now;
  {
    std::lock_guard<std::mutex> lock(f.generator->mutex());
    now = f.generator->unsafeGetGeneratorImpl()->get_state();
  }
  if (same_state(*now, *f.generator_state)) {  // drew nothing: an ordinary op
    f.generator.reset();
    f.generator_state.reset();
  }
}

void Recorder::enter(const CallView& call) noexcept {
  try {
    call_stack_.push_back(0);
  } catch (const std::exception& e) {
    note_failure(call, e);
    return;
  }
  if (!error_.empty()) return;
  const OpInfo* info = nullptr;
  try {
    composite_ = false;
    info = should_record(call);
  } catch (const std::exception& e) {
    note_failure(call, e);
    return;
  }
  if (info == nullptr) return;
  try {
    open_.emplace_back();
  } catch (const std::exception& e) {
    note_failure(call, e);
    return;
  }
  call_stack_.back() = 1;
  Frame& f = open_.back();
  try {
    // Note [Forward-mode AD in a block]: with dual tensors (torch.autograd.forward_ad) autograd calls _fw_primal and
    // friends inside the block; a replay of them hit PyTorch's internal assert (an untyped RuntimeError in the
    // backward) and the strict checksums read tangent-only tensors (a segfault: adversarial tests). Such a block call
    // is not recorded: it keeps its tensors, as policy "none" (exact), and says why.
    if (info->forward_ad) {
      throw std::runtime_error("forward-mode AD (dual tensors, torch.autograd.forward_ad) runs inside the block, "
                               "which tapesac does not record");
    }
    f.info = info;
    f.composite = composite_;
    f.has_tensor_args = has_tensor_args_;
    f.tape_size = tape_.next_op_index();
    busy_ = true;
    const c10::ArrayRef<c10::IValue> inputs = call.inputs;
    read_arguments(f, inputs);
    // See OpInfo::grad_mode_kernel: replay runs inside the backward, with grad mode off.
    if (f.info->grad_mode_kernel && at::GradMode::is_enabled()) f.non_replayable = true;
    // A composite op's random children snapshot their own generator state; in the rare case the composite runs
    // itself, it is recorded without one and therefore never replayed.
    if (f.info->random && options_.record_rng) {
      if (f.composite) {
        f.non_replayable = true;
      } else {
        capture_rng(f, inputs);
      }
    } else if (f.info->probe_rng && options_.record_rng && !f.composite) {
      probe_rng(f, inputs);
    }
    busy_ = false;
    if (options_.time_ops) f.start_ns = common::now_ns();
    if (timer_) {
      try {
        timer_->begin(f.tape_size);
        f.timed = true;
      } catch (const std::exception& e) {
        drop_timer(std::string("op timer (") + op_timing_name(timer_->kind()) + ") failed at op entry: " + e.what());
      }
    }
  } catch (const std::exception& e) {
    busy_ = false;
    note_failure(call, e);
    f.info = nullptr;
  }
}

void Recorder::note_failure(const CallView& call, const std::exception& e) noexcept {
  if (!error_.empty()) return;
  try {
    error_ = std::string("recording ") + call.name + " failed: " + reason_of(e);
  } catch (...) {
    error_ = "record failed";  // out of memory building the message: fits the short-string buffer
  }
}

void Recorder::exit(const CallView& call, c10::ArrayRef<c10::IValue> outputs) noexcept {
  if (call_stack_.empty()) return;
  const bool tracked = call_stack_.back() != 0;
  call_stack_.pop_back();
  if (!tracked) return;
  OpIndex recorded = -1;
  if (open_.back().timed && timer_) {
    try {
      timer_->end();
    } catch (const std::exception& e) {
      drop_timer(std::string("op timer (") + op_timing_name(timer_->kind()) + ") failed at op exit: " + e.what());
    }
  }
  {
    struct PopFrame {
      std::vector<Frame>& open;
      ~PopFrame() { open.pop_back(); }
    } pop{open_};
    recorded = finish(open_.back(), call, outputs);
  }
  // Told after the frame is gone, so that op_open() already reflects the enclosing calls.
  if (recorded >= 0 && listener_ != nullptr) {
    try {
      listener_->on_op_recorded(*this, recorded);
    } catch (const std::exception& e) {
      note_failure(call, e);
    }
  }
}

bool Recorder::composite_ran_itself(const Frame& f, c10::ArrayRef<c10::IValue> outputs) const {
  if (tape_.next_op_index() != f.tape_size) return false;
  for (const c10::IValue& o : outputs) {
    if (!o.isTensor() || !o.toTensor().defined()) {
      if (contains_tensor(o)) return true;
      continue;
    }
    const ValueId known = id_.impl_value.find(o.toTensor().unsafeGetTensorImpl());
    if (known == PtrIndexMap::kMissing || tape_.value(known).producer >= f.tape_size) return true;
  }
  return false;
}

void Recorder::register_output(OpRecord& rec, const at::Tensor& t, OutputScan& scan) {
  if (!t.defined()) {
    rec.outputs.push_back(-1);
    return;
  }
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) {  // Note [Python tensor subclasses]
    throw std::runtime_error(
        "an output is a tensor subclass that dispatches to Python (a FakeTensor: torch.compile traced the block "
        "inside the step; or a FunctionalTensor, or a __torch_dispatch__ subclass), which tapesac does not "
        "record. Compile before the first step, or compile submodules inside the blocks");
  }
  scan.cuda = scan.cuda || t.is_cuda();
  const auto* key = static_cast<const c10::StorageImpl*>(storage_key(t));
  StorageId s = id_.storage_id.find(key);
  int32_t state;
  if (s == PtrIndexMap::kMissing) {
    const int64_t nbytes = t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
    s = tape_.add_storage(/*external=*/false, nbytes);
    id_.storage_id.assign(key, s);
    id_.storage_key.push_back(key);
    if (t.has_storage()) id_.storage_refs.emplace_back(t.storage().getWeakStorageImpl());
    id_.last_value_of_storage.push_back(-1);
    rec.writes.push_back(s);
    scan.any_new_storage = true;
    state = 1;
  } else {
    const bool written = std::find(rec.writes.begin(), rec.writes.end(), s) != rec.writes.end();
    state = tape_.state_of(s) + (written ? 1 : 0);
  }
  const ValueId v = tape_.add_output_value(s, state, meta_of(t));
  if (id_.impl_value.assign(t.unsafeGetTensorImpl(), v)) {
    id_.impl_refs.emplace_back(c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()));
  }
  link_value(v, s);
  rec.outputs.push_back(v);
  scratch_storages_.push_back(s);
}

OpIndex Recorder::finish(Frame& f, const CallView& call, c10::ArrayRef<c10::IValue> outputs) {
  if (f.info == nullptr) return -1;
  const int64_t end_ns = options_.time_ops ? common::now_ns() : f.start_ns;
  if (!error_.empty()) return -1;
  // Note [Composite ops that run themselves]. A CompositeImplicitAutograd op normally decomposes: its children
  // run at autograd level and are recorded, and the op itself is not. When none of its children was recorded and
  // it returned a tensor that is not one of its inputs, it ran below autograd itself (another kernel won the
  // dispatch): record it as an ordinary op.
  if (f.composite && !composite_ran_itself(f, outputs)) return -1;
  busy_ = true;
  try {
    const OpInfo& info = *f.info;
    OpRecord rec;
    rec.kind = info.kind;
    rec.duration_ns = end_ns - f.start_ns;
    rec.inputs = std::move(f.inputs);
    bool writes_external = false;
    for (const ArgRef& a : rec.inputs) {
      if (static_cast<size_t>(a.arg) < info.writes_arg.size() && info.writes_arg[static_cast<size_t>(a.arg)]) {
        const StorageId s = tape_.value(a.value).storage;
        if (std::find(rec.writes.begin(), rec.writes.end(), s) == rec.writes.end()) rec.writes.push_back(s);
        writes_external = writes_external || tape_.storage(s).external;
      }
    }
    const size_t input_writes = rec.writes.size();
    // Note [Bytes no recorded op wrote]: reads of bytes no recorded op wrote become external values (held live,
    // opaque to pack), before the outputs are registered (an in-place op's output is the tensor it read).
    if (!f.unwritten.empty()) externalize_unwritten(f, rec, outputs, input_writes > 0);
    std::vector<StorageId>& out_storages = scratch_storages_;
    out_storages.clear();
    OutputScan scan;
    auto add_output = [&](const at::Tensor& t) { register_output(rec, t, scan); };
    for (const c10::IValue& o : outputs) {
      if (o.isTensor()) {
        add_output(o.toTensor());
      } else if (o.isTensorList()) {
        for (const at::Tensor& t : o.toTensorList().vec()) add_output(t);
      } else if (o.isList()) {
        for (const c10::IValue& e : o.toListRef()) {
          if (e.isTensor()) add_output(e.toTensor());
          else if (e.isNone()) rec.outputs.push_back(-1);
        }
      } else if (contains_tensor(o)) {
        f.non_replayable = true;
      }
    }
    if (input_writes == 0 && !scan.any_new_storage && !out_storages.empty()) {
      rec.flags |= kView;
      for (ArgRef& a : rec.inputs) {
        const StorageId s = tape_.value(a.value).storage;
        a.meta_only = std::find(out_storages.begin(), out_storages.end(), s) != out_storages.end();
      }
    }
    if (writes_external) rec.flags |= kWritesExternal;
    if (f.non_replayable || info.effectful) rec.flags |= kNonReplayable;
    settle_rng_probe(f);
    if (f.generator.has_value()) rec.flags |= kRandom;
    if (info.nondeterministic_bitwise && scan.cuda) rec.flags |= kNondeterministic | kNonReplayable;
    if (info.uninitialized || deterministic_fill(info, rec)) rec.flags |= kUninitialized;
    if (info.unwritten_outputs) rec.flags |= kUnwrittenBytes;
    note_writes(rec);
    const OpIndex index = tape_.add_op(std::move(rec));
    OpPayload& payload = payloads_.emplace_back();
    payload.handle = info.handle;
    payload.args = std::move(f.args);
    payload.generator = std::move(f.generator);
    payload.generator_state = std::move(f.generator_state);
    payload.generator_arg = static_cast<int16_t>(info.generator_arg);
    if (live_.size() < tape_.values().size()) live_.resize(tape_.values().size());
    busy_ = false;
    return index;
  } catch (const std::exception& e) {
    busy_ = false;
    note_failure(call, e);
  }
  return -1;
}

}  // namespace tapesac::capture
