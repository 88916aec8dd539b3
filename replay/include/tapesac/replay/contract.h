// The replay contract of one block call: what must still hold when backward unpacks a saved tensor or replay reads a
// live one, checked against what the forward saw.
//  * Saved tensors: their version counter must not have moved since they were saved (an in-place write after the
//    forward would make the gradient wrong): rejected.
//  * Live tensors a replay reads (block inputs, parameters, buffers, kept values): a version move or a write the
//    WriteWatcher saw (also through `.data`) is recovered from the watcher's saved bytes when it can be (a snapshot
//    view to read instead, or regions swapped back while the replay runs), else rejected. A storage replaced
//    (`.data = ...`, set_) is served with the bytes the forward used, and said so.
//  * contract "strict": each dropped tensor's bytes are checksummed at the forward and compared after replay:
//    divergent.
// Every outcome other than a plain match is written to the step's execution records (RecordSink) before an error is
// thrown. Used under the owning BlockCall's lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tapesac/capture/tape.h"
#include "tapesac/replay/preserve.h"
#include "tapesac/replay/prune.h"

namespace tapesac::replay {

/// Where contract outcomes go (the block call's execution records).
class RecordSink {
 public:
  virtual ~RecordSink() = default;
  virtual void record(ValueId v, const std::string& status, int64_t bytes, int64_t ns, std::string detail) const = 0;
};

/// The live tensors a replay reads, made to read as the forward saw them (ReplayContract::resolve_live).
struct ResolvedLive {
  /// Tensors to read instead of the live ones (snapshot views), by value id.
  std::unordered_map<ValueId, at::Tensor> subs;
  /// Regions swapped back to the forward's bytes until destroyed: destroy after the replay.
  std::vector<std::unique_ptr<WriteWatcher::Swap>> swaps;
  /// What was recovered ("" when nothing), for the records.
  std::string recovered;
};

struct ContractOptions {
  bool check_versions = true;
  bool check_bytes = false;
};

class ReplayContract {
 public:
  ReplayContract(std::string block, ContractOptions options, std::shared_ptr<WriteWatcher> watcher,
                 const RecordSink* sink)
      : block_(std::move(block)), options_(options), watcher_(std::move(watcher)), sink_(sink) {}

  /// Throws ReplayContractError (after a "rejected" record for `value`) when saved tensor #`slot`'s version moved
  /// from `saved_version`.
  void check_saved(const c10::VariableVersion& version, uint32_t saved_version, int32_t slot, ValueId value) const;

  /// Remembers the version (and the watcher's mark) of every live tensor replay may read; `origins` are the tensors
  /// the forward read (weak), to notice a replaced storage. Called once, when the forward closes.
  void watch_live(const std::vector<at::Tensor>& live, std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> origins);

  /// Makes every live tensor that the ops of `plan` read see the forward's bytes, or throws ReplayContractError
  /// (after a "rejected" record for `wanted`).
  ResolvedLive resolve_live(const Tape& tape, const std::vector<uint8_t>& available, const PruneResult& plan,
                            const std::vector<at::Tensor>& live, ValueId wanted) const;

  /// contract "strict": remembers the checksum of dropped value `v`'s bytes.
  void remember_bytes(ValueId v, const at::Tensor& t);
  /// contract "strict": throws ReplayContractError (after a "divergent" record) when the rebuilt `t` differs.
  void verify_bytes(ValueId v, const at::Tensor& t, int64_t replay_ns) const;

  /// Why the tensor autograd saved (`origin`) no longer shows the bytes tapesac holds (`held`), or "".
  static std::string replaced_storage(const c10::weak_intrusive_ptr<c10::TensorImpl>& origin, const at::Tensor& held);

  void clear() noexcept {
    versions_.clear();
    marks_.clear();
    origins_.clear();
  }

 private:
  /// Recovers the live value `v` (input of op `i`) from the watcher, or throws; true when its storage's regions were
  /// swapped back (the storage's other values then read the forward's bytes too).
  bool recover(const Tape& tape, capture::OpIndex i, ValueId v, const at::Tensor& t, uint32_t now,
               ResolvedLive& out, ValueId wanted) const;
  /// Throws ReplayContractError: live value `v` (input of op `i`) sits on a storage emptied or reallocated since the
  /// forward and not all written again (`why`, from WriteWatcher::writes_since).
  [[noreturn]] void reject_unfilled(const Tape& tape, capture::OpIndex i, const at::Tensor& t, ValueId v,
                                    ValueId wanted, const std::string& why) const;

  std::string block_;
  ContractOptions options_;
  std::shared_ptr<WriteWatcher> watcher_;
  const RecordSink* sink_;
  std::vector<uint32_t> versions_;
  std::vector<int64_t> marks_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> origins_;
  std::unordered_map<ValueId, uint64_t> checksums_;
};

/// FNV-1a over the tensor's bytes in logical (contiguous) order; CUDA tensors are copied to the host first.
uint64_t byte_checksum(const at::Tensor& t);

/// "float [2, 3]": dtype and sizes, for messages.
std::string describe_tensor(const at::Tensor& t);

}  // namespace tapesac::replay
