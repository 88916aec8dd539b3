// The keep/drop decision (see decide.h, Note [Keep or drop]).
#include "tapesac/replay/decide.h"

#include <algorithm>

#include "tapesac/common/fnv.h"

namespace tapesac::replay {
namespace {

using capture::kExternal;

// Pass 1: values nobody decides on (recording failed, external) are kept; the rest are the decidable values.
void split_decidable(const DecisionInput& in, KeepDecision& d) {
  const Tape& tape = *in.tape;
  for (const SavedValue& s : in.saved) {
    const auto v = static_cast<size_t>(s.value);
    d.state[v] = s.state;  // a value saved twice is decided at its last save's state
    if (d.keep[v] >= 0) continue;
    const capture::ValueInfo& info = tape.value(s.value);
    if (in.capture_failed || info.producer == kExternal || tape.storage(info.storage).external) {
      d.keep[v] = 1;
      d.available[v] = 1;
    } else {
      d.keep[v] = 2;  // undecided
      d.decidable.push_back(s.value);
    }
  }
  std::sort(d.decidable.begin(), d.decidable.end());
}

// Note [Written after its save]. A saved value whose storage the block writes after the save: autograd's saved tensor
// is that storage, so a backward without tapesac reads the bytes of the *last* write, not the ones at the save. A
// write autograd saw moved the saved tensor's version (its backward raises, with or without tapesac); one it did not
// (`t.data.add_(1)`, an in-place op on a `.data` or `set_` alias) is read. A replay rebuilds the bytes at the save:
// wrong gradients, silent under contract "check" (an independent fuzzer, policy full). Such a value is kept: served,
// it is the storage autograd would read.
// A value saved twice, before and after such a write, is kept too: both saves are that storage (a value is decided at
// its last save's state, whose bytes a one-segment replay served to both; a lazy schedule rebuilt the first save's
// state for the first: random program 265).
std::vector<uint8_t> written_after_save(const DecisionInput& in, size_t n) {
  std::vector<uint8_t> out(n, 0);
  for (const SavedValue& s : in.saved) {
    if (s.state < in.tape->storage(in.tape->value(s.value).storage).final_state()) {
      out[static_cast<size_t>(s.value)] = 1;
    }
  }
  return out;
}

// Step 1 of the Note: values that cannot be rebuilt are kept, in tape order.
void find_must_keep(const DecisionInput& in, KeepDecision& d, RebuildCheck& rebuildable) {
  d.must_keep.assign(d.decidable.size(), 0);
  if (in.policy == PolicyKind::kNone && !in.observed) return;
  std::vector<uint8_t> tainted;
  if (!in.kept_externals.empty()) tainted = propagate_taint(*in.tape, in.kept_externals);
  const std::vector<uint8_t> written = written_after_save(in, d.keep.size());
  for (size_t i = 0; i < d.decidable.size(); ++i) {
    const ValueId v = d.decidable[i];
    const bool reads_kept_storage = !tainted.empty() && tainted[static_cast<size_t>(v)];
    if (!reads_kept_storage && !written[static_cast<size_t>(v)] &&
        rebuildable.ok(Read{v, d.state[static_cast<size_t>(v)]})) {
      continue;
    }
    d.must_keep[i] = 1;
    d.available[static_cast<size_t>(v)] = 1;
  }
}

bool policy_keeps(const DecisionInput& in, KeepDecision& d, size_t i, bool plan_applies) {
  const ValueId v = d.decidable[i];
  switch (in.policy) {
    case PolicyKind::kNone:
      return true;
    case PolicyKind::kFull:
      return false;
    case PolicyKind::kPlan:
      return plan_applies && in.plan->keep[i] != 0;  // no matching plan: run as "full" (the planner re-plans)
    case PolicyKind::kSaveOps:
      try {
        const capture::OpIndex p = in.tape->bytes_writer(v, d.state[static_cast<size_t>(v)]);
        return p >= 0 && in.keep_op && in.keep_op(in.tape->op(p).kind);
      } catch (const std::exception& e) {
        if (!d.policy_failed) d.policy_error = e.what();
        d.policy_failed = true;  // the policy callable raised: keep, and say so in the stats
        return true;
      } catch (...) {
        d.policy_failed = true;
        return true;
      }
  }
  return true;
}

}  // namespace

std::vector<uint8_t> KeepDecision::kept_mask() const {
  std::vector<uint8_t> kept(decidable.size(), 0);
  for (size_t i = 0; i < decidable.size(); ++i) kept[i] = keep[static_cast<size_t>(decidable[i])] == 1 ? 1 : 0;
  return kept;
}

void KeepDecision::force_keep(ValueId v) {
  keep[static_cast<size_t>(v)] = 1;
  available[static_cast<size_t>(v)] = 1;
}

KeepDecision decide_keep(const DecisionInput& in) {
  const Tape& tape = *in.tape;
  const size_t n = tape.values().size();
  KeepDecision d;
  d.keep.assign(n, -1);
  d.available.assign(n, 0);
  d.state.assign(n, 0);
  split_decidable(in, d);
  RebuildCheck rebuildable(tape, d.available);  // d.available only grows from here on
  find_must_keep(in, d, rebuildable);
  if (in.want_signature || in.policy == PolicyKind::kPlan) d.signature = tape_signature(tape, d.decidable);
  const bool plan_applies = in.policy == PolicyKind::kPlan && in.plan != nullptr &&
                            in.plan->signature == d.signature && in.plan->keep.size() == d.decidable.size();
  d.planned = plan_applies;
  // Step 2: the policy.
  std::vector<ValueId> dropped;
  for (size_t i = 0; i < d.decidable.size(); ++i) {
    const ValueId v = d.decidable[i];
    const bool keep = d.must_keep[i] != 0 || policy_keeps(in, d, i, plan_applies);
    d.keep[static_cast<size_t>(v)] = keep ? 1 : 0;
    if (keep) {
      d.available[static_cast<size_t>(v)] = 1;
    } else {
      dropped.push_back(v);
    }
  }
  // Step 3: a dropped value the kept ones cannot rebuild is kept after all.
  for (ValueId v : dropped) {
    if (!rebuildable.ok(Read{v, d.state[static_cast<size_t>(v)]})) d.force_keep(v);
  }
  return d;
}

std::vector<uint8_t> propagate_taint(const Tape& tape, std::vector<uint8_t> tainted) {
  tainted.resize(tape.values().size(), 0);
  for (const capture::OpRecord& op : tape.ops()) {
    bool in = false;
    for (const capture::ArgRef& a : op.inputs) in = in || tainted[static_cast<size_t>(a.value)];
    if (!in) continue;
    for (ValueId o : op.outputs) {
      if (o >= 0) tainted[static_cast<size_t>(o)] = 1;
    }
  }
  return tainted;
}

void decision_key(const DecisionInput& in, std::vector<int64_t>& key) {
  // Note [Decisions reused]. Each variable-length part is preceded by its length, so two different inputs never
  // flatten to the same words.
  const Tape& tape = *in.tape;
  key.clear();
  key.reserve(16 + 12 * tape.ops().size() + 12 * tape.values().size() + 2 * in.saved.size());
  auto put = [&key](int64_t x) { key.push_back(x); };
  put(static_cast<int64_t>(in.policy));
  put((in.capture_failed ? 1 : 0) | (in.observed ? 2 : 0) | (in.want_signature ? 4 : 0) |
      (in.plan != nullptr ? 8 : 0) | (in.keep_op ? 16 : 0));
  if (in.plan != nullptr) {
    put(static_cast<int64_t>(in.plan->signature));
    put(static_cast<int64_t>(in.plan->keep.size()));
    for (uint8_t k : in.plan->keep) put(k);
  }
  put(static_cast<int64_t>(in.kept_externals.size()));
  for (size_t v = 0; v < in.kept_externals.size(); ++v) {
    if (in.kept_externals[v] != 0) put(static_cast<int64_t>(v));
  }
  put(-1);
  put(static_cast<int64_t>(in.saved.size()));
  for (const SavedValue& s : in.saved) {
    put(s.value);
    put(s.state);
  }
  put(static_cast<int64_t>(tape.ops().size()));
  for (const capture::OpRecord& op : tape.ops()) {
    put(op.kind);
    put(op.flags);
    put(static_cast<int64_t>(op.inputs.size()));
    for (const capture::ArgRef& a : op.inputs) {
      put(a.value);
      put(a.state);
      put((static_cast<int64_t>(a.arg) << 32) | (static_cast<int64_t>(static_cast<uint16_t>(a.elem)) << 16) |
          (a.meta_only ? 1 : 0) | (a.overwritten ? 2 : 0));
    }
    put(static_cast<int64_t>(op.outputs.size()));
    for (ValueId v : op.outputs) put(v);
    put(static_cast<int64_t>(op.writes.size()));
    for (capture::StorageId st : op.writes) put(st);
  }
  put(static_cast<int64_t>(tape.values().size()));
  for (const capture::ValueInfo& v : tape.values()) {
    put(v.storage);
    put(v.producer);
    put(v.state);
    const capture::TensorMeta& m = v.meta;
    put(m.nbytes);
    put(m.storage_offset);
    put((static_cast<int64_t>(m.dtype) << 32) | (static_cast<int64_t>(m.device_type) << 16) |
        static_cast<int64_t>(static_cast<uint16_t>(m.device_index)));
    put(static_cast<int64_t>(m.sizes.size()));
    for (int64_t d : m.sizes) put(d);
    put(static_cast<int64_t>(m.strides.size()));
    for (int64_t d : m.strides) put(d);
  }
  put(static_cast<int64_t>(tape.storages().size()));
  for (const capture::StorageInfo& st : tape.storages()) {
    put(st.external ? 1 : 0);
    put(st.nbytes);
  }
}

uint64_t tape_signature(const Tape& tape, const std::vector<ValueId>& candidates) {
  // FNV-1a over the structure; sizes included, durations and addresses not.
  common::Fnv64 fnv;
  fnv.mix(tape.ops().size());
  fnv.mix(tape.values().size());
  for (const capture::OpRecord& op : tape.ops()) {
    fnv.mix(static_cast<uint64_t>(op.kind));
    fnv.mix(op.flags);
    for (const capture::ArgRef& a : op.inputs) {
      fnv.mix(static_cast<uint64_t>(a.value));
      fnv.mix(static_cast<uint64_t>(a.state));
    }
    for (ValueId v : op.outputs) fnv.mix(static_cast<uint64_t>(v));
  }
  for (const capture::ValueInfo& v : tape.values()) {
    fnv.mix(static_cast<uint64_t>(v.storage));
    fnv.mix(static_cast<uint64_t>(v.meta.nbytes));
  }
  for (const capture::StorageInfo& st : tape.storages()) fnv.mix(static_cast<uint64_t>(st.nbytes));
  fnv.mix(candidates.size());
  for (ValueId v : candidates) fnv.mix(static_cast<uint64_t>(v));
  return fnv.value();
}

std::string plan_key(const std::string& name, int32_t occurrence) {
  return occurrence <= 0 ? name : name + "#" + std::to_string(occurrence + 1);
}

}  // namespace tapesac::replay
