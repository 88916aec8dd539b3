// One TapeSAC step as the C++ runtime sees it: block calls (each with its Recorder and tape), the tensors autograd
// saves inside them (pack: keep or drop by the policy; unpack: serve, or replay the pruned closure on first need),
// and the step's counters. The Python package only wires hooks to these calls.
//
// Lifetime. A BlockCall is shared by the Session and by every SavedSlot handle that autograd holds. When the step
// ends the Session closes its block calls: every tensor they hold is released, and a later unpack of one of their
// handles throws (kGeneric) instead of returning stale data.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <optional>

#include <ATen/core/Tensor.h>

#include "tapesac/allocator/limit.h"
#include "tapesac/allocator/telemetry.h"
#include "tapesac/capture/recorder.h"
#include "tapesac/replay/approx.h"
#include "tapesac/replay/eager_replayer.h"
#include "tapesac/replay/graph_block.h"
#include "tapesac/replay/preserve.h"

namespace tapesac::replay {

enum class PolicyKind { kNone, kFull, kSaveOps, kPlan };

/// What a block call's forward left for planning (see Session::set_tape_observer): its tape, the values a policy
/// decides on (saved for backward, produced on the tape; ascending ValueId), which of them cannot be dropped, and
/// the keep mask applied this step (1 = kept).
struct BlockTapeView {
  const std::string& name;
  uint64_t signature;
  const capture::Tape& tape;
  const std::vector<capture::ValueId>& candidates;
  const std::vector<uint8_t>& must_keep;
  const std::vector<uint8_t>& kept;
};

/// The plan of one block (policy kPlan): for the block call whose tape has `signature`, keep candidate i iff
/// keep[i] (candidates in the order BlockTapeView lists them).
struct BlockPlan {
  uint64_t signature = 0;
  std::vector<uint8_t> keep;
};

struct SessionOptions {
  PolicyKind policy = PolicyKind::kFull;
  /// For kSaveOps: true when outputs of the op named (e.g. "aten::mm", "aten::add.Tensor") should be kept.
  /// Called once per distinct op kind per Session (results cached); may call into Python.
  std::function<bool(const std::string&)> save_op;
  /// Check version counters of saved and live tensors at unpack (contract "check"/"strict"); off skips them.
  bool check_versions = true;
  /// Check replayed outputs' metadata against the tape.
  bool check_metadata = true;
  /// Contract "strict": checksum every dropped tensor's bytes at forward and compare after replay.
  bool check_bytes = false;
  /// How replays recover external tensors the step writes in place after a block's forward (see preserve.h);
  /// kOff rejects such replays.
  PreserveMode preserve = PreserveMode::kRegions;
  /// Step-peak limit in bytes enforced during replay (0: none): a replay that would not fit runs in pieces, and
  /// raises MemoryLimitError when even a piece cannot fit.
  int64_t memory_limit = 0;
  /// Bound of the step's memory timeline (points); 0 disables it.
  size_t timeline_points = 8192;
  /// CUDA only: the private memory pool (a MempoolId_t, e.g. torch.cuda.MemPool().id) every replay of the
  /// session allocates from — the replay arena; {0, 0}: replays use the default pool.
  std::pair<uint64_t, uint64_t> arena_pool_id{0, 0};
  int arena_device = 0;
  /// Graph replay (graph_block.h): the device that captures and launches block graphs; null: eager replay only.
  std::shared_ptr<capture::GraphDevice> graph_device;
  GraphOptions graph;
  /// The step-peak limit graph captures must respect (bytes, 0: none), also on the steps where memory_limit is
  /// switched off (a planner's measuring step): a graph's static memory stays for every later step.
  int64_t graph_memory_limit = 0;
  /// Device op times for the planner (capture/op_timer.h, e.g. capture::device_op_timers()); null: CPU clock.
  std::shared_ptr<capture::OpTimerFactory> op_timers;
};

/// A span of the step's timeline: one block's forward or one replay.
struct TimelineSpan {
  std::string kind;  // "forward" or "replay"
  std::string block;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

/// The execution record of one replayed value (contract outcome and cost).
struct ReplayRecord {
  std::string block;
  int64_t value = -1;
  std::string op;      // the op that produced the value's bytes
  std::string status;  // "match", "recovered", "rejected", "divergent" or "approximated" (TapeSAC(approx=...))
  int64_t bytes = 0;
  int64_t ns = 0;      // duration of the replay that rebuilt it (shared by the values of one replay)
  int64_t replay = 0;  // index of that replay within the block call
  std::string detail;  // what was recovered, rejected or diverged
};

/// The memory side of one step: counted by the counting CPU allocator on the stepping thread (see
/// allocator/telemetry.h); shared by the Session and its BlockCalls.
struct StepMemory {
  std::shared_ptr<allocator::MemoryCounter> counter;
  /// Bytes of the model's parameters, buffers and gradients at step start (not counted by the step's counter).
  int64_t baseline = 0;
  allocator::ArenaAccounting arena;
  std::mutex spans_mu;
  std::vector<TimelineSpan> spans;
  int64_t replay_pieces = 0;
  std::vector<ReplayRecord> records;  // guarded by spans_mu

  /// Bytes in use now as the limit sees them.
  int64_t in_use() const { return baseline + (counter ? counter->current() : 0); }
  void add_span(TimelineSpan span);
  void add_record(ReplayRecord record);
};

/// A snapshot of StepMemory at step end.
struct StepMemoryStats {
  int64_t baseline = 0;
  allocator::Gauge total;  // the step's counter: peak is relative to step start (add baseline for the step peak)
  std::array<allocator::Gauge, allocator::kNumPhases> phases{};
  int64_t arena_shared = 0;
  int64_t arena_separate = 0;
  int64_t replay_pieces = 0;
  int64_t memory_limit = 0;
  std::vector<allocator::TimelinePoint> timeline;
  std::vector<TimelineSpan> spans;
};

struct BlockStats {
  std::string name;
  int64_t ops_recorded = 0;
  int64_t saved = 0;
  int64_t kept = 0;
  int64_t dropped = 0;
  int64_t opaque = 0;
  int64_t kept_bytes = 0;
  int64_t dropped_bytes = 0;
  int64_t opaque_bytes = 0;
  int64_t replays = 0;
  int64_t ops_replayed = 0;
  int64_t replay_ns = 0;
  /// Bytes allocated while replaying (all replays of the block call), the largest measured working set of one
  /// replay, and the largest predicted one (from the tape's sizes).
  int64_t replayed_bytes = 0;
  int64_t replay_peak_bytes = 0;
  int64_t predicted_replay_bytes = 0;
  /// Replays that ran in pieces because the whole did not fit under the memory limit.
  int64_t replay_pieces = 0;
  /// Policy kPlan: 1 when the plan was applied, 0 when no plan matched this tape (the call ran as "full").
  int64_t planned = 0;
  uint64_t signature = 0;
  std::string capture_error;
  /// Where the tape's op times come from (capture::op_timing_name) and why not from the device timer, if so.
  std::string op_timing;
  std::string op_timing_note;
  /// Approximate rematerialization (Session::set_approx): what was matched and how many units replay recomputes.
  ApproxStats approx;
  /// Graph replay (SessionOptions::graph_device): replays launched as a graph, graphs captured by this call's
  /// replays, eager warm-up replays, eager fallbacks with the last fallback's reason (to_string(GraphFallback),
  /// "approx" or "" when none) and detail, bytes staged into static buffers, and the nodes of the last launch.
  int64_t graph_replays = 0;
  int64_t graph_captures = 0;
  int64_t graph_warmups = 0;
  int64_t graph_fallbacks = 0;
  std::string graph_fallback;
  std::string graph_detail;
  int64_t graph_staged_bytes = 0;
  int64_t graph_nodes_enabled = 0;
  int64_t graph_nodes_disabled = 0;
  /// Timed launches (GraphOptions::time_launches): how many, the source (op_timing_name: "cupti" or "cpu_clock"),
  /// per tape op the summed time of its nodes, their total and the time of records no op owns; the note says why
  /// the last launch that was to be timed was not.
  int64_t graph_timed_launches = 0;
  std::string graph_timing;
  std::string graph_timing_note;
  std::vector<int64_t> graph_op_ns;
  std::vector<std::string> graph_op_names;  // op_kind_name of each tape op, set with the first timed launch
  int64_t graph_device_ns = 0;
  int64_t graph_unattributed_ns = 0;
};

/// One call of one block within a step. Thread-safe for pack/unpack after close_forward(); recording itself
/// happens on the thread that runs the forward.
class BlockCall : public capture::RecorderListener, public std::enable_shared_from_this<BlockCall> {
 public:
  BlockCall(std::string name, const SessionOptions* options, const std::unordered_set<const void*>* param_storages,
            std::vector<int8_t>* save_cache, size_t expected_ops, std::shared_ptr<StepMemory> memory,
            const class Session* session = nullptr);
  ~BlockCall() override;

  void start_forward();
  /// Ends recording, decides keep/drop for every saved tensor and frees the dropped ones. Recording has stopped
  /// even when it throws (only allocation or the strict contract's checksums can).
  void close_forward();
  /// Called at step end: releases everything; later unpacks throw.
  void close_step() noexcept;

  /// Registers a tensor autograd saves; returns its slot.
  int32_t pack(const at::Tensor& t);
  /// The tensor saved in `slot`, replaying its producers on first need.
  at::Tensor unpack(int32_t slot);
  /// The handle of `slot` is gone (autograd freed the node that saved it): its tensor is no longer needed. When
  /// the last handle goes, everything the block call holds is released. Never throws.
  void release(int32_t slot) noexcept;

  BlockStats stats() const;
  /// Names of the recorded ops, in order.
  std::vector<std::string> op_names() const;
  const std::unordered_map<capture::OpKind, int64_t>& replayed_by_kind() const { return replay_stats_.ops_by_kind; }

  void on_op_recorded(capture::Recorder& recorder, capture::OpIndex op) override;

 private:
  struct Slot {
    at::Tensor tensor;  // kept value, or held until close_forward() decides
    capture::ValueId value = -1;
    int32_t state = 0;
    bool pending = false;  // saved inside an op that has not finished: resolved when it does
    const c10::TensorImpl* pending_impl = nullptr;  // the saved TensorImpl, for identity while pending
    // Keeps pending_impl's address from being reused (by an output the recorder then registers) while pending.
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> pending_ref;
    bool dropped = false;
    c10::VariableVersion version{c10::VariableVersion::DISABLED};
    uint32_t saved_version = 0;
    bool released = false;
    int64_t last_round = -1;  // the unpack round in which this slot was last unpacked
    // The tensor autograd saved (weak): when its storage is replaced (`.data = ...`) after the forward, the slot
    // still serves the forward's bytes, and the unpack says so in the records.
    c10::weak_intrusive_ptr<c10::TensorImpl> origin{c10::intrusive_ptr<c10::TensorImpl>()};
    bool replaced_reported = false;
  };
  /// Why `current` (the tensor a value was read from) no longer shows the bytes `held` (what tapesac holds) had at
  /// the forward, or "" when it still does.
  static std::string replaced_storage(const c10::weak_intrusive_ptr<c10::TensorImpl>& origin, const at::Tensor& held);

  void release_all() noexcept;

  void resolve_pending(bool final);
  bool keep_by_policy(capture::ValueId v, int32_t state);
  void check_version(const Slot& s, int32_t slot) const;
  /// The contract on the live tensors `plan` reads: every one whose version moved since the forward is made to read
  /// as the forward saw it by the write watcher — a snapshot view returned by value id, or regions swapped back
  /// until `swaps` are destroyed; `recovered` says which — or the replay is rejected (ReplayContractError, with a
  /// "rejected" record for `wanted`).
  std::unordered_map<ValueId, at::Tensor> resolve_live(const PruneResult& plan, ValueId wanted, std::string* recovered,
                                                       std::vector<std::unique_ptr<WriteWatcher::Swap>>* swaps);
  void record(ValueId v, const std::string& status, int64_t bytes, int64_t ns, std::string detail) const;
  /// Applies the memory limit to a replay of `targets` (the remaining dropped values): returns the targets to
  /// replay now (all of them, or only `wanted` when the whole would not fit); throws MemoryLimitError when
  /// even `wanted` alone cannot fit.
  std::vector<Read> limit_targets(std::vector<Read> targets, const Read& wanted, PruneResult& plan);
  /// The CUDA device of the tensors this call holds live, or -1 (CPU).
  int live_cuda_device() const;
  /// Bytes in use now as the memory limit sees them (the device allocator's figure on CUDA).
  int64_t in_use_now() const;
  /// Replays `targets` through the session's graph cache; empty when it ran nothing (warm-up or fallback: the
  /// caller replays eagerly). Updates the graph fields of the stats.
  std::unordered_map<ValueId, at::Tensor> replay_graph(const std::vector<Read>& targets, const PruneResult& plan,
                                                       const std::vector<at::Tensor>& live);

  /// The plan for this call (kPlan), looked up by name at close_forward(); null when none.
  const BlockPlan* find_plan() const;

  std::string name_;
  std::shared_ptr<StepMemory> memory_;
  const class Session* session_ = nullptr;
  int64_t forward_begin_ns_ = 0;
  const SessionOptions* options_;
  const std::unordered_set<const void*>* param_storages_;
  std::vector<int8_t>* save_cache_;
  capture::Recorder recorder_;

  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<int32_t> pending_;
  bool forward_closed_ = false;
  bool step_closed_ = false;
  std::vector<uint8_t> available_;
  std::vector<at::Tensor> live_;
  std::vector<uint32_t> live_versions_;
  std::vector<int64_t> live_marks_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> origins_;  // per live external value (Recorder)  // the write watcher's mark of each live tensor (see WriteWatcher::watch)
  std::shared_ptr<WriteWatcher> watcher_;
  std::unordered_map<capture::ValueId, int32_t> value_state_;
  std::unordered_map<capture::ValueId, uint64_t> checksums_;
  // Dropped values: live handles, handles not yet unpacked in this round (a round is one backward over the
  // graph; retain_graph=True starts another), and replayed tensors waiting for their unpacks.
  std::unordered_map<capture::ValueId, int32_t> handles_;
  std::unordered_map<capture::ValueId, int32_t> remaining_;
  int64_t round_ = 0;
  int64_t alive_slots_ = 0;
  std::unordered_map<capture::ValueId, at::Tensor> cache_;
  ReplayStats replay_stats_;
  std::unique_ptr<BlockApprox> approx_;  // null: exact replay
  int64_t replays_ = 0;
  BlockStats closed_stats_;
};

/// What pack hands to autograd for one saved tensor: unpack() serves it; destruction releases it (autograd
/// destroys it with the graph node that saved it). Shared by the Python handle object; not copyable.
class SavedSlot {
 public:
  SavedSlot(std::shared_ptr<BlockCall> block, int32_t slot) : block_(std::move(block)), slot_(slot) {}
  ~SavedSlot() { block_->release(slot_); }
  SavedSlot(const SavedSlot&) = delete;
  SavedSlot& operator=(const SavedSlot&) = delete;
  at::Tensor unpack() const { return block_->unpack(slot_); }
  int32_t slot() const { return slot_; }

 private:
  std::shared_ptr<BlockCall> block_;
  int32_t slot_;
};

/// The runtime state of one TapeSAC instance across steps.
class Session {
 public:
  explicit Session(SessionOptions options);
  ~Session();

  /// Starts a step; `params` are the model's parameters and buffers (their storages are not activations; their
  /// bytes and their gradients' are the step's memory baseline). Makes the step's memory counter active on this
  /// thread until end_step(), which must run on the same thread.
  void begin_step(const std::vector<at::Tensor>& params);
  /// Ends the step: closes every block call (releasing memory) and keeps their stats. Never throws.
  void end_step() noexcept;
  bool in_step() const { return in_step_; }

  /// Opens a block call (starts recording on this thread). Returns nullptr when a block is already open (nested
  /// blocks record into the outer one).
  std::shared_ptr<BlockCall> begin_block(const std::string& name);
  /// Closes the open block call started by begin_block (no-op when none); the block is closed even if it throws.
  void end_block();
  std::shared_ptr<BlockCall> current_block() const { return current_; }

  const std::vector<BlockStats>& last_stats() const { return last_stats_; }
  /// Replayed op counts of the last step, by op name.
  const std::unordered_map<std::string, int64_t>& last_replayed_by_name() const { return last_replayed_; }
  const SessionOptions& options() const { return options_; }
  /// Memory of the last finished step.
  const StepMemoryStats& last_memory() const { return last_memory_; }
  void set_memory_limit(int64_t bytes);
  void set_graph_memory_limit(int64_t bytes) { options_.graph_memory_limit = bytes; }
  /// Policy kPlan: the plans by block name (replaces the previous ones). A block call whose tape signature differs
  /// from its plan's, or without a plan, runs as "full" (BlockStats::planned == 0).
  void set_plans(std::unordered_map<std::string, BlockPlan> plans);
  const std::unordered_map<std::string, BlockPlan>& plans() const { return plans_; }
  /// Called at the end of every block call's forward (after keep/drop is decided), on the forward thread; the
  /// view is valid only during the call. Used by the planner's bindings to build problems and costs.
  void set_tape_observer(std::function<void(const BlockTapeView&)> observer) { observer_ = std::move(observer); }
  const std::function<void(const BlockTapeView&)>& tape_observer() const { return observer_; }
  /// Approximate rematerialization for later steps (null: off). Between steps only.
  void set_approx(std::shared_ptr<Approx> approx);
  Approx* approx() const { return approx_.get(); }
  /// Preservation chosen per storage (the keys of PreservedStorage): `modes` overrides the session's mode for a
  /// storage, and the dropped values whose replay would read a storage in `keep` are kept instead. Between steps.
  void set_preservation(std::unordered_map<const void*, PreserveMode> modes, std::unordered_set<const void*> keep);
  const std::unordered_set<const void*>& keep_dependents() const { return keep_dependents_; }
  std::shared_ptr<WriteWatcher> watcher() const { return watcher_; }
  /// Storages written in place after a block read them during the last step, with what preserving them cost.
  const std::vector<PreservedStorage>& last_preserved() const { return last_preserved_; }
  /// Execution records of the last step's replays.
  const std::vector<ReplayRecord>& last_records() const { return last_records_; }
  /// Step peak of the last finished step (bytes; 0 before the first): a graph capture must fit on top of it.
  int64_t last_peak() const { return last_peak_; }
  /// The graph cache (null without SessionOptions::graph_device).
  GraphCache* graph_cache() const { return graphs_.get(); }
  /// Ends the step if one is open, removes the counting allocator layer this Session installed (it is installed
  /// again by the next begin_step()) and releases the captured graphs (later replays are eager). Never throws.
  void shutdown() noexcept;

 private:
  SessionOptions options_;
  bool in_step_ = false;
  std::unordered_set<const void*> param_storages_;
  std::vector<int8_t> save_cache_;
  std::vector<std::shared_ptr<BlockCall>> blocks_;
  std::shared_ptr<BlockCall> current_;
  std::vector<BlockStats> last_stats_;
  std::unordered_map<std::string, int64_t> last_replayed_;
  // Ops recorded per block name in the previous step: the recorder pre-sizes its tables from it.
  std::unordered_map<std::string, size_t> expected_ops_;
  // Installed from the first step until the Session is destroyed (the counting CPU allocator layer).
  std::unique_ptr<allocator::CountingAllocatorUse> allocator_use_;
  std::shared_ptr<StepMemory> memory_;
  std::optional<allocator::ScopedCounter> counter_scope_;
  StepMemoryStats last_memory_;
  std::unordered_map<std::string, BlockPlan> plans_;
  std::function<void(const BlockTapeView&)> observer_;
  std::shared_ptr<Approx> approx_;
  std::shared_ptr<WriteWatcher> watcher_;
  std::unordered_map<const void*, PreserveMode> preserve_modes_;
  std::unordered_set<const void*> keep_dependents_;
  std::vector<PreservedStorage> last_preserved_;
  std::vector<ReplayRecord> last_records_;
  std::unique_ptr<GraphCache> graphs_;
  int64_t last_peak_ = 0;
};

/// A 64-bit signature of a block call's tape and candidates: op kinds, flags, data flow, sizes and the candidate
/// list. Equal signatures mean identical planning problems.
uint64_t tape_signature(const capture::Tape& tape, const std::vector<capture::ValueId>& candidates);

}  // namespace tapesac::replay
