// The replay contract (see contract.h).
#include "tapesac/replay/contract.h"

#include <sstream>
#include <unordered_set>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/errors.h"
#include "tapesac/common/fnv.h"

namespace tapesac::replay {
namespace {

using capture::storage_key;

std::string op_label(const Tape& tape, capture::OpIndex i) {
  std::string s = "op #";  // built by appending: `"literal" + std::string&&` trips GCC 12's -Wrestrict
  s += std::to_string(i);
  s += " ";
  s += capture::op_kind_name(tape.op(i).kind);
  return s;
}

std::string value_label(ValueId v) {
  std::string s = "v";
  s += std::to_string(v);
  return s;
}

void append(std::string& to, const std::string& what) {
  if (!to.empty()) to += "; ";
  to += what;
}

}  // namespace

uint64_t byte_checksum(const at::Tensor& t) {
  at::Tensor c = t.is_cpu() ? t.contiguous() : t.to(c10::kCPU).contiguous();
  common::Fnv64 h;
  h.mix_raw(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  return h.value();
}

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << " " << t.sizes();
  return os.str();
}

void ReplayContract::check_saved(const c10::VariableVersion& version, uint32_t saved_version, int32_t slot,
                                 ValueId value) const {
  if (!options_.check_versions || !version.enabled()) return;
  const uint32_t now = version.current_version();
  if (now == saved_version) return;
  std::ostringstream msg;
  msg << "tapesac: tensor #" << slot << " saved for backward in block '" << block_
      << "' was modified by an in-place operation after the forward (its version went from " << saved_version
      << " to " << now
      << "); its gradient would be wrong. Do not modify tensors the backward needs before calling backward (use an "
         "out-of-place op, or .clone() before the in-place op).";
  sink_->record(value, "rejected", 0, 0, msg.str());
  throw Error(ErrorKind::kReplayContract, msg.str());
}

void ReplayContract::watch_live(const std::vector<at::Tensor>& live,
                                std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> origins) {
  origins_ = std::move(origins);
  versions_.assign(live.size(), 0);
  marks_.assign(live.size(), 0);
  for (size_t v = 0; v < live.size(); ++v) {
    if (!live[v].defined() || live[v].is_inference()) continue;
    versions_[v] = live[v].unsafeGetTensorImpl()->version_counter().current_version();
    if (watcher_ && options_.check_versions) marks_[v] = watcher_->watch(live[v]);
  }
}

ResolvedLive ReplayContract::resolve_live(const Tape& tape, const std::vector<uint8_t>& available,
                                          const PruneResult& plan, const std::vector<at::Tensor>& live,
                                          ValueId wanted) const {
  ResolvedLive out;
  if (!options_.check_versions) return out;
  std::unordered_set<const void*> swapped;  // storages whose regions are already swapped back for this replay
  for (capture::OpIndex i : plan.ops) {
    for (const capture::ArgRef& a : tape.op(i).inputs) {
      const auto v = static_cast<size_t>(a.value);
      if (v >= live.size() || !live[v].defined() || live[v].is_inference() || out.subs.count(a.value)) continue;
      if (classify_read(tape, available, a.value, a.state, a.meta_only) != ReadSource::kLive) continue;
      bool storage_replaced = false;
      if (v < origins_.size()) {
        const std::string replaced = replaced_storage(origins_[v], live[v]);
        storage_replaced = !replaced.empty();
        if (storage_replaced && out.recovered.find(replaced) == std::string::npos) {
          append(out.recovered, value_label(a.value) + " (input of " + op_label(tape, i) + "): " + replaced);
        }
      }
      uint32_t now = live[v].unsafeGetTensorImpl()->version_counter().current_version();
      // Writes the watcher saw that bypassed the version counter (through `.data` or another detached alias).
      std::string unfilled;
      const int64_t seen = watcher_ ? watcher_->writes_since(live[v], marks_[v], &unfilled) : 0;
      if (!unfilled.empty()) reject_unfilled(tape, i, live[v], a.value, wanted, unfilled);
      // Note [A replaced storage's version]. The version counter belongs to the tensor, and follows it to the
      // storage `.data = ...` or set_ gave it: every set_ and every write to the new storage moves it, none touches
      // the bytes the replay reads (the forward's storage, held in `live`). There, only the writes the watcher saw
      // to that storage count: two set_ calls (or set_ then a write to the new storage) were rejected as "version
      // moved by 2 but the step's thread made only 1 in-place writes" (found by an adversarial test).
      if (storage_replaced) now = versions_[v] + static_cast<uint32_t>(seen);
      if (now == versions_[v] && seen == 0) continue;
      if (swapped.count(storage_key(live[v]))) continue;
      if (recover(tape, i, a.value, live[v], now, out, wanted)) swapped.insert(storage_key(live[v]));
    }
  }
  return out;
}

void ReplayContract::reject_unfilled(const Tape& tape, capture::OpIndex i, const at::Tensor& t, ValueId v,
                                     ValueId wanted, const std::string& why) const {
  std::ostringstream msg;
  msg << "tapesac: replaying block '" << block_ << "' needs a tensor (" << value_label(v) << ", "
      << describe_tensor(t) << ", input of " << op_label(tape, i) << ") whose bytes are no longer the forward's: "
      << why << ". Give a freed tensor its bytes back before the backward needs them (FSDP2 refills a parameter "
         "before its block's backward), or keep the block's activations for it (e.g. policy=\"none\" for that "
         "block).";
  sink_->record(wanted, "rejected", 0, 0, msg.str());
  throw Error(ErrorKind::kReplayContract, msg.str());
}

bool ReplayContract::recover(const Tape& tape, capture::OpIndex i, ValueId v, const at::Tensor& t, uint32_t now,
                             ResolvedLive& out, ValueId wanted) const {
  const auto idx = static_cast<size_t>(v);
  std::string why = "preserve=\"off\"";
  if (watcher_ && now >= versions_[idx]) {
    WriteWatcher::Restored r = watcher_->restore(t, marks_[idx], now - versions_[idx], &why);
    if (r.copy.defined() || r.swap) {
      append(out.recovered, value_label(v) + " (" + describe_tensor(t) + ", input of " + op_label(tape, i) +
                                ") written " + std::to_string(now - versions_[idx]) +
                                "x after the forward: rebuilt from " + preserve_mode_name(watcher_->mode()));
      if (r.swap) {
        out.swaps.push_back(std::move(r.swap));
        return true;
      }
      out.subs.emplace(v, std::move(r.copy));
      return false;
    }
  }
  std::ostringstream msg;
  msg << "tapesac: replaying block '" << block_ << "' needs a tensor (" << describe_tensor(t) << ", input of "
      << op_label(tape, i) << ") that was ";
  if (now == versions_[idx]) {
    msg << "written after the block's forward without moving its version (through .data, or a refill after "
           "a reallocation)";
  } else {
    msg << "modified in place after the block's forward (version " << versions_[idx] << " -> " << now << ")";
  }
  msg << ", and it cannot be rebuilt as the forward saw it: " << why
      << ". Modify block inputs, parameters and buffers only after backward (e.g. optimizer.step() after "
         "loss.backward()), make the write on the step's thread with preserve=\"regions\" or "
         "\"snapshots\" (the default \"auto\" includes them), or .clone() the tensor before the block reads it.";
  sink_->record(wanted, "rejected", 0, 0, msg.str());
  throw Error(ErrorKind::kReplayContract, msg.str());
}

void ReplayContract::remember_bytes(ValueId v, const at::Tensor& t) {
  if (options_.check_bytes) checksums_[v] = byte_checksum(t);
}

void ReplayContract::verify_bytes(ValueId v, const at::Tensor& t, int64_t replay_ns) const {
  if (!options_.check_bytes) return;
  auto c = checksums_.find(v);
  if (c == checksums_.end() || c->second == byte_checksum(t)) return;
  std::ostringstream msg;
  msg << "tapesac: replay of block '" << block_ << "' diverged: the rebuilt tensor v" << v << " ("
      << describe_tensor(t)
      << ") differs bytewise from the one the forward saved. A kernel in the block is not deterministic "
         "(enable torch.use_deterministic_algorithms(True)) or state it reads changed without a version "
         "bump (a .data write, a write through numpy); keep its outputs with a policy set to avoid "
         "replaying it.";
  const int64_t nbytes = capture::view_bytes(t);
  sink_->record(v, "divergent", nbytes, replay_ns, msg.str());
  throw Error(ErrorKind::kReplayContract, msg.str());
}

std::string ReplayContract::replaced_storage(const c10::weak_intrusive_ptr<c10::TensorImpl>& origin,
                                             const at::Tensor& held) {
  if (!held.defined() || !held.has_storage()) return {};
  c10::intrusive_ptr<c10::TensorImpl> now = origin.lock();
  if (!now || !now->has_storage()) return {};
  if (now->storage().unsafeGetStorageImpl() == held.storage().unsafeGetStorageImpl()) return {};
  return "its tensor's storage was replaced after the forward (`.data = ...` or set_); the replay read the bytes "
         "the forward used, as the activations a run without tapesac saves were computed from them";
}

}  // namespace tapesac::replay
