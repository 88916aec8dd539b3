// The pruning pass (see prune.h and Note [Live reads]).
#include "tapesac/replay/prune.h"

#include <algorithm>

#include "tapesac/capture/op_kinds.h"

namespace tapesac::replay {
namespace {

using capture::kExternal;
using capture::OpFlag;
using capture::OpRecord;
using capture::StorageId;

bool is_available(const Tape& tape, const std::vector<uint8_t>& available, ValueId v) {
  if (tape.value(v).producer == kExternal) return true;
  return static_cast<size_t>(v) < available.size() && available[static_cast<size_t>(v)] != 0;
}

std::string op_name(const Tape& tape, OpIndex i) {
  const OpRecord& op = tape.op(i);
  return op.kind >= 0 ? capture::op_kind_name(op.kind) : std::string("op");
}

class Pruner {
 public:
  Pruner(const Tape& tape, const std::vector<uint8_t>& available)
      : tape_(tape),
        available_(available),
        needed_(tape.ops().size(), 0),
        marked_upto_(tape.storages().size(), 0),
        path_live_(tape.values().size(), -1) {}

  PruneResult run(const std::vector<Read>& targets) {
    for (const Read& r : targets) {
      read(r.value, r.state, /*content_free=*/false, /*reader=*/-1, /*bytes_read=*/true);
      drain();
      if (!result_.ok) return std::move(result_);
    }
    for (size_t i = 0; i < needed_.size(); ++i) {
      if (needed_[i]) result_.ops.push_back(static_cast<OpIndex>(i));
    }
    return std::move(result_);
  }

  // One read for RebuildCheck: on success the ops it needed are marked in `verified` (Note [Rebuildable closures
  // stay rebuildable]) and skipped by later reads; the per-read marks are cleared for the next one.
  bool check(const Read& r, std::vector<uint8_t>& verified) {
    verified_ = &verified;
    read(r.value, r.state, /*content_free=*/false, /*reader=*/-1, /*bytes_read=*/true);
    drain();
    const bool ok = result_.ok;
    walked_ += static_cast<int64_t>(touched_ops_.size());
    for (OpIndex i : touched_ops_) {
      if (ok) verified[static_cast<size_t>(i)] = 1;
      needed_[static_cast<size_t>(i)] = 0;
    }
    for (StorageId st : touched_storages_) marked_upto_[static_cast<size_t>(st)] = 0;
    for (ValueId v : touched_values_) path_live_[static_cast<size_t>(v)] = -1;
    touched_ops_.clear();
    touched_storages_.clear();
    touched_values_.clear();
    pending_.clear();
    result_ = PruneResult();
    return ok;
  }

  int64_t walked() const { return walked_; }

 private:
  void fail(OpIndex op, ValueId v, std::string why) {
    if (!result_.ok) return;
    result_.ok = false;
    result_.blocking_op = op;
    result_.blocking_value = v;
    result_.reason = std::move(why);
  }

  void need(OpIndex i) {
    if (i < 0 || needed_[static_cast<size_t>(i)]) return;
    if (verified_ != nullptr && (*verified_)[static_cast<size_t>(i)] != 0) return;
    const OpRecord& op = tape_.op(i);
    if (op.has(capture::kWritesExternal)) {
      fail(i, -1, "op #" + std::to_string(i) + " (" + op_name(tape_, i) +
                      ") writes a tensor the block did not create; replay never re-applies such a write");
      return;
    }
    if (op.has(capture::kNonReplayable)) {
      fail(i, -1, "op #" + std::to_string(i) + " (" + op_name(tape_, i) + ") cannot be replayed");
      return;
    }
    needed_[static_cast<size_t>(i)] = 1;
    touched_ops_.push_back(i);
    pending_.push_back(i);
  }

  // True when v's final bytes are reachable from live values through view ops alone.
  bool path_live(ValueId v) {
    int8_t& memo = path_live_[static_cast<size_t>(v)];
    if (memo >= 0) return memo != 0;
    memo = 0;  // cycles are impossible (producers precede), but be safe
    touched_values_.push_back(v);
    const OpIndex p = tape_.value(v).producer;
    bool ok = false;
    if (p != kExternal && tape_.op(p).has(capture::kView)) {
      ok = true;
      for (const capture::ArgRef& a : tape_.op(p).inputs) {
        const ReadSource src = classify_read(tape_, available_, a.value, a.state, a.meta_only);
        if (src == ReadSource::kLive) continue;
        if (src == ReadSource::kFail || !path_live(a.value)) {
          ok = false;
          break;
        }
      }
    }
    memo = ok ? 1 : 0;
    return ok;
  }

  // bytes_read: the reader uses the bytes (false for an argument it overwrites whole, ArgRef::overwritten).
  void read(ValueId v, int32_t state, bool content_free, OpIndex reader, bool bytes_read) {
    const ReadSource src = classify_read(tape_, available_, v, state, content_free);
    if (src == ReadSource::kLive) return;
    if (src == ReadSource::kFail) {
      fail(reader, v,
           "value v" + std::to_string(v) + " is read at an earlier state of a tensor the block did not create" +
               (reader >= 0 ? " (by op #" + std::to_string(reader) + " " + op_name(tape_, reader) + ")" : ""));
      return;
    }
    const capture::ValueInfo& info = tape_.value(v);
    need(info.producer);
    if (content_free) return;
    const capture::StorageInfo& s = tape_.storage(info.storage);
    if (s.external) return;  // classify_read guarantees the final state: the live storage holds it
    if (state == s.final_state() && path_live(v)) return;
    if (bytes_read && info.meta.nbytes > 0) {
      const OpIndex last = tape_.bytes_writer(v, state);
      if (last >= 0 && tape_.op(last).has(capture::kUninitialized)) {
        fail(reader, v,
             "value v" + std::to_string(v) + " is read" +
                 (reader >= 0 ? " by op #" + std::to_string(reader) + " " + op_name(tape_, reader) : std::string()) +
                 " with bytes no recorded op wrote (op #" + std::to_string(last) + " " + op_name(tape_, last) +
                 " left them uninitialised; a kernel outside the dispatcher filled them)");
        return;
      }
    }
    int32_t& upto = marked_upto_[static_cast<size_t>(info.storage)];
    if (upto == 0 && state > 0) touched_storages_.push_back(info.storage);
    for (int32_t k = upto; k < state; ++k) need(s.writers[static_cast<size_t>(k)]);
    upto = std::max(upto, state);
  }

  void drain() {
    while (!pending_.empty() && result_.ok) {
      const OpIndex i = pending_.back();
      pending_.pop_back();
      const OpRecord& op = tape_.op(i);
      for (const capture::ArgRef& a : op.inputs) read(a.value, a.state, a.meta_only, i, !a.overwritten);
    }
  }

  const Tape& tape_;
  const std::vector<uint8_t>& available_;
  std::vector<uint8_t> needed_;
  std::vector<int32_t> marked_upto_;
  std::vector<int8_t> path_live_;
  std::vector<OpIndex> pending_;
  PruneResult result_;
  std::vector<uint8_t>* verified_ = nullptr;  // RebuildCheck's, when checking
  std::vector<OpIndex> touched_ops_;
  std::vector<StorageId> touched_storages_;
  std::vector<ValueId> touched_values_;
  int64_t walked_ = 0;
};

}  // namespace

ReadSource classify_read(const Tape& tape, const std::vector<uint8_t>& available, ValueId value, int32_t state,
                         bool content_free) {
  const capture::ValueInfo& info = tape.value(value);
  const capture::StorageInfo& s = tape.storage(info.storage);
  const bool at_final = state == s.final_state();
  if (is_available(tape, available, value) && (at_final || (content_free && info.producer == kExternal))) {
    return ReadSource::kLive;
  }
  if (info.producer == kExternal) return ReadSource::kFail;
  if (s.external && !at_final && !content_free) return ReadSource::kFail;
  return ReadSource::kReplay;
}

PruneResult prune(const Tape& tape, const std::vector<Read>& targets, const std::vector<uint8_t>& available) {
  return Pruner(tape, available).run(targets);
}

struct RebuildCheck::State {
  State(const Tape& tape, const std::vector<uint8_t>& available)
      : pruner(tape, available), verified(tape.ops().size(), 0) {}
  Pruner pruner;
  std::vector<uint8_t> verified;  // per op: its whole closure was rebuildable
};

RebuildCheck::RebuildCheck(const Tape& tape, const std::vector<uint8_t>& available)
    : state_(std::make_unique<State>(tape, available)) {}

RebuildCheck::~RebuildCheck() = default;

bool RebuildCheck::ok(Read r) { return state_->pruner.check(r, state_->verified); }

int64_t RebuildCheck::ops_walked() const { return state_->pruner.walked(); }

}  // namespace tapesac::replay
