// The tape: the structural record of one block call's forward, shared by the recorder (which writes it), the
// pruning pass and the replayer (which read it) and telemetry. This header is torch-free on purpose: the data-flow
// part of the tape can be built by hand in tests. What replay needs to *execute* an op (operator handle, boxed
// constant arguments, RNG state) lives beside the tape in capture::OpPayload.
//
// Model. A *storage* is one allocation (one c10::StorageImpl). A storage is *internal* when an op on the tape
// created it, *external* otherwise (block inputs, parameters, buffers, tensors made where the recorder cannot see).
// Every op that writes a storage (its creator, in-place ops, out= ops) is appended to that storage's `writers`; the
// storage's *state* is the number of writers that have run, so reading a storage "at state k" means that writers
// [0, k) have happened. An internal storage is at state 1 right after its creator; an external one starts at 0.
// A *value* is one tensor view (sizes, strides, offset, dtype) of a storage, produced by one op (or external).
//
// Note [Bytes no recorded op wrote]. Some ops allocate or resize a storage without setting its bytes (empty*,
// empty.out, resize_: kUninitialized). A kernel that runs outside the dispatcher (Triton, a CUDA extension called
// through pybind, ctypes, a write through `.numpy()`) then fills them, and the tape sees nothing of it: replaying
// the empty* op would serve uninitialised memory. So a read of bytes that no recorded op wrote since the last
// kUninitialized write cannot be replayed. The recorder finds such reads by tracking, per storage, the bytes
// recorded ops wrote (ByteCover); the tensor read is registered as an external value (held live, never rebuilt) and
// is opaque to pack (see Recorder::find_value). An argument an op writes without reading its bytes (an out=
// argument, the self of copy_, fill_, zero_ and the random fills) is not such a read (ArgRef::overwritten). The
// pruning pass refuses the coarse case on its own: a byte read of a storage whose last writer is kUninitialized.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tapesac/capture/small_dims.h"
#include "tapesac/capture/small_vec.h"

namespace tapesac::capture {

using ValueId = int32_t;
using OpIndex = int32_t;
using StorageId = int32_t;
/// Index into the process-wide table of op kinds (op_kinds.h).
using OpKind = int32_t;

/// Producer of a value that no op on the tape made.
constexpr OpIndex kExternal = -1;

/// View metadata of a value: what identifies it among the views of one storage.
struct TensorMeta {
  SmallDims sizes;
  SmallDims strides;
  int64_t storage_offset = 0;
  int16_t dtype = 0;        // c10::ScalarType as an integer
  int16_t device_type = 0;  // c10::DeviceType as an integer
  int16_t device_index = -1;
  /// Bytes this view spans (numel * itemsize); storage bytes are in StorageInfo.
  int64_t nbytes = 0;

  bool same_view(const TensorMeta& o) const {
    return storage_offset == o.storage_offset && dtype == o.dtype && sizes == o.sizes && strides == o.strides;
  }
};

struct ValueInfo {
  StorageId storage = -1;
  OpIndex producer = kExternal;
  /// State of `storage` right after `producer` ran (0 for an external value at block entry).
  int32_t state = 0;
  TensorMeta meta;
};

struct StorageInfo {
  bool external = false;
  /// Ops that wrote this storage, in tape order; for an internal storage writers[0] created it.
  SmallVec<OpIndex, 2> writers;
  /// Allocation size in bytes (as seen when the storage was first met).
  int64_t nbytes = 0;

  int32_t final_state() const { return static_cast<int32_t>(writers.size()); }
};

/// One tensor read by an op: which argument, which value, and the state of the value's storage at the read.
struct ArgRef {
  int16_t arg = 0;    // position in the op's boxed argument list
  int16_t elem = -1;  // index inside a Tensor[] / Tensor?[] argument; -1 for a plain Tensor argument
  ValueId value = -1;
  int32_t state = 0;
  /// The op only takes metadata from this argument: an output aliases its storage and the op writes nothing.
  bool meta_only = false;
  /// The op writes this argument without reading its bytes (an out= argument, copy_/fill_/zero_/random fills' self),
  /// or reads only its metadata (the self of *_like and new_* factories). See Note [Bytes no recorded op wrote].
  bool overwritten = false;
};

enum OpFlag : uint32_t {
  /// The op writes a storage the tape did not create: replay must never re-apply it.
  kWritesExternal = 1u << 0,
  /// The op draws random numbers at this call (the payload holds the generator state to restore).
  kRandom = 1u << 1,
  /// The op must not be replayed for another reason (effects, collectives, unsupported arguments).
  kNonReplayable = 1u << 2,
  /// Every output aliases an input and nothing is written (the aliased inputs are ArgRef::meta_only reads).
  kView = 1u << 3,
  /// Bitwise results may differ between runs on this device (schema tag nondeterministic_bitwise on CUDA).
  kNondeterministic = 1u << 4,
  /// The op allocates or resizes storage without setting its bytes (empty*, empty.out, resize_). See Note [Bytes no
  /// recorded op wrote].
  kUninitialized = 1u << 5,
  /// The kernel leaves part of its outputs unwritten (aten::_ctc_loss's log_alpha beyond each target's length): their
  /// bytes differ between runs where nothing reads them, so contract="strict" does not compare them (an adversarial
  /// test: a false "diverged" on F.ctc_loss with targets of different lengths).
  kUnwrittenBytes = 1u << 6,
};

/// Where a tape's OpRecord::duration_ns figures come from (see Note [Op times] in op_timer.h).
enum class OpTiming : uint8_t {
  kUntimed,     ///< not measured (RecorderOptions::time_ops off): every duration is 0
  kCpuClock,    ///< CPU steady clock from op entry to exit (on CUDA: launch overhead, not the op's cost)
  kCudaEvents,  ///< CUDA events around each op: stream time, gaps included
  kCupti,       ///< CUPTI activity records: the device time of the op's kernels, memcpys and memsets
};

/// "untimed", "cpu_clock", "cuda_events" or "cupti".
inline const char* op_timing_name(OpTiming t) {
  switch (t) {
    case OpTiming::kUntimed: return "untimed";
    case OpTiming::kCpuClock: return "cpu_clock";
    case OpTiming::kCudaEvents: return "cuda_events";
    case OpTiming::kCupti: return "cupti";
  }
  return "untimed";
}

struct OpRecord {
  OpKind kind = -1;
  uint32_t flags = 0;
  SmallVec<ArgRef, 4> inputs;
  /// Values of the op's returned tensors, flattened in return order (Tensor[] returns expanded); -1 for an
  /// undefined tensor.
  SmallVec<ValueId, 2> outputs;
  /// Storages this op wrote (creator writes of its new outputs included).
  SmallVec<StorageId, 2> writes;
  int64_t duration_ns = 0;

  bool has(OpFlag f) const { return (flags & f) != 0; }
};

/// The structural tape of one block call. Single writer (the recorder on the forward thread); read-only after the
/// block closes. Not thread-safe.
class Tape {
 public:
  /// Pre-sizes the tables (a hint; recording never needs it).
  void reserve(size_t ops, size_t values, size_t storages) {
    ops_.reserve(ops);
    values_.reserve(values);
    storages_.reserve(storages);
  }
  /// Empties the tape, keeping its tables' capacity (a recycled tape: Note [Recorder tables reused], recorder.cpp).
  void clear() {
    ops_.clear();
    values_.clear();
    storages_.clear();
    op_timing_ = OpTiming::kUntimed;
  }
  StorageId add_storage(bool external, int64_t nbytes);
  /// Registers a value that no tape op produced (block input, parameter, buffer, captured tensor).
  ValueId add_external_value(StorageId storage, TensorMeta meta);
  /// Appends an op and applies its effects: every storage in `op.writes` gets the op as its next writer, and
  /// `outputs` must already have been created with add_output_value() against the index this call returns
  /// (next_op_index()).
  OpIndex add_op(OpRecord op);
  /// Registers a value produced by the op at next_op_index() (call before add_op for that op).
  ValueId add_output_value(StorageId storage, int32_t state, TensorMeta meta);

  OpIndex next_op_index() const { return static_cast<OpIndex>(ops_.size()); }
  const std::vector<OpRecord>& ops() const { return ops_; }
  const std::vector<ValueInfo>& values() const { return values_; }
  const std::vector<StorageInfo>& storages() const { return storages_; }
  const OpRecord& op(OpIndex i) const { return ops_.at(static_cast<size_t>(i)); }
  const ValueInfo& value(ValueId v) const { return values_.at(static_cast<size_t>(v)); }
  const StorageInfo& storage(StorageId s) const { return storages_.at(static_cast<size_t>(s)); }
  /// Current state of a storage while recording (== final state once the block closed).
  int32_t state_of(StorageId s) const { return storage(s).final_state(); }
  /// The op whose write made the bytes a read of `v` at storage state `state` sees: for an internal storage read at
  /// state k > 0 its k-th writer, else v's producer (kExternal for an external value).
  OpIndex bytes_writer(ValueId v, int32_t state) const {
    const ValueInfo& info = value(v);
    const StorageInfo& st = storage(info.storage);
    if (!st.external && state > 0 && static_cast<size_t>(state) <= st.writers.size()) {
      return st.writers[static_cast<size_t>(state) - 1];
    }
    return info.producer;
  }

  /// Where the ops' duration_ns come from.
  OpTiming op_timing() const { return op_timing_; }
  void set_op_timing(OpTiming t) { op_timing_ = t; }
  /// Replaces every op's duration_ns by `ns` (one per op, in tape order) measured by `source`. Throws
  /// std::invalid_argument when the sizes differ (the tape is then unchanged).
  void set_op_times(OpTiming source, const std::vector<int64_t>& ns);

  /// Human-readable dump (one op per line) for tests and error messages.
  std::string to_string() const;

 private:
  std::vector<OpRecord> ops_;
  std::vector<ValueInfo> values_;
  std::vector<StorageInfo> storages_;
  OpTiming op_timing_ = OpTiming::kUntimed;
};

}  // namespace tapesac::capture
