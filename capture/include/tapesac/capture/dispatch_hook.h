// The dispatch hook: a boxed dispatcher fallback through which the recorder and the write watcher see the operator
// calls of their thread, at the level autograd sees them, without at::RecordFunction.
//
// Note [Dispatch hook]. at::RecordFunction with inputs boxes the arguments of *every* dispatcher call on the thread
// (the calls each kernel makes included) and builds a RecordFunction for each. The hook instead is a fallback
// registered on one dispatch key above autograd, and that key is included in the thread's dispatch key set only while
// an observer is attached there. A call that reaches it is handed to the observers, then redispatched below the key.
// What a call does inside is seen only as far as needed:
//  * a call made while the autograd keys are excluded (by a kernel below autograd: a backend kernel, or the part of
//    an autograd kernel that runs the op itself) is not told to the observers, and the key is excluded for everything
//    it calls, so the calls kernels make cost one skipped fallback per subtree;
//  * a call made at autograd level inside another one is told (the children of a CompositeImplicitAutograd op, an
//    autocast wrapper's inner call, the clone an in-place op's autograd kernel saves: all are ops autograd sees);
//  * unless an observer asks for them (on_call_enter returns true), the key is excluded for the whole call.
// The one exception to the first rule is a call from user code (depth 0): torch's Python bindings of factory
// functions exclude the autograd keys themselves, yet autograd sees those ops.
// Calls made while a FakeTensorMode is active are not told either: they are torch.compile's (or export's) tracing,
// which computes nothing; the compiled code's real calls are seen when it runs. This matters because dynamo guards
// on the thread's dispatch key set: code compiled outside a step is traced again the first time it runs while the
// key is included (inside a recorded block), and that trace must not be mistaken for the block's ops.
//
// The key is c10::DispatchKey::TESTING_ONLY_GenericMode: the one functionality key above autograd and autocast that
// PyTorch registers nothing on and that has no other user in PyTorch itself (its own tests use it in a separate
// process). The fallback is registered on first use; when the key already has a fallback (another library took it),
// available() is false and callers use at::RecordFunction instead (RecorderOptions::hook).
//
// Thread model: observers are per thread (attach/detach on the thread that runs the calls). A thread whose dispatch
// key set includes the key without an observer (a copy of the thread-local state taken while one was attached, e.g.
// by the autograd engine) removes it from its own set at its first call.
#pragma once

#include <c10/core/DispatchKey.h>
#include <c10/util/ArrayRef.h>

namespace c10 {
class IValue;
class OperatorHandle;
}  // namespace c10

namespace tapesac::capture {

/// Told about every operator call that reaches the hook on its thread while attached.
class CallObserver {
 public:
  virtual ~CallObserver() = default;
  /// Before `op` runs with `args` (the boxed arguments, in schema order). `depth`: the number of hook calls in
  /// progress on this thread (0: a call from user code). Returns true when the observer needs to see the calls made
  /// inside this one. Must not throw (an observer records its own failures).
  virtual bool on_call_enter(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int depth) noexcept = 0;
  /// After the call: `returns` are its results, empty when it threw. Called exactly once per on_call_enter() while
  /// the observer stays attached. Must not throw.
  virtual void on_call_exit(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> returns) noexcept = 0;
};

namespace dispatch_hook {

/// The dispatch key the hook is registered on.
constexpr c10::DispatchKey kKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
/// The most observers one thread can have attached at once (the recorder and the write watcher).
constexpr int kMaxObservers = 4;

/// Registers the fallback if needed; false when the key's fallback belongs to someone else (then nothing is
/// registered and attach() must not be called). Thread-safe.
bool available();
/// Attaches `observer` on the calling thread (a borrowed pointer: detach before destroying it) and includes the key in
/// the thread's dispatch key set. Throws std::logic_error when not available() or when kMaxObservers are attached.
void attach(CallObserver* observer);
/// Detaches `observer` from the calling thread (a no-op when it is not attached there); the key leaves the thread's
/// set with the last observer. Never throws.
void detach(CallObserver* observer) noexcept;
/// True when `observer` is attached on the calling thread.
bool attached(const CallObserver* observer);
/// True while a FakeTensorMode is active on the calling thread (torch.compile, torch.export and make_fx trace with
/// one): the calls then compute nothing, and neither hook tells them (Note [Dispatch hook]).
bool tracing_fakes();

}  // namespace dispatch_hook
}  // namespace tapesac::capture
