// The eager replayer (see eager_replayer.h).
#include "tapesac/replay/eager_replayer.h"

#include <map>
#include <mutex>
#include <optional>
#include <sstream>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "tapesac/common/errors.h"
#include "tapesac/capture/op_kinds.h"
#include "tapesac/common/clock.h"
#include "replay_guard.h"

namespace tapesac::replay {
namespace {

using capture::ArgRef;
using capture::OpPayload;
using capture::OpRecord;

std::string op_label(const Tape& tape, OpIndex i) {
  // Appended piece by piece: `"#" + std::string` trips GCC 12's -Wrestrict false positive (GCC bug 105651).
  std::string label("#");
  label += std::to_string(i);
  label += ' ';
  label += capture::op_kind_name(tape.op(i).kind);
  return label;
}

std::string describe(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

}  // namespace

int64_t predict_working_set(const Tape& tape, const PruneResult& plan, const std::vector<Read>& targets) {
  const size_t nstorages = tape.storages().size();
  std::vector<int32_t> last_read(nstorages, -1);
  std::vector<uint8_t> pinned(nstorages, 0);
  for (const Read& r : targets) pinned[static_cast<size_t>(tape.value(r.value).storage)] = 1;
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    for (const ArgRef& a : tape.op(plan.ops[k]).inputs) {
      last_read[static_cast<size_t>(tape.value(a.value).storage)] = static_cast<int32_t>(k);
    }
  }
  int64_t live = 0;
  int64_t peak = 0;
  std::vector<std::vector<capture::StorageId>> free_after(plan.ops.size());
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    const OpIndex i = plan.ops[k];
    for (capture::StorageId s : tape.op(i).writes) {
      const capture::StorageInfo& info = tape.storage(s);
      if (info.external || info.writers.empty() || info.writers[0] != i) continue;  // in-place: no allocation
      live += info.nbytes;
      const auto su = static_cast<size_t>(s);
      if (pinned[su]) continue;
      // Freed after its last reader in the plan, or right after the op when nothing in the plan reads it.
      const int32_t last = std::max(last_read[su], static_cast<int32_t>(k));
      free_after[static_cast<size_t>(last)].push_back(s);
    }
    peak = std::max(peak, live);
    for (capture::StorageId s : free_after[k]) live -= tape.storage(s).nbytes;
  }
  return peak;
}

namespace {

// Puts `t` at position `elem` of the list argument `slot`. Lists are reference types: the first time per op
// (`copied` 0) the slot gets a fresh list, so that the payload's own list is never written.
void set_list_element(c10::IValue& slot, int elem, const at::Tensor& t, uint8_t& copied) {
  if (slot.isTensorList()) {
    if (!copied) {
      slot = c10::List<at::Tensor>();
      copied = 1;
    }
    auto list = slot.toTensorList();
    while (list.size() <= static_cast<size_t>(elem)) list.push_back(at::Tensor());
    list.set(static_cast<size_t>(elem), t);
  } else {
    if (!copied) {
      slot = slot.toList().copy();
      copied = 1;
    }
    auto list = slot.toList();
    list.set(static_cast<size_t>(elem), t);
  }
}

// Fills op `i`'s tensor arguments into `stack` (its boxed arguments) from the live tensors or the values replayed
// so far. `return_live` (run_ops): a live value read is also put in `env`. `list_copied`: 0 per stack slot.
void fill_inputs(const ReplaySource& source, OpIndex i, bool return_live, std::vector<at::Tensor>& env,
                 torch::jit::Stack& stack, std::vector<uint8_t>& list_copied) {
  const Tape& tape = *source.tape;
  for (const ArgRef& a : tape.op(i).inputs) {
    const ReadSource src = classify_read(tape, *source.available, a.value, a.state, a.meta_only);
    const at::Tensor& t =
        src == ReadSource::kLive ? (*source.live)[static_cast<size_t>(a.value)] : env[static_cast<size_t>(a.value)];
    TAPESAC_INTERNAL_ASSERT(t.defined(), "replay of op ", op_label(tape, i), " is missing its input v", a.value);
    if (src == ReadSource::kLive && !env[static_cast<size_t>(a.value)].defined() && return_live) {
      env[static_cast<size_t>(a.value)] = t;  // run_ops returns the live values read too
    }
    c10::IValue& slot = stack.at(static_cast<size_t>(a.arg));
    if (a.elem < 0) {
      slot = t;
    } else {
      set_list_element(slot, a.elem, t, list_copied[static_cast<size_t>(a.arg)]);
    }
  }
}

}  // namespace

bool same_layout(const capture::TensorMeta& m, const at::Tensor& t) {
  // The recorder keeps strides only for strided tensors (capture::meta_of); a 0-dim tensor has none either way.
  const bool recorded_strided = m.strides.size() == m.sizes.size();
  return m.sizes.empty() || recorded_strided == (t.layout() == c10::kStrided);
}

c10::Device device_of(const capture::TensorMeta& m) {
  return c10::Device(static_cast<c10::DeviceType>(m.device_type), static_cast<c10::DeviceIndex>(m.device_index));
}

bool same_device(const capture::TensorMeta& m, const at::Tensor& t) { return t.device() == device_of(m); }

namespace {

// Why op `i`'s replay returned other metadata than the forward: the first input whose sizes, strides or dtype
// differ from what the forward recorded; or, when every input is as recorded, the op's kernel itself.
std::string divergence_cause(const ReplaySource& source, OpIndex i, const std::vector<at::Tensor>& env) {
  const Tape& tape = *source.tape;
  for (const ArgRef& a : tape.op(i).inputs) {
    if (a.meta_only) continue;
    const ReadSource src = classify_read(tape, *source.available, a.value, a.state, a.meta_only);
    const auto v = static_cast<size_t>(a.value);
    const at::Tensor& t = src == ReadSource::kLive ? (*source.live)[v] : env[v];
    if (!t.defined()) continue;
    const capture::TensorMeta& m = tape.value(a.value).meta;
    const bool same = m.sizes.equals(t.sizes()) && static_cast<int16_t>(t.scalar_type()) == m.dtype &&
                      (t.layout() != c10::kStrided || m.strides.equals(t.strides()));
    if (same) continue;
    return ". Its input v" + std::to_string(a.value) + " has sizes " + describe(t.sizes().vec()) + " where the "
           "forward recorded " + describe(m.sizes.vec()) + ": the block's inputs or parameters changed shape between "
           "forward and backward; run the backward before changing them.";
  }
  return ". Its inputs have the sizes, strides and dtypes the forward recorded, so the op's kernel itself returned "
         "other metadata: replay runs inside the backward with grad mode off, where the forward ran it with grad mode "
         "on (some kernels choose their layout or outputs by grad mode, e.g. oneDNN's RNN), or the kernel is not "
         "deterministic in its output layout. Keep this op's outputs (a policy that saves it) or report the model.";
}

// Checks op `i`'s outputs against the tape (the count always, the metadata when `check_metadata`) and stores them
// in `env`. Throws tapesac::Error (kReplayContract) on a divergence.
void store_outputs(const ReplaySource& source, OpIndex i, const std::vector<at::Tensor>& outs, bool check_metadata,
                   bool check_device, std::vector<at::Tensor>& env) {
  const Tape& tape = *source.tape;
  const OpRecord& rec = tape.op(i);
  TAPESAC_CHECK(outs.size() == rec.outputs.size(), kReplayContract, "replay of op ", op_label(tape, i), " returned ",
                outs.size(), " tensors but the forward returned ", rec.outputs.size(),
                ". The op is not deterministic in its outputs; keep its results (policy) or report the model.");
  for (size_t j = 0; j < outs.size(); ++j) {
    const ValueId v = rec.outputs[j];
    if (v < 0) continue;
    const at::Tensor& t = outs[j];
    if (check_metadata) {
      const capture::TensorMeta& m = tape.value(v).meta;
      const bool same = t.defined() && m.sizes.equals(t.sizes()) && static_cast<int16_t>(t.scalar_type()) == m.dtype &&
                        (t.layout() != c10::kStrided || m.strides.equals(t.strides())) && same_layout(m, t);
      TAPESAC_CHECK(same, kReplayContract, "replay of op ", op_label(tape, i), " output ", j,
                    " diverged from the forward: expected sizes ", describe(m.sizes.vec()), " strides ",
                    describe(m.strides.vec()), " dtype ", m.dtype, ", got ",
                    t.defined() ? describe(t.sizes().vec()) + " strides " + describe(t.strides().vec()) + " dtype " +
                                      std::to_string(static_cast<int>(t.scalar_type())) + " layout " +
                                      c10::str(t.layout())
                                : std::string("an undefined tensor"),
                    divergence_cause(source, i, env));
      TAPESAC_CHECK(!check_device || same_device(m, t), kReplayContract, "replay of op ", op_label(tape, i),
                    " output ", j, " diverged from the forward: the forward had it on ", device_of(m).str(),
                    ", the replay made it on ", t.device().str(),
                    " (an op whose output device depends on how it runs; keep its results with the policy).");
    }
    env[static_cast<size_t>(v)] = t;
  }
}

// After the op at position k of the closure: frees the inputs it was the last reader of and the outputs nobody in
// the closure reads, targets excepted.
void release_dead(const OpRecord& rec, size_t k, const std::vector<int32_t>& last_use,
                  const std::vector<uint8_t>& is_target, std::vector<at::Tensor>& env) {
  for (const ArgRef& a : rec.inputs) {
    const auto v = static_cast<size_t>(a.value);
    if (last_use[v] == static_cast<int32_t>(k) && !is_target[v]) env[v].reset();
  }
  for (ValueId v : rec.outputs) {
    if (v >= 0 && last_use[static_cast<size_t>(v)] < 0 && !is_target[static_cast<size_t>(v)]) {
      env[static_cast<size_t>(v)].reset();  // an output nobody in the closure reads
    }
  }
}

/// Runs `ops` in order over `env` (indexed by ValueId). `last_use`/`is_target` (may be null: keep everything) let it
/// free each intermediate after its last reader. Hot path (runs per replayed op): per op it allocates the boxed stack
/// (and fresh lists for list arguments that hold tensors); its scratch vectors are reused across ops.
void execute(const ReplaySource& source, const std::vector<OpIndex>& ops, const std::vector<int32_t>* last_use,
             const std::vector<uint8_t>* is_target, const ReplayOptions& options, std::vector<at::Tensor>& env,
             ReplayStats* stats) {
  const Tape& tape = *source.tape;
  const auto& payloads = *source.payloads;
  GeneratorRestorer restorer;
  // The tape holds the ops autocast produced (casts included): replay runs exactly those, whatever autocast state or
  // functorch layer the backward runs under (Note [Replay outside the backward's transforms]).
  ReplayDispatchGuard guard;
  std::vector<at::Tensor> outs;
  std::vector<c10::IValue> observed_args;
  std::vector<uint8_t> list_copied;

  for (size_t k = 0; k < ops.size(); ++k) {
    const OpIndex i = ops[k];
    const OpRecord& rec = tape.op(i);
    const OpPayload& payload = payloads.at(static_cast<size_t>(i));
    TAPESAC_INTERNAL_ASSERT(payload.handle.has_value(), "op ", op_label(tape, i), " has no operator handle");

    torch::jit::Stack stack(payload.args.begin(), payload.args.end());
    list_copied.assign(stack.size(), 0);
    fill_inputs(source, i, last_use == nullptr, env, stack, list_copied);
    if (options.set_rng) use_recorded_rng(payload, stack, restorer);
    if (options.observer != nullptr) observed_args.assign(stack.begin(), stack.end());

    if (options.op_override == nullptr || !options.op_override->run(i, stack)) payload.handle->callBoxed(stack);

    outs.clear();
    flatten_outputs(stack, outs);
    store_outputs(source, i, outs, options.check_metadata, options.check_device, env);
    if (options.observer != nullptr) options.observer->after_op(i, observed_args, outs);
    if (last_use != nullptr) release_dead(rec, k, *last_use, *is_target, env);
    if (stats != nullptr) {
      ++stats->ops;
      ++stats->ops_by_kind[rec.kind];
    }
  }
}

}  // namespace

std::unordered_map<ValueId, at::Tensor> replay(const ReplaySource& source, const std::vector<Read>& targets,
                                               const ReplayOptions& options, ReplayStats* stats) {
  const Tape& tape = *source.tape;
  const auto& live = *source.live;
  const auto& available = *source.available;
  const common::Stopwatch clock;

  PruneResult plan = prune(tape, targets, available);
  TAPESAC_CHECK(plan.ok, kReplayContract, "tapesac cannot rebuild a dropped tensor: ", plan.reason,
                ". This tensor should have been kept; please report this with the model that triggers it.");

  const size_t nvalues = tape.values().size();
  std::vector<uint8_t> is_target(nvalues, 0);
  for (const Read& r : targets) is_target[static_cast<size_t>(r.value)] = 1;
  if (options.extra_outputs != nullptr) {
    for (ValueId v : *options.extra_outputs) is_target[static_cast<size_t>(v)] = 1;
  }
  // Position in plan.ops of each value's last read, to free replayed intermediates early.
  std::vector<int32_t> last_use(nvalues, -1);
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    for (const ArgRef& a : tape.op(plan.ops[k]).inputs) last_use[static_cast<size_t>(a.value)] = static_cast<int32_t>(k);
  }

  std::vector<at::Tensor> env(nvalues);
  execute(source, plan.ops, &last_use, &is_target, options, env, stats);

  std::unordered_map<ValueId, at::Tensor> result;
  for (const Read& r : targets) {
    const auto v = static_cast<size_t>(r.value);
    const ReadSource src = classify_read(tape, available, r.value, r.state, false);
    at::Tensor t = src == ReadSource::kLive ? live[v] : env[v];
    TAPESAC_INTERNAL_ASSERT(t.defined(), "replay did not produce target v", r.value);
    result.emplace(r.value, std::move(t));
  }
  if (options.extra_outputs != nullptr) {
    for (ValueId v : *options.extra_outputs) {
      if (env[static_cast<size_t>(v)].defined()) result.emplace(v, env[static_cast<size_t>(v)]);
    }
  }
  if (stats != nullptr) {
    stats->ns += clock.elapsed_ns();
  }
  return result;
}

void flatten_outputs(const torch::jit::Stack& stack, std::vector<at::Tensor>& out) {
  for (const c10::IValue& o : stack) {
    if (o.isTensor()) {
      out.push_back(o.toTensor());
    } else if (o.isTensorList()) {
      for (const at::Tensor& t : o.toTensorList().vec()) out.push_back(t);
    } else if (o.isList()) {
      for (const c10::IValue& e : o.toListRef()) {
        if (e.isTensor()) out.push_back(e.toTensor());
        else if (e.isNone()) out.emplace_back();
      }
    }
  }
}

GeneratorRestorer::~GeneratorRestorer() {
  for (auto& [impl, e] : saved_) {
    std::lock_guard<std::mutex> lock(e.first.mutex());
    impl->set_state(*e.second);
  }
}

void GeneratorRestorer::remember(at::Generator gen) {
  c10::GeneratorImpl* impl = gen.unsafeGetGeneratorImpl();
  if (saved_.count(impl)) return;
  std::lock_guard<std::mutex> lock(gen.mutex());
  saved_.emplace(impl, std::make_pair(gen, impl->get_state()));
}

void use_recorded_rng(const capture::OpPayload& payload, torch::jit::Stack& stack, GeneratorRestorer& restorer) {
  if (!payload.generator.has_value()) return;
  at::Generator gen = *payload.generator;  // shares the impl; mutex() is non-const
  const auto garg = static_cast<size_t>(payload.generator_arg);
  if (payload.generator_arg >= 0 && garg < stack.size()) {
    // A private generator at the recorded state: the shared one (other threads may be drawing from it) is neither
    // read nor advanced.
    at::Generator priv;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      priv = gen.clone();
    }
    priv.unsafeGetGeneratorImpl()->set_state(*payload.generator_state);
    stack[garg] = c10::IValue(priv);
    return;
  }
  // No generator argument (e.g. native_dropout draws from the device's default generator): set the shared
  // generator's state for the call; the restorer puts it back. A thread drawing from the same generator at the same
  // moment would see the recorded state (see README, limits).
  restorer.remember(gen);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.unsafeGetGeneratorImpl()->set_state(*payload.generator_state);
}

std::vector<at::Tensor> run_ops(const ReplaySource& source, const std::vector<OpIndex>& ops,
                                const ReplayOptions& options) {
  std::vector<at::Tensor> env(source.tape->values().size());
  execute(source, ops, nullptr, nullptr, options, env, nullptr);
  return env;
}

}  // namespace tapesac::replay
