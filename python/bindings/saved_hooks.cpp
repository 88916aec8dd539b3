// tapesac's saved-tensor hooks: how autograd hands a block call the tensors it saves (pack) and asks for them back
// (unpack). Two ways in, one behaviour:
// - the (pack, unpack) pair of C functions that StepHooks pushes with torch's saved_tensors_hooks stack (hooks.py):
//   what the stack shows, what other saved_tensors_hooks nest with, and the way in when the C++ hooks are off;
// - Note [Saved tensors without Python]: while that pair is the innermost on the stack, autograd's engine hands each
//   SavedVariable C++ hooks that do the same without a Python object, the GIL or pybind11.
#include <ATen/SavedTensorHooks.h>
#include <ATen/core/grad_mode.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstdlib>
#include <strings.h>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "bindings.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/errors.h"
#include "tapesac/replay/session.h"

namespace py = pybind11;
namespace ag = torch::autograd;

namespace tapesac::python {
namespace {

using replay::SavedSlot;
using replay::Session;

constexpr const char* kSlotCapsule = "tapesac.SavedSlot";
constexpr const char* kSessionCapsule = "tapesac.Session";

// Whether autograd saves `t` as itself (Note [Saved as itself], replay/src/block_call_replay.cpp): a leaf, or a tensor
// whose node is not the one being made — an output is packed after its node was made, the newest on the thread.
bool saved_as_itself(const at::Tensor& t) {
  const auto& fn = t.grad_fn();  // a shared_ptr or an intrusive_ptr, by torch version
  return fn == nullptr || fn->sequence_nr() + 1 != at::sequence_number::peek();
}

// Note [Tensors packed as they are]. A saved tensor of a Python subclass (a __torch_function__ or __torch_dispatch__
// subclass; nn.Parameter counts as plain, as THPVariable_CheckExact has it) or of another layout than strided
// (sparse, nested) is handed back to autograd as the object itself: no slot, never dropped, unpacked as plain autograd
// unpacks it. A slot serves a tensor, and its Python wrapper was a new torch.Tensor: ctx.saved_tensors lost the
// subclass (a backward that checks it gave other gradients, under policy "none" too), a wrapper subclass without
// storage (torch's TwoTensor) segfaulted in the backward's kernel, and a sparse saved tensor raised an untyped "Cannot
// access storage of SparseTensorImpl" at the block's end (adversarial tests). Such tensors are the model's own or carry
// their own semantics: keeping them costs no activation memory that tapesac could have saved.
bool other_layout(const at::Tensor& t) { return t.defined() && (t.layout() != c10::kStrided || t.is_nested()); }

// The Python object of `t` if it has one (nullptr: none yet; autograd's Python hooks would wrap it as a torch.Tensor).
// Read without the GIL: the object lives as long as the TensorImpl the caller holds. PyObjectSlot::load_pyobj is
// recent (torch 2.14 has it); where it is missing the C++ hooks are off (kCppHooksBuilt) and the Python pair serves.
template <class Slot>
auto load_pyobj_of(const Slot* slot, int) -> decltype(slot->load_pyobj()) {
  return slot->load_pyobj();
}
template <class Slot>
PyObject* load_pyobj_of(const Slot*, long) {
  return nullptr;
}
template <class Slot>
constexpr bool has_load_pyobj(decltype(std::declval<const Slot*>()->load_pyobj())*) {
  return true;
}
template <class Slot>
constexpr bool has_load_pyobj(...) {
  return false;
}
constexpr bool kCppHooksBuilt = has_load_pyobj<c10::impl::PyObjectSlot>(nullptr);

bool subclass_object(const at::Tensor& t) {
  PyObject* obj = t.defined() ? load_pyobj_of(t.unsafeGetTensorImpl()->pyobj_slot(), 0) : nullptr;
  return obj != nullptr && !THPVariable_CheckExact(obj);
}

// ---------------------------------------------------------------------------------------------------------------
// The Python pair.

void release_slot(PyObject* capsule) {
  delete static_cast<SavedSlot*>(PyCapsule_GetPointer(capsule, kSlotCapsule));
}

// Both ways in: `t`'s slot in the session's open block call; none when no block call is open (the caller keeps a
// detached alias of `t`).
std::optional<SavedSlot> slot_for(Session& s, const at::Tensor& t) {
  auto block = s.current_block();
  if (block == nullptr) return std::nullopt;
  const int32_t slot = block->pack(t, t.defined() && saved_as_itself(t));
  return std::optional<SavedSlot>(std::in_place, std::move(block), slot);
}

// A capsule is the cheapest Python object with a destructor: autograd drops it with the graph node that saved the
// tensor, which releases the slot.
PyObject* slot_capsule(SavedSlot&& slot) {
  auto heap = std::make_unique<SavedSlot>(std::move(slot));
  PyObject* capsule = PyCapsule_New(heap.get(), kSlotCapsule, &release_slot);
  if (capsule != nullptr) heap.release();
  return capsule;
}

PyObject* pack(Session& s, const at::Tensor& t) {
  std::optional<SavedSlot> slot = slot_for(s, t);
  if (!slot) return THPVariable_Wrap(capture::detached_alias(t));
  return slot_capsule(std::move(*slot));
}

at::Tensor unpack(PyObject* obj) {
  if (THPVariable_Check(obj)) return THPVariable_Unpack(obj);
  TAPESAC_CHECK(PyCapsule_IsValid(obj, kSlotCapsule), kGeneric,
                "tapesac: unpack expected a tensor or a tapesac saved slot, got ", Py_TYPE(obj)->tp_name);
  const auto* slot = static_cast<const SavedSlot*>(PyCapsule_GetPointer(obj, kSlotCapsule));
  py::gil_scoped_release no_gil;  // replay may be long; Python dispatch modes re-take the GIL
  return slot->unpack();
}

// Note [Hooks without pybind11]. Autograd calls pack once per saved tensor: its call path is the forward's hot path.
// pack_hook/unpack_hook are plain METH_O functions whose self is a capsule of the Session (its context a strong
// reference to the Python Session object, which keeps it alive), skipping pybind11's overload dispatch and argument
// casters: about 8,000 instructions per call, measured with perf/bench_record.py --instructions.
Session& session_of(PyObject* self) { return *static_cast<Session*>(PyCapsule_GetPointer(self, kSessionCapsule)); }

PyObject* pack_hook(PyObject* self, PyObject* arg) noexcept {
  if (!THPVariable_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "tapesac: pack expected a tensor, got %s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  try {
    const at::Tensor& t = THPVariable_Unpack(arg);
    if (!THPVariable_CheckExact(arg) || other_layout(t)) {  // Note [Tensors packed as they are]
      Py_INCREF(arg);
      return arg;
    }
    return pack(session_of(self), t);
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

constexpr const char* kFailedFlagCapsule = "tapesac.BackwardFailed";

void release_failed_flag(PyObject* capsule) {
  delete static_cast<std::shared_ptr<std::atomic<bool>>*>(PyCapsule_GetPointer(capsule, kFailedFlagCapsule));
}

// Note [Compiled autograd and create_graph]. Compiled autograd serves what an unpack hook returns without the
// autograd history that eager autograd's SavedVariable::unpack reattaches, and tapesac's saved tensors (served from a
// slot, replayed, or aliased) have none of their own: under create_graph=True the higher-order gradients through
// them came out silently wrong (an adversarial test: 4.5 off, both paths; plain PyTorch with a detaching pack hook
// raises instead). Refused: the unpack function compiled autograd calls (the C++ hooks' own, whose self is the flag
// capsule; the pair's, called while torch._dynamo.compiled_autograd.in_compiled_autograd_region) with grad mode on,
// which under compiled autograd is create_graph.
bool compiled_autograd_with_create_graph(PyObject* self) {
  if (!c10::GradMode::is_enabled()) return false;
  if (PyCapsule_IsValid(self, kFailedFlagCapsule)) return true;
  PyObject* modules = PyImport_GetModuleDict();  // borrowed; the module is not imported here
  PyObject* ca = modules != nullptr ? PyDict_GetItemString(modules, "torch._dynamo.compiled_autograd") : nullptr;
  if (ca == nullptr) return false;
  PyObject* region = PyObject_GetAttrString(ca, "in_compiled_autograd_region");
  if (region == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool in_region = PyObject_IsTrue(region) == 1;
  Py_DECREF(region);
  return in_region;
}

PyObject* unpack_hook(PyObject* self, PyObject* arg) noexcept {
  try {
    TAPESAC_CHECK(!compiled_autograd_with_create_graph(self), kConfig,
                  "tapesac: a backward with create_graph=True under compiled autograd: compiled autograd serves "
                  "saved tensors without the autograd history eager autograd reattaches, so gradients through "
                  "tapesac's saved tensors would be wrong. Run that backward without compiled autograd, or without "
                  "create_graph (Note [Compiled autograd and create_graph])");
    return THPVariable_Wrap(unpack(arg));
  } catch (...) {
    // The step's backward failed (Session::backward_failed): `self` is the session's capsule, or the flag's
    // (the unpack function handed to compiled autograd, TapeSavedHooks::retrieve_unpack_hook_data).
    if (PyCapsule_IsValid(self, kSessionCapsule)) {
      session_of(self).note_backward_error();
    } else if (PyCapsule_IsValid(self, kFailedFlagCapsule)) {
      (*static_cast<std::shared_ptr<std::atomic<bool>>*>(PyCapsule_GetPointer(self, kFailedFlagCapsule)))->store(true);
    }
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyMethodDef g_pack_def = {"tapesac_pack", &pack_hook, METH_O, "tapesac's saved-tensor pack hook"};
PyMethodDef g_unpack_def = {"tapesac_unpack", &unpack_hook, METH_O, "tapesac's saved-tensor unpack hook"};

// ---------------------------------------------------------------------------------------------------------------
// Note [Saved tensors without Python]. Autograd's Python saved-tensor hooks cost about 10.8k instructions per saved
// tensor whatever the hooks do (perf/results/2026-12-03_issue20_torch_floor_cpu.md): a PySavedVariableHooks object,
// three GIL acquisitions (torch's op bindings release the GIL around every op), a Python tensor object per saved
// tensor and the capsule. Every SavedVariable asks the default autograd engine for its hooks
// (Engine::get_default_saved_variable_hooks, a virtual). While a tapesac session uses saved-tensor hooks, the
// default engine is a HookingEngine: when the innermost pair on this thread's saved_tensors_hooks stack is a tapesac
// session's (pack_hook's C function, as StepHooks pushed it), it returns TapeSavedHooks, which pack into the block
// call and unpack from it in C++; otherwise, and for everything else an engine does, it forwards to the engine it
// replaced (torch's PythonEngine). The stack is still the one truth: nesting with the user's saved_tensors_hooks,
// torch.func's disabling, dynamo's tracing flag and _top_saved_tensors_default_hooks behave as with the Python pair.
// The engine is swapped back when the last session's pair is gone (release_session_capsule). TAPESAC_SAVED_HOOKS=
// python (or _C.set_saved_hooks_in_cpp(False)) keeps the Python pair's path.
std::atomic<bool> g_cpp_hooks{[] {
  const char* v = std::getenv("TAPESAC_SAVED_HOOKS");  // validated by tapesac/__init__.py: "", "cpp" or "python"
  return kCppHooksBuilt && (v == nullptr || strcasecmp(v, "python") != 0);
}()};

// The session whose pair is innermost on this thread's saved-tensor hook stack, if hooks apply to a save now.
Session* session_on_top() {
  if (!g_cpp_hooks.load(std::memory_order_relaxed)) return nullptr;
  const auto& tls = at::SavedTensorDefaultHooks::get_tls_state();
  if (tls.is_tracing || tls.stack.empty()) return nullptr;
  const c10::SafePyObject& pack_fn = tls.stack.top().first;
  PyObject* fn = pack_fn.ptr(&pack_fn.pyinterpreter());
  // Reads the type and the method table only: the stack holds a reference to `fn`, no GIL needed.
  if (fn == nullptr || Py_TYPE(fn) != &PyCFunction_Type || PyCFunction_GET_FUNCTION(fn) != &pack_hook) return nullptr;
  return &session_of(PyCFunction_GET_SELF(fn));
}

// Raises the current C++ exception as the Python error the pair of C functions raises (tapesac.errors' classes),
// carried through autograd as torch's python_error.
[[noreturn]] void rethrow_as_python(std::exception_ptr p) {
  py::gil_scoped_acquire gil;
  set_python_error(p);
  python_error err;  // torch/csrc/Exceptions.h, global namespace
  err.persist();
  throw err;
}

thread_local int64_t t_cpp_packs = 0;  // saves packed by TapeSavedHooks on this thread (tests: which path ran)

// One SavedVariable's hooks: its slot of the open block call (or the tensor itself: no block open, or packed as it
// is). Compiled autograd asks for Python hook data instead (retrieve_unpack_hook_data): the slot then moves into a
// capsule, served by the pair's unpack function as the Python path serves it, and call_unpack_hook reads it there.
class TapeSavedHooks final : public ag::SavedVariableHooks {
 public:
  explicit TapeSavedHooks(Session& s) : session_(&s) {}
  TapeSavedHooks(const TapeSavedHooks&) = delete;
  TapeSavedHooks& operator=(const TapeSavedHooks&) = delete;

  ~TapeSavedHooks() override {
    if (capsule_ != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(capsule_);
    }
  }

  void call_pack_hook(const at::Tensor& t) override {
    ++t_cpp_packs;
    try {
      if (subclass_object(t) || other_layout(t)) {  // Note [Tensors packed as they are]
        tensor_ = t;
      } else if (std::optional<SavedSlot> slot = slot_for(*session_, t)) {
        slot_.emplace(std::move(*slot));
        backward_failed_ = session_->backward_failed_flag();
      } else {
        tensor_ = capture::detached_alias(t);
      }
    } catch (...) {
      rethrow_as_python(std::current_exception());
    }
    session_ = nullptr;  // pack only: the slot and the flag outlive the session
  }

  at::Tensor call_unpack_hook() override {
    const SavedSlot* slot = slot_ ? &*slot_ : capsule_slot();
    if (slot == nullptr) return tensor_;
    try {
      if (PyGILState_Check()) {  // unpacked from Python (grad_fn._saved_*): replay without the GIL
        py::gil_scoped_release no_gil;
        return slot->unpack();
      }
      return slot->unpack();
    } catch (...) {
      if (backward_failed_) backward_failed_->store(true, std::memory_order_relaxed);  // Session::backward_failed
      rethrow_as_python(std::current_exception());
    }
  }

  std::optional<std::pair<c10::SafePyObject, c10::SafePyObject>> retrieve_unpack_hook_data() const override {
    py::gil_scoped_acquire gil;
    if (capsule_ == nullptr) {
      if (slot_) {
        capsule_ = slot_capsule(std::move(*slot_));
        slot_.reset();
      } else {
        capsule_ = THPVariable_Wrap(tensor_);
      }
      if (capsule_ == nullptr) throw python_error();
    }
    auto* flag = new std::shared_ptr<std::atomic<bool>>(backward_failed_);
    PyObject* flag_capsule = PyCapsule_New(flag, kFailedFlagCapsule, &release_failed_flag);
    if (flag_capsule == nullptr) {
      delete flag;
      throw python_error();
    }
    PyObject* fn = PyCFunction_New(&g_unpack_def, flag_capsule);
    Py_DECREF(flag_capsule);  // the function holds it
    if (fn == nullptr) throw python_error();
    Py_INCREF(capsule_);
    c10::impl::PyInterpreter* interp = getPyInterpreter();
    return std::make_pair(c10::SafePyObject(fn, interp), c10::SafePyObject(capsule_, interp));
  }

 private:
  const SavedSlot* capsule_slot() const {
    if (capsule_ == nullptr || !PyCapsule_IsValid(capsule_, kSlotCapsule)) return nullptr;
    return static_cast<const SavedSlot*>(PyCapsule_GetPointer(capsule_, kSlotCapsule));
  }

  Session* session_;
  mutable std::optional<SavedSlot> slot_;
  at::Tensor tensor_;
  std::shared_ptr<std::atomic<bool>> backward_failed_;
  mutable PyObject* capsule_ = nullptr;  // compiled autograd's data: the slot's capsule, or the tensor's object
};

ag::Engine* g_previous = nullptr;  // the default engine the HookingEngine forwards to (torch's PythonEngine)

// Engine::get_node_creation_hooks exists in newer torch versions only: forwarded where it does.
template <class Base, class = void>
struct ForwardNodeCreationHooks : Base {};
template <class Base>
struct ForwardNodeCreationHooks<Base, std::void_t<decltype(std::declval<Base&>().get_node_creation_hooks())>> : Base {
  decltype(std::declval<Base&>().get_node_creation_hooks()) get_node_creation_hooks() override {
    return g_previous->get_node_creation_hooks();
  }
};

class HookingEngine final : public ForwardNodeCreationHooks<ag::Engine> {
 public:
  ag::variable_list execute(const ag::edge_list& roots, const ag::variable_list& inputs, bool keep_graph,
                            bool create_graph, bool accumulate_grad, const ag::edge_list& outputs) override {
    return g_previous->execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }
  c10::intrusive_ptr<at::ivalue::Future> execute_with_graph_task(const std::shared_ptr<ag::GraphTask>& graph_task,
                                                                  c10::intrusive_ptr<ag::Node> graph_root,
                                                                  ag::InputBuffer&& input_buffer) override {
    return g_previous->execute_with_graph_task(graph_task, std::move(graph_root), std::move(input_buffer));
  }
  std::unique_ptr<ag::AnomalyMetadata> make_anomaly_metadata() override { return g_previous->make_anomaly_metadata(); }
  std::unique_ptr<ag::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (Session* s = session_on_top()) return std::make_unique<TapeSavedHooks>(*s);
    return g_previous->get_default_saved_variable_hooks();
  }
  void thread_on_exception(const std::shared_ptr<ag::GraphTask>& graph_task, const c10::intrusive_ptr<ag::Node>& fn,
                           std::exception& e) override {
    g_previous->thread_on_exception(graph_task, fn, e);
  }
  void thread_init(int device, const std::shared_ptr<ag::ReadyQueue>& ready_queue, bool should_increment) override {
    g_previous->thread_init(device, ready_queue, should_increment);
  }
};

std::mutex g_engine_mu;
int g_engine_users = 0;                // live session capsules (pairs of C functions)
HookingEngine* g_hooking = nullptr;    // made once, never destroyed (the stub may be read at exit)

ag::Engine& hooking_engine() { return *g_hooking; }
ag::Engine& previous_engine() { return *g_previous; }

void acquire_hooking_engine() {
  std::lock_guard<std::mutex> lock(g_engine_mu);
  if (g_engine_users++ > 0) return;
  if (g_hooking == nullptr) {
    g_previous = &ag::Engine::get_default_engine();
    g_hooking = new HookingEngine();
  }
  ag::set_default_engine_stub(&hooking_engine);
}

void release_hooking_engine() {
  std::lock_guard<std::mutex> lock(g_engine_mu);
  if (--g_engine_users > 0) return;
  // Only if it is still ours: something that replaced it since keeps its own.
  if (&ag::Engine::get_default_engine() == g_hooking) ag::set_default_engine_stub(&previous_engine);
}

void release_session_capsule(PyObject* capsule) {
  Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(capsule)));
  release_hooking_engine();
}

// (pack, unpack) for torch.autograd.graph.saved_tensors_hooks, bound to `self`'s Session.
py::tuple saved_tensor_hooks(const py::object& self) {
  Session& s = self.cast<Session&>();
  py::object capsule = py::reinterpret_steal<py::object>(PyCapsule_New(&s, kSessionCapsule, &release_session_capsule));
  if (!capsule) throw py::error_already_set();
  acquire_hooking_engine();  // released by the capsule's destructor
  PyCapsule_SetContext(capsule.ptr(), self.inc_ref().ptr());
  py::object pack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&g_pack_def, capsule.ptr()));
  py::object unpack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&g_unpack_def, capsule.ptr()));
  if (!pack_fn || !unpack_fn) throw py::error_already_set();
  return py::make_tuple(pack_fn, unpack_fn);
}

}  // namespace

void bind_saved_hooks(py::module_& m, py::class_<Session>& session) {
  session.def("saved_tensor_hooks", &saved_tensor_hooks,
              "(pack, unpack) for torch.autograd.graph.saved_tensors_hooks, without pybind11 on the hot path; while "
              "they are innermost, autograd saves through C++ hooks (Note [Saved tensors without Python])");
  m.def(
      "set_saved_hooks_in_cpp", [](bool on) { g_cpp_hooks.store(on && kCppHooksBuilt, std::memory_order_relaxed); },
      py::arg("on"),
      "Whether saves under a tapesac pair go through C++ hooks (default; TAPESAC_SAVED_HOOKS=python: off) or through "
      "autograd's Python hooks. Between steps.");
  m.def("saved_hooks_in_cpp", [] { return g_cpp_hooks.load(std::memory_order_relaxed); });
  m.def("cpp_saved_packs", [] { return t_cpp_packs; }, "Saves packed through the C++ hooks on this thread so far");
  m.def("hooking_engine_users", [] {
    std::lock_guard<std::mutex> lock(g_engine_mu);
    return g_engine_users;
  }, "Live pairs of tapesac saved-tensor hooks (the default engine is tapesac's while there are any)");
  m.def("hooking_engine_installed",
        [] { return g_hooking != nullptr && &ag::Engine::get_default_engine() == g_hooking; },
        "Whether autograd's default engine is tapesac's (a session's saved-tensor hooks are alive)");
}

}  // namespace tapesac::python
