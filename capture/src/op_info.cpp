// Per-operator facts, computed once (see op_info.h).
#include "tapesac/capture/op_info.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/enum_tag.h>

#include "tapesac/capture/op_kinds.h"

namespace tapesac::capture {
namespace {

bool has_kernel(const c10::OperatorHandle& h, c10::DispatchKey k) { return h.hasKernelForDispatchKey(k); }

// Mirrors the dispatcher's rule for autograd keys (OperatorEntry::computeDispatchTableEntry): an op runs its
// CompositeImplicitAutograd kernel at autograd level unless the backend, or a CompositeExplicitAutograd kernel, was
// registered directly. Some composite ops also carry an Autograd[alias] registration that still decomposes at
// autograd level (aten::linear in torch 2.14), so that alias is not taken as proof of the opposite; the recorder
// checks each call instead (Note [Composite ops that run themselves] in recorder.cpp).
bool decomposes(const c10::OperatorHandle& h, c10::DispatchKey autograd_key, c10::DispatchKey backend) {
  if (!has_kernel(h, c10::DispatchKey::CompositeImplicitAutograd)) return false;
  if (has_kernel(h, autograd_key)) return false;
  if (has_kernel(h, backend) || has_kernel(h, c10::DispatchKey::CompositeExplicitAutograd) ||
      has_kernel(h, c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
    return false;
  }
  return true;
}

// Note [Bytes no recorded op wrote] (tape.h): the ops that leave the bytes they allocate unset.
bool leaves_bytes_unset(const std::string& name) {
  static const char* const kNames[] = {
      "aten::empty",          "aten::empty_like",     "aten::new_empty",
      "aten::new_empty_strided", "aten::empty_strided", "aten::empty_permuted",
      "aten::empty_quantized", "aten::_empty_affine_quantized", "aten::_empty_per_channel_affine_quantized",
      "aten::resize_",        "aten::resize_as_",     "aten::_resize_output_"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return false;
}

// In-place ops that write all of `self` without reading it.
bool overwrites_self(const std::string& name) {
  static const char* const kNames[] = {"aten::copy_",     "aten::fill_",       "aten::zero_",    "aten::normal_",
                                       "aten::uniform_",  "aten::bernoulli_",  "aten::random_",  "aten::exponential_",
                                       "aten::geometric_", "aten::cauchy_",     "aten::log_normal_"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return false;
}

// Factories that take only the metadata (sizes, dtype, device) of their first argument.
bool reads_meta_of_self(const std::string& name) {
  static const char* const kNames[] = {"aten::empty_like", "aten::zeros_like",   "aten::ones_like",
                                       "aten::full_like",  "aten::rand_like",    "aten::randn_like",
                                       "aten::randint_like", "aten::new_empty",  "aten::new_empty_strided",
                                       "aten::new_zeros",  "aten::new_ones",     "aten::new_full"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return false;
}

// See OpInfo::grad_mode_kernel.
bool kernel_reads_grad_mode(const std::string& name) { return name == "aten::mkldnn_rnn_layer"; }

std::unique_ptr<OpInfo> compute(const c10::OperatorHandle& h) {
  auto info = std::make_unique<OpInfo>(h);
  const c10::FunctionSchema& schema = h.schema();
  std::string qualified = schema.name();
  if (!schema.overload_name().empty()) qualified += "." + schema.overload_name();
  info->kind = intern_op_kind(qualified);
  info->decomposes_cpu = decomposes(h, c10::DispatchKey::AutogradCPU, c10::DispatchKey::CPU);
  info->decomposes_cuda = decomposes(h, c10::DispatchKey::AutogradCUDA, c10::DispatchKey::CUDA);
  info->autocast_cpu = has_kernel(h, c10::DispatchKey::AutocastCPU);
  info->autocast_cuda = has_kernel(h, c10::DispatchKey::AutocastCUDA);
  info->random = h.hasTag(at::Tag::nondeterministic_seeded);
  info->nondeterministic_bitwise = h.hasTag(at::Tag::nondeterministic_bitwise);
  const std::string& ns_name = schema.name();
  info->effectful = ns_name.rfind("c10d::", 0) == 0 || ns_name.rfind("_c10d_functional::", 0) == 0 ||
                    ns_name.rfind("_dtensor::", 0) == 0 || ns_name.rfind("profiler::", 0) == 0 ||
                    // torch.tensor(list) inside a block: `empty`, then the list's bytes are copied in where the
                    // dispatcher cannot see, then `lift_fresh`. Replay could not reproduce those bytes, so values
                    // built from it are kept. (An `empty` whose bytes a recorded op then writes replays fine.)
                    ns_name == "aten::lift_fresh" || ns_name == "aten::lift_fresh_copy" || ns_name == "aten::lift";
  const auto& args = schema.arguments();
  // An op given a Storage (set_.source_Storage: what `t.untyped_storage().copy_(...)`, `.fill_()` and
  // `Tensor.set_(storage)` dispatch) would rebind, at a replay, to the forward's storage held in its payload, not to
  // the replay's rebuilt tensor: the write it enables landed in the forward's bytes, and a later reader of the
  // written value was replayed from the bytes before the write (silently wrong under "check": an adversarial test).
  // Not replayable: what depends on it is kept.
  for (const c10::Argument& a : args) {
    if (a.type()->kind() == c10::TypeKind::StorageType) info->effectful = true;
  }
  // Every set_ rebinds its tensor to another storage and writes no byte of the one it had, although its schema marks
  // self as written: recorded as a write, `a.data.set_(b)` (which leaves `a` as it was) made a later reader of `a`
  // replay from b's bytes (an adversarial test). Not a write, and not replayable (what depends on it is kept).
  const bool rebinds = ns_name == "aten::set_";
  if (rebinds) info->effectful = true;
  info->writes_arg.resize(args.size(), false);
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    info->writes_arg[i] = alias != nullptr && alias->isWrite() && !rebinds;
    const std::string& n = args[i].name();
    // native_batch_norm and the cudnn/miopen variants update their running statistics in place without an
    // alias annotation in the schema: treat them as written, so that replay never applies the update twice.
    if (n == "running_mean" || n == "running_var") info->writes_arg[i] = true;
    if (n == "p" || n == "dropout_p") info->p_arg = static_cast<int>(i);
    if (n == "train") info->train_arg = static_cast<int>(i);
    if (n == "generator") info->generator_arg = static_cast<int>(i);
  }
  // A Generator in the schema (a custom op's `Generator? generator`) draws from it whatever its tags say.
  if (info->generator_arg >= 0 &&
      args[static_cast<size_t>(info->generator_arg)].type()->kind() != c10::TypeKind::GeneratorType) {
    const c10::TypePtr& t = args[static_cast<size_t>(info->generator_arg)].type();
    const bool optional_generator = t->kind() == c10::TypeKind::OptionalType &&
                                    t->containedTypes().size() == 1 &&
                                    t->containedTypes()[0]->kind() == c10::TypeKind::GeneratorType;
    if (!optional_generator) info->generator_arg = -1;  // an argument named "generator" that is none
  }
  if (info->generator_arg >= 0) info->random = true;
  const bool core_namespace = ns_name.rfind("aten::", 0) == 0 || ns_name.rfind("prims::", 0) == 0;
  info->probe_rng = !info->random && !core_namespace && !info->effectful;
  info->uninitialized = leaves_bytes_unset(ns_name);
  info->grad_mode_kernel = kernel_reads_grad_mode(ns_name);
  info->forward_ad = ns_name == "aten::_fw_primal" || ns_name == "aten::_make_dual" ||
                     ns_name == "aten::_unpack_dual" || ns_name == "aten::_fw_primal_copy" ||
                     ns_name == "aten::_make_dual_copy";
  info->fill = ns_name == "aten::fill_";
  info->unwritten_outputs = ns_name == "aten::_ctc_loss" || ns_name == "aten::_cudnn_ctc_loss";
  info->bytes_unread_arg.resize(args.size(), false);
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].is_out()) info->bytes_unread_arg[i] = true;
  }
  if (!args.empty() && (overwrites_self(ns_name) || reads_meta_of_self(ns_name))) info->bytes_unread_arg[0] = true;
  // Only dropout-style ops may skip drawing when p == 0 (probed then: Recorder::capture_rng); bernoulli(p=0) still
  // advances its generator.
  const bool dropout_like =
      ns_name.find("dropout") != std::string::npos || ns_name.find("scaled_dot_product") != std::string::npos;
  if (!dropout_like) info->p_arg = -1;
  return info;
}

// Note [Operators deregistered]. An operator's facts hold its OperatorHandle, which points into the dispatcher's
// entry for it; a torch.library.Library that goes away (a scoped library in a test, a notebook cell run again)
// deregisters its operators and that entry is freed. A name registered again must not be answered from the old
// entry: a dispatcher listener counts deregistrations (op_registry_epoch()), and an entry computed in an earlier
// epoch is computed again. The old facts are kept, never freed, as their pointers may still be held (a recording
// in progress, a thread's cache keyed by schema-name address: Recorder::start() empties it when the epoch moved).
std::atomic<uint64_t> g_registry_epoch{0};

class DeregistrationCounter final : public c10::OpRegistrationListener {
 public:
  // Called with the dispatcher's lock held: nothing here may dispatch or take a lock.
  void onOperatorRegistered(const c10::OperatorHandle& /*op*/) override {}
  void onOperatorDeregistered(const c10::OperatorHandle& /*op*/) override {
    g_registry_epoch.fetch_add(1, std::memory_order_acq_rel);
  }
};

void listen_for_deregistrations() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Held for the process (leaked on purpose, as the cache below).
    static auto* handle = new c10::RegistrationHandleRAII(
        c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<DeregistrationCounter>()));
    (void)handle;
  });
}

struct Entry {
  std::unique_ptr<OpInfo> info;
  uint64_t epoch = 0;
};

struct Cache {
  std::mutex mu;
  std::unordered_map<c10::OperatorName, Entry> by_name;
  std::vector<std::unique_ptr<OpInfo>> superseded;  // Note [Operators deregistered]
};

Cache& cache() {
  static Cache* c = new Cache();  // leaked on purpose: entries are used until process exit
  return *c;
}

}  // namespace

uint64_t op_registry_epoch() {
  listen_for_deregistrations();
  return g_registry_epoch.load(std::memory_order_acquire);
}

const OpInfo* op_info(const c10::OperatorName& name) {
  const uint64_t epoch = op_registry_epoch();
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.by_name.find(name);
  if (it != c.by_name.end() && it->second.epoch == epoch) return it->second.info.get();
  auto handle = c10::Dispatcher::singleton().findOp(name);
  if (!handle.has_value()) return nullptr;
  auto info = compute(*handle);
  const OpInfo* raw = info.get();
  if (it != c.by_name.end()) {
    c.superseded.push_back(std::move(it->second.info));
    it->second = Entry{std::move(info), epoch};
  } else {
    c.by_name.emplace(name, Entry{std::move(info), epoch});
  }
  return raw;
}

}  // namespace tapesac::capture
