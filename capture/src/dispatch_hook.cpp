// The dispatch hook (see dispatch_hook.h, Note [Dispatch hook]).
#include "tapesac/capture/dispatch_hook.h"

#include <array>
#include <atomic>
#include <mutex>
#include <optional>
#include <stdexcept>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

namespace tapesac::capture::dispatch_hook {
namespace {

struct ThreadObservers {
  std::array<CallObserver*, kMaxObservers> slots{};
  int count = 0;
  int depth = 0;
};

thread_local ThreadObservers t_observers;

void set_included(bool on) { c10::impl::tls_set_dispatch_key_included(kKey, on); }

}  // namespace

bool tracing_fakes() {
  return c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::FAKE).has_value();
}

namespace {

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  ThreadObservers& t = t_observers;
  keys = keys.remove(kKey);
  if (t.count == 0) {
    // The key came with a copy of another thread's state (Note [Dispatch hook], thread model): leave it here.
    set_included(false);
    c10::impl::ExcludeDispatchKeyGuard no_hook(kKey);
    op.redispatchBoxed(keys, stack);
    return;
  }
  const int depth = t.depth;
  if ((depth > 0 && c10::impl::tls_local_dispatch_key_set().excluded_.has_any(c10::autograd_dispatch_keyset)) ||
      tracing_fakes()) {
    // Called by a kernel below autograd, or computing nothing (Note [Dispatch hook]): neither it nor what it calls
    // is seen.
    c10::impl::ExcludeDispatchKeyGuard no_hook(kKey);
    op.redispatchBoxed(keys, stack);
    return;
  }
  const size_t n_args = op.schema().arguments().size();
  const c10::ArrayRef<c10::IValue> args(stack->data() + (stack->size() - n_args), n_args);
  // The observers told about this call: the exit goes to those still attached when it returns.
  std::array<CallObserver*, kMaxObservers> entered{};
  bool nested = false;
  {
    // What the observers themselves dispatch (aliases, generator states, saved copies) is theirs, not the user's.
    c10::impl::ExcludeDispatchKeyGuard no_hook(kKey);
    for (int i = 0; i < kMaxObservers; ++i) {
      CallObserver* o = t.slots[static_cast<size_t>(i)];
      if (o == nullptr) continue;
      entered[static_cast<size_t>(i)] = o;
      nested = o->on_call_enter(op, args, depth) || nested;
    }
  }
  auto exit_all = [&](c10::ArrayRef<c10::IValue> returns) {
    c10::impl::ExcludeDispatchKeyGuard no_hook(kKey);
    for (int i = kMaxObservers - 1; i >= 0; --i) {
      CallObserver* o = entered[static_cast<size_t>(i)];
      if (o != nullptr && t.slots[static_cast<size_t>(i)] == o) o->on_call_exit(op, returns);
    }
  };
  ++t.depth;
  try {
    if (nested) {
      op.redispatchBoxed(keys, stack);
    } else {
      c10::impl::ExcludeDispatchKeyGuard no_hook(kKey);
      op.redispatchBoxed(keys, stack);
    }
  } catch (...) {
    t.depth = depth;
    exit_all({});
    throw;
  }
  t.depth = depth;
  const size_t n_returns = op.schema().returns().size();
  exit_all(c10::ArrayRef<c10::IValue>(stack->data() + (stack->size() - n_returns), n_returns));
}

struct Registration {
  std::mutex mu;
  std::atomic<int> available{-1};  // -1: not tried yet; 0: refused; 1: registered
  std::optional<c10::RegistrationHandleRAII> handle;  // held for the process: never deregistered
};

Registration& registration() {
  static auto* r = new Registration();  // leaked on purpose: the dispatcher outlives static destructors' order
  return *r;
}

}  // namespace

bool available() {
  Registration& r = registration();
  const int known = r.available.load(std::memory_order_acquire);
  if (known >= 0) return known == 1;
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.available.load(std::memory_order_relaxed) >= 0) return r.available.load(std::memory_order_relaxed) == 1;
  c10::Dispatcher& d = c10::Dispatcher::singleton();
  bool ok = false;
  if (!d.hasBackendFallbackForDispatchKey(kKey)) {
    try {
      r.handle.emplace(d.registerFallback(kKey, c10::KernelFunction::makeFromBoxedFunction<&fallback>(),
                                          "tapesac dispatch hook (capture/src/dispatch_hook.cpp)"));
      ok = true;
    } catch (const std::exception&) {
      ok = false;  // registered by someone else meanwhile: at::RecordFunction it is
    }
  }
  r.available.store(ok ? 1 : 0, std::memory_order_release);
  return ok;
}

void attach(CallObserver* observer) {
  if (observer == nullptr) throw std::invalid_argument("tapesac: dispatch_hook::attach(nullptr)");
  if (!available()) {
    throw std::logic_error(
        "tapesac: the dispatch hook is not available (another library registered a fallback on its dispatch key); "
        "record through at::RecordFunction instead");
  }
  ThreadObservers& t = t_observers;
  for (CallObserver* o : t.slots) {
    if (o == observer) return;
  }
  for (CallObserver*& o : t.slots) {
    if (o == nullptr) {
      o = observer;
      ++t.count;
      set_included(true);
      return;
    }
  }
  throw std::logic_error("tapesac: more than " + std::to_string(kMaxObservers) +
                         " dispatch hook observers attached on one thread");
}

void detach(CallObserver* observer) noexcept {
  ThreadObservers& t = t_observers;
  for (CallObserver*& o : t.slots) {
    if (o != nullptr && o == observer) {
      o = nullptr;
      --t.count;
      if (t.count == 0) set_included(false);
      return;
    }
  }
}

bool attached(const CallObserver* observer) {
  for (const CallObserver* o : t_observers.slots) {
    if (o != nullptr && o == observer) return true;
  }
  return false;
}

}  // namespace tapesac::capture::dispatch_hook
