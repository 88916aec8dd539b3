// TapeBuilder: hand-made tapes for the replay gtests, filled exactly the way capture::Recorder does: an op's outputs
// are created with add_output_value() before add_op(); a new storage is in op.writes and its value is at state 1; an
// in-place or out= op lists the storage it writes in op.writes and its output is a new value at the previous state
// + 1; every ArgRef carries the state of its storage at the read; a view op writes nothing, is flagged kView and
// reads the inputs it aliases meta_only.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/prune.h"

namespace tapesac::replay {

using capture::ArgRef;
using capture::OpRecord;
using capture::StorageId;
using capture::TensorMeta;
using capture::kView;
using capture::kWritesExternal;

inline constexpr int64_t kBytes = 64;

inline TensorMeta meta_of_bytes(int64_t nbytes) {
  TensorMeta m;
  m.sizes = {nbytes / 4};
  m.strides = {1};
  m.dtype = 6;  // float
  m.nbytes = nbytes;
  return m;
}

class TapeBuilder {
 public:
  Tape tape;

  /// A block input / parameter: an external value on a new external storage.
  ValueId ext(int64_t nbytes = kBytes) {
    const StorageId s = tape.add_storage(/*external=*/true, nbytes);
    return tape.add_external_value(s, meta_of_bytes(nbytes));
  }

  /// A functional op: reads `reads` at their storages' current states, returns `n_outputs` values on new storages.
  std::vector<ValueId> multi(const std::string& name, const std::vector<ValueId>& reads, int n_outputs,
                             uint32_t flags = 0) {
    OpRecord rec = record(name, reads, flags);
    for (int i = 0; i < n_outputs; ++i) {
      const StorageId s = tape.add_storage(/*external=*/false, kBytes);
      rec.writes.push_back(s);
      rec.outputs.push_back(tape.add_output_value(s, /*state=*/1, meta_of_bytes(kBytes)));
    }
    tape.add_op(std::move(rec));
    return tape.op(last_op()).outputs;
  }

  ValueId op(const std::string& name, const std::vector<ValueId>& reads, uint32_t flags = 0) {
    return multi(name, reads, 1, flags).front();
  }

  /// An in-place op (`target.add_(others...)`): writes target's storage (kWritesExternal when it is external, as
  /// the recorder sets it) and returns the new value of that storage at the next state.
  ValueId inplace(const std::string& name, ValueId target, const std::vector<ValueId>& others, uint32_t flags = 0) {
    std::vector<ValueId> reads{target};
    reads.insert(reads.end(), others.begin(), others.end());
    return write_into(name, reads, target, flags);
  }

  /// An out= op (`mul(a, b, out=dst)`): reads `reads`, then `dst` as its last argument, and writes dst's storage.
  ValueId out_variant(const std::string& name, const std::vector<ValueId>& reads, ValueId dst) {
    std::vector<ValueId> all = reads;
    all.push_back(dst);
    return write_into(name, all, dst, 0);
  }

  /// A view op with `n` outputs aliasing `base` (split, unbind, ...).
  std::vector<ValueId> views(const std::string& name, ValueId base, int n) {
    OpRecord rec = record(name, {base}, kView);
    rec.inputs[0].meta_only = true;
    const StorageId s = storage(base);
    for (int i = 0; i < n; ++i)
      rec.outputs.push_back(tape.add_output_value(s, tape.state_of(s), tape.value(base).meta));
    tape.add_op(std::move(rec));
    return tape.op(last_op()).outputs;
  }

  ValueId view(const std::string& name, ValueId base) { return views(name, base, 1).front(); }

  /// `v` read now, at its storage's current state (what autograd saves when it saves v at this point).
  Read now(ValueId v) const { return Read{v, tape.state_of(storage(v))}; }
  OpIndex last_op() const { return tape.next_op_index() - 1; }
  OpIndex producer(ValueId v) const { return tape.value(v).producer; }
  StorageId storage(ValueId v) const { return tape.value(v).storage; }

  /// An `available` vector where exactly `kept` are available (externals are live regardless).
  std::vector<uint8_t> keep(std::initializer_list<ValueId> kept) const {
    std::vector<uint8_t> a(tape.values().size(), 0);
    for (ValueId v : kept)
      a.at(static_cast<size_t>(v)) = 1;
    return a;
  }

 private:
  OpRecord record(const std::string& name, const std::vector<ValueId>& reads, uint32_t flags) {
    OpRecord rec;
    rec.kind = capture::intern_op_kind(name);
    rec.flags = flags;
    for (size_t i = 0; i < reads.size(); ++i) {
      ArgRef a;
      a.arg = static_cast<int16_t>(i);
      a.value = reads[i];
      a.state = tape.state_of(storage(reads[i]));
      rec.inputs.push_back(a);
    }
    return rec;
  }

  ValueId write_into(const std::string& name, const std::vector<ValueId>& reads, ValueId target, uint32_t flags) {
    OpRecord rec = record(name, reads, flags);
    const StorageId s = storage(target);
    rec.writes.push_back(s);
    if (tape.storage(s).external)
      rec.flags |= kWritesExternal;
    const ValueId out = tape.add_output_value(s, tape.state_of(s) + 1, tape.value(target).meta);
    rec.outputs.push_back(out);
    tape.add_op(std::move(rec));
    return out;
  }
};

}  // namespace tapesac::replay
