// The recorder: while active on a thread, every operator that thread runs *at the level autograd sees it*
// (CompositeImplicitAutograd ops decomposed, ops nested inside kernels skipped) is appended to a Tape, with its
// boxed arguments, alias and mutation effects, the generator state of random ops and its measured duration. It
// runs in C++ through the dispatch hook (dispatch_hook.h, Note [Dispatch hook]), or, where that is not available or
// not chosen (RecorderOptions::hook), a thread-local at::RecordFunction callback; no Python runs per op. Both see the
// same calls and build the same tape.
//
// Identity without keeping memory alive: the recorder maps TensorImpl and StorageImpl addresses to tape ids and
// holds *weak* references to both, so an address cannot be reused while the block records, yet a freed tensor's
// memory is really released. Strong references are taken only for external values (needed as replay inputs).
//
// Bytes no recorded op wrote (Note [Bytes no recorded op wrote], tape.h): a read of such bytes (an empty* buffer a
// kernel filled through its data pointer) registers the tensor read as an external value — held live, never rebuilt
// — and find_value() answers -1 for it, so that a saved tensor with such bytes is opaque (kept and counted).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/util/intrusive_ptr.h>

#include "tapesac/capture/byte_cover.h"
#include "tapesac/capture/dispatch_hook.h"
#include "tapesac/capture/op_info.h"
#include "tapesac/capture/op_payload.h"
#include "tapesac/capture/op_timer.h"
#include "tapesac/capture/ptr_index_map.h"
#include "tapesac/capture/tape.h"

namespace tapesac::capture {

class Recorder;

/// What a recording needs only while it runs: tensor and storage identities. Emptied by Recorder::stop(), which hands
/// it, capacity kept, to the thread's next recording (Note [Recorder scratch reused] in recorder.cpp).
struct RecorderIdentity {
  PtrIndexMap impl_value;  // TensorImpl -> its latest value
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> impl_refs;
  PtrIndexMap storage_id;  // StorageImpl (or TensorImpl without storage) -> storage
  std::vector<const void*> storage_key;  // storage -> its key in storage_id (Note [A storage replaced inside the block])
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storage_refs;
  // Values of each storage as a linked list, newest first (no allocation per storage).
  std::vector<ValueId> last_value_of_storage;
  std::vector<ValueId> prev_value_same_storage;

  /// Empties every part, keeping capacities.
  void reset() {
    impl_value.reset();
    impl_refs.clear();
    storage_id.reset();
    storage_key.clear();
    storage_refs.clear();
    last_value_of_storage.clear();
    prev_value_same_storage.clear();
  }
};

/// Told after each recorded op has been appended (used to resolve saved tensors that are that op's outputs).
class RecorderListener {
 public:
  virtual ~RecorderListener() = default;
  virtual void on_op_recorded(Recorder& recorder, OpIndex op) = 0;
};

/// How the recorder sees operator calls (Note [Dispatch hook]).
enum class RecorderHook : uint8_t {
  kDefault,         ///< the process-wide choice (default_recorder_hook())
  kAuto,            ///< the dispatch hook when available, else at::RecordFunction
  kDispatchKey,     ///< the dispatch hook; start() throws when it is not available
  kRecordFunction,  ///< a thread-local at::RecordFunction callback with inputs and outputs
};

/// "default", "auto", "dispatch_key" or "record_function".
const char* recorder_hook_name(RecorderHook hook);
/// Parses recorder_hook_name()'s names; throws std::invalid_argument naming the accepted ones.
RecorderHook parse_recorder_hook(const std::string& name);
/// The process-wide choice RecorderHook::kDefault stands for (initially kAuto). Thread-safe.
RecorderHook default_recorder_hook();
/// The hook `hook` stands for now: kDefault is the process-wide choice, kAuto the dispatch hook when available;
/// the answer is kDispatchKey or kRecordFunction. The write watcher follows the recorders' choice through it.
RecorderHook resolve_recorder_hook(RecorderHook hook);
/// Sets it (kDefault is refused with std::invalid_argument). Thread-safe; recorders already started keep theirs.
void set_default_recorder_hook(RecorderHook hook);

struct RecorderOptions {
  /// Snapshot generator state for random ops (needed for exact replay of dropout and friends).
  bool record_rng = true;
  /// Measure each op's wall-clock duration (CPU clock; on CUDA this is launch time only; see set_op_timer).
  bool time_ops = true;
  /// Expected number of ops (e.g. from the same block's previous step): tables are pre-sized so that recording
  /// does not reallocate them while the block runs.
  size_t expected_ops = 64;
  /// How operator calls are seen.
  RecorderHook hook = RecorderHook::kDefault;
};

/// Records one block call. Create, start() on the thread that runs the block, stop() on the same thread. Only one
/// recorder can be active per thread. Not thread-safe; the tape is read-only after stop().
class Recorder : private CallObserver {
 public:
  explicit Recorder(RecorderOptions options = {});
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  /// Attaches to the dispatch hook or installs the thread-local callback (RecorderOptions::hook). Throws
  /// std::runtime_error when a recorder is already active on this thread, std::logic_error when the hook asked for
  /// is not available.
  void start();
  /// Removes the callback and drops identity maps (weak references). Idempotent; never throws.
  void stop() noexcept;
  bool active() const { return active_; }
  /// The hook in use while active (kDispatchKey or kRecordFunction), else the one the options ask for.
  RecorderHook hook() const { return active_ ? hook_ : options_.hook; }

  /// The recorder active on the calling thread, or nullptr.
  static Recorder* current();

  void set_listener(RecorderListener* listener) { listener_ = listener; }
  /// Device times for this block call (Note [Op times], op_timer.h): the recorder owns `timer`, brackets every
  /// tracked op with it and, when recording stops, replaces the tape's durations by its figures. Null: the CPU
  /// clock, and `why` says why there is no timer. Set before start(); the CPU clock still runs as the fallback.
  void set_op_timer(std::unique_ptr<OpTimer> timer, std::string why = {});
  /// Why the tape's times are not the timer's (it was refused or failed), or the timer's own note; "" otherwise.
  const std::string& op_timing_note() const { return timing_note_; }

  const Tape& tape() const { return tape_; }
  const std::vector<OpPayload>& payloads() const { return payloads_; }
  /// Hands over the live tensors by value id: defined for external values (detached aliases), undefined
  /// otherwise. The recorder holds none afterwards.
  std::vector<at::Tensor> take_live() { return std::move(live_); }
  /// The tensors the external values were read from (weak: a later `.data` replacement shows as a storage change).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> take_origins() { return std::move(origins_); }
  /// Drops every strong reference, payload and tape entry (after the step).
  void clear() noexcept;

  /// The tape value `t` currently is (its latest version), or -1 when the recorder has not seen it or when its bytes
  /// were written by no recorded op (opaque: Note [Bytes no recorded op wrote]).
  ValueId find_value(const at::Tensor& t) const;
  /// The latest value of the tensor whose TensorImpl is `impl` (identity only; -1 when unknown or opaque, as
  /// find_value). `impl` must be alive (its address is not reused while the caller holds it).
  ValueId find_value_of_impl(const c10::TensorImpl* impl) const;
  /// True while a recorded op has started and not yet finished on this thread (its outputs are not on the tape).
  bool op_open() const { return !open_.empty(); }
  /// Non-empty when recording failed part-way (the tape is then incomplete and must not be replayed from).
  const std::string& error() const { return error_; }

 private:
  struct Frame {
    const OpInfo* info = nullptr;  // nullptr: not recorded
    SmallVec<ArgRef, 4> inputs;
    SmallVec<c10::IValue, 6> args;
    std::optional<at::Generator> generator;
    c10::intrusive_ptr<c10::TensorImpl> generator_state;
    bool rng_probe = false;  // generator_state is a probe: kept only if the call moved the generator
    bool non_replayable = false;
    bool composite = false;  // statically decomposes; see Note [Composite ops that run themselves]
    bool has_tensor_args = false;
    OpIndex tape_size = 0;   // tape length when the op started
    bool timed = false;      // the op timer has a bracket open for this frame
    // Inputs that read bytes no recorded op wrote: (index in `inputs`, the tensor read). Usually empty.
    std::vector<std::pair<size_t, at::Tensor>> unwritten;
    int64_t start_ns = 0;    // common::now_ns() at entry when options_.time_ops
  };

  /// One operator call as either hook sees it.
  struct CallView {
    const char* name = nullptr;           // the schema's name: one address per operator
    c10::ArrayRef<c10::IValue> inputs;    // at entry only
    const at::RecordFunction* fn = nullptr;
    const c10::OperatorHandle* op = nullptr;
    std::optional<c10::OperatorName> operator_name() const;
  };

  static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn);
  static void on_exit(const at::RecordFunction& fn, at::ObserverContext* ctx);
  bool on_call_enter(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int depth) noexcept override;
  void on_call_exit(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> returns) noexcept override;
  void enter(const CallView& call) noexcept;
  void exit(const CallView& call, c10::ArrayRef<c10::IValue> outputs) noexcept;
  /// Keeps the first failure as error_ (recording then stops).
  void note_failure(const CallView& call, const std::exception& e) noexcept;
  /// The call's arguments into f: tensors as value reads, the rest kept as constants for replay.
  void read_arguments(Frame& f, c10::ArrayRef<c10::IValue> inputs);
  /// Note [Composite ops that run themselves]: none of its children was recorded and it returned a tensor that is
  /// not one of its inputs.
  bool composite_ran_itself(const Frame& f, c10::ArrayRef<c10::IValue> outputs) const;
  /// What registering a call's outputs found.
  struct OutputScan {
    bool any_new_storage = false;  // an output is on a storage the tape had not seen: the op created it
    bool cuda = false;
  };
  /// One output of the call being finished: its storage (created or written), its value, its identity; appends
  /// the storage to scratch_storages_.
  void register_output(OpRecord& rec, const at::Tensor& t, OutputScan& scan);
  /// Appends the op of a finished tracked call to the tape; its index, or -1 when it is not recorded.
  OpIndex finish(Frame& f, const CallView& call, c10::ArrayRef<c10::IValue> outputs);
  const OpInfo* should_record(const CallView& call);

  StorageId storage_of(const at::Tensor& t, bool create_external);
  /// find_value without the opaque filter.
  /// The tape value `t` is; `by_impl` (if given) tells whether its TensorImpl resolved it (not a view's metadata).
  ValueId lookup(const at::Tensor& t, bool* by_impl = nullptr) const;
  /// True when value `v` viewed as `view` shows bytes no recorded op wrote (or was registered for such a read).
  bool opaque(ValueId v, const TensorMeta& view) const;
  /// Coverage after a recorded op (Note [Bytes no recorded op wrote]): a kUninitialized op resets the storages it
  /// writes; any other op marks its outputs' bytes on the storages it writes.
  void note_writes(const OpRecord& rec);
  /// True for the fill_ with which deterministic mode sets what the previous (kUninitialized) op allocated: see
  /// OpInfo::fill.
  bool deterministic_fill(const OpInfo& info, const OpRecord& rec) const;
  /// At the op's exit: unless the call is a view, each input in f.unwritten becomes an external value (opaque).
  void externalize_unwritten(Frame& f, OpRecord& rec, c10::ArrayRef<c10::IValue> outputs, bool writes);
  ValueId value_for_input(const at::Tensor& t);
  ValueId add_external(const at::Tensor& t, StorageId s);
  void add_input(Frame& f, const at::Tensor& t, int arg, int elem);
  void link_value(ValueId v, StorageId s);
  void capture_rng(Frame& f, c10::ArrayRef<c10::IValue> inputs);
  void probe_rng(Frame& f, c10::ArrayRef<c10::IValue> inputs);
  static void settle_rng_probe(Frame& f);
  /// Empties the tape and the payloads and gives their tables to the thread's next recording (Note [Recorder
  /// tables reused] in recorder.cpp).
  void recycle_tables() noexcept;
  /// The op timer threw or gave unusable figures: cancel it, keep the CPU clock, remember why.
  void drop_timer(const std::string& why) noexcept;
  /// Recording stops: the timer's figures replace the tape's durations (or the timer is dropped).
  void finish_timer() noexcept;

  RecorderOptions options_;
  bool active_ = false;
  RecorderHook hook_ = RecorderHook::kRecordFunction;  // while active: the one in use
  at::CallbackHandle callback_ = 0;
  RecorderListener* listener_ = nullptr;

  Tape tape_;
  std::vector<OpPayload> payloads_;
  std::vector<at::Tensor> live_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> origins_;

  RecorderIdentity id_;  // while recording (emptied by stop())
  // Per storage: the bytes recorded ops wrote since its last uninitialising write; null when not tracked (created by
  // an op that sets its bytes, or external). Empty until an uninitialising op runs.
  std::vector<std::unique_ptr<ByteCover>> cover_;
  // Values registered for a read of bytes no recorded op wrote (1); indexed by ValueId, may be short.
  std::vector<uint8_t> opaque_;

  // One entry per dispatcher call in progress (1: it has a frame in open_), and the frames of the tracked ones.
  std::vector<uint8_t> call_stack_;
  std::vector<Frame> open_;
  std::vector<StorageId> scratch_storages_;  // reused by exit()
  // Set while the recorder itself runs code that might dispatch (generator state, aliases): never recorded.
  bool busy_ = false;
  bool composite_ = false;  // out-parameters of should_record()
  bool has_tensor_args_ = false;
  std::string error_;
  std::unique_ptr<OpTimer> timer_;  // null: CPU clock only
  std::string timing_note_;
};

/// TensorMeta of `t`.
TensorMeta meta_of(const at::Tensor& t);

}  // namespace tapesac::capture
