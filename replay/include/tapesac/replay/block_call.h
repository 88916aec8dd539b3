// One call of one block within a step: its Recorder and tape, the tensors autograd saves inside it (pack: keep or
// drop, decided when the forward closes; unpack: serve, or replay the pruned producer closure on first need), and
// its statistics. SavedSlot is what autograd holds for one saved tensor.
//
// Lifetime. A BlockCall is shared by the Session and by every SavedSlot handle that autograd holds. When the step
// ends the Session closes its block calls: every tensor they hold is released, and a later unpack of one of their
// handles throws (kGeneric) instead of returning stale data.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tapesac/capture/recorder.h"
#include "tapesac/replay/approx.h"
#include "tapesac/replay/block_stats.h"
#include "tapesac/replay/contract.h"
#include "tapesac/replay/decide.h"
#include "tapesac/replay/eager_replayer.h"
#include "tapesac/replay/graph_block.h"
#include "tapesac/replay/schedule.h"
#include "tapesac/replay/session_options.h"
#include "tapesac/replay/step_memory.h"

namespace tapesac::replay {

/// The policy kSaveOps's answers per op kind (-1: not asked yet), shared by a Session's block calls.
using SaveOpCache = std::vector<int8_t>;
/// Per tape signature: how backward used the dropped values (Note [Replay schedule]).
using UnpackOrders = std::unordered_map<uint64_t, UnpackObservation>;

class BlockCall;

/// What a block call borrows from its Session for one step. Pointers are owned by the Session and outlive the step;
/// null members mean "none".
struct BlockContext {
  const SessionOptions* options = nullptr;
  /// Storages of the model's parameters and buffers (not counted as kept bytes).
  const std::unordered_set<const void*>* param_storages = nullptr;
  SaveOpCache* save_cache = nullptr;
  std::shared_ptr<StepMemory> memory;
  std::shared_ptr<WriteWatcher> watcher;
  /// Storages whose dependents the preservation plan keeps (Session::set_preservation).
  const std::unordered_set<const void*>* keep_dependents = nullptr;
  const TapeObserver* observer = nullptr;
  const std::unordered_map<std::string, BlockPlan>* plans = nullptr;
  /// The call's key in `plans` (plan_key(): its block's name, "name#k" for the block's k-th call in the step).
  std::string plan_key;
  /// Unpack orders observed in earlier steps (the default schedule's order).
  const UnpackOrders* orders = nullptr;
  Approx* approx = nullptr;
  GraphCache* graphs = nullptr;
  /// The last decision per block name (Note [Decisions reused], decide.h; null: decide every call afresh).
  DecisionMemos* decisions = nullptr;
  /// The step peak of the previous step (a graph capture must fit on top of it).
  int64_t last_peak = 0;
  /// Ops recorded by the previous call of this block (the recorder pre-sizes its tables from it).
  size_t expected_ops = 64;
  /// Called by the call whose unpack starts the step's backward (with that call's lock held; null: none). The
  /// Session refreshes every call's DroppedLiveness there (Note [dropped values alive elsewhere]).
  const std::function<void(BlockCall&)>* backward_starts = nullptr;
  /// Likewise for the replay that starts a second backward over the graph: the Session calls
  /// note_second_backward() on every call.
  const std::function<void(BlockCall&)>* second_backward_starts = nullptr;
  /// The step's count of unpacks so far, shared by its calls (Note [A graph held through its backward]; null: none).
  std::atomic<int64_t>* unpack_clock = nullptr;
};

/// Thread-safe for pack/unpack after close_forward(); recording itself happens on the thread that runs the forward.
class BlockCall : public capture::RecorderListener,
                  public RecordSink,
                  public std::enable_shared_from_this<BlockCall> {
 public:
  BlockCall(std::string name, BlockContext context);
  ~BlockCall() override;

  void start_forward();
  /// Ends recording, decides keep/drop for every saved tensor and frees the dropped ones. Recording has stopped
  /// even when it throws (only allocation or the strict contract's checksums can).
  /// `aborted`: the block's forward raised (Note [A block call whose forward raised]).
  void close_forward(bool aborted = false);
  /// Called at step end: releases everything; later unpacks throw.
  void close_step() noexcept;

  /// Registers a tensor autograd saves; returns its slot. `as_itself`: autograd saves this tensor itself, not a
  /// shallow copy (Note [Saved as itself], block_call_replay.cpp): a leaf, or not an output of the node saving it.
  int32_t pack(const at::Tensor& t, bool as_itself = false);
  /// The tensor saved in `slot`, replaying its producers on first need.
  at::Tensor unpack(int32_t slot);
  /// The handle of `slot` is gone (autograd freed the node that saved it): its tensor is no longer needed. When
  /// the last handle goes, everything the block call holds is released. Never throws.
  void release(int32_t slot) noexcept;

  const std::string& name() const { return name_; }
  uint64_t signature() const { return signature_; }
  /// Note [Forwards whose graph died]: 1 when the forward closed, saved tensors, and autograd released every one
  /// of them without an unpack (the graph died unused); 0 when some is still held or was unpacked; -1 when it
  /// saved none (nothing tells).
  int forward_died() const;
  BlockStats stats() const;
  /// Note [dropped values alive elsewhere]. A dropped saved tensor can stay alive without this call: a module stores
  /// it on itself, a later block reads it. Dropping it frees nothing while it is; the peak models, calibrated on a
  /// step that dropped it, would count its bytes twice for a plan that keeps it (once in the measured constants,
  /// once as kept). Alive means its storage still holds the allocation it had at the drop (a view the module stored
  /// keeps the saved view's storage). Looked at when the step's backward starts (its first unpack, through
  /// BlockContext::backward_starts): alive then, it was alive from the drop on (a freed storage stays freed); what
  /// died before (autocast's cast cache, cleared at the end of the autocast region) is not counted. The backward
  /// records which were alive at their first unpack. The converse is counted at the same point: the inputs the
  /// call holds for its replay that nothing else holds (a block input the forward did not save, as when autocast
  /// casts it first) are freed by a plan that replays nothing. And when a second backward runs over the graph
  /// (retain_graph=True, create_graph=True), the values the first rebuilt that are still alive then (a graph the
  /// first backward created holds them) are recorded: a plan that keeps them holds them no longer.
  void refresh_alive_dropped();
  /// refresh_alive_dropped() with the call's lock already held (from its own unpack).
  void refresh_alive_dropped_locked();
  /// A second backward over the step's graph begins: records which values the first rebuilt are still alive.
  void note_second_backward();
  void note_second_backward_locked();
  /// The call's DroppedLiveness (values as of the last refresh_alive_dropped(), and alive at their first unpack so far).
  DroppedLiveness liveness() const;
  /// Note [A graph held through its backward]: the call's served slots all outlived the step's last unpack, made
  /// after this call's last one (`final_unpacks`: the step's unpack clock at its end).
  bool held_through_backward(int64_t final_unpacks) const;
  /// The dropped values in the order this call's backward first unpacked them, followed by those it never unpacked
  /// (in the schedule's order), with when each was last unpacked; empty when no dropped value was unpacked.
  UnpackObservation observed_order() const;
  /// Names of the recorded ops, in order.
  std::vector<std::string> op_names() const;
  const std::unordered_map<capture::OpKind, int64_t>& replayed_by_kind() const { return replay_stats_.ops_by_kind; }

  void on_op_recorded(capture::Recorder& recorder, capture::OpIndex op) override;
  void record(ValueId v, const std::string& status, int64_t bytes, int64_t ns, std::string detail) const override;

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
    bool unpacked = false;  // served to the backward at least once
    int64_t last_round = -1;  // the unpack round in which this slot was last unpacked
    // The tensor autograd saved (weak), and whether autograd saves it as itself: then a storage replaced after the
    // forward (`.data = ...`, set_) is what the unpack serves (Note [Saved as itself], block_call_replay.cpp).
    c10::weak_intrusive_ptr<c10::TensorImpl> origin{c10::intrusive_ptr<c10::TensorImpl>()};
    bool as_itself = false;
    // as_itself: the saved tensor, held until the forward closes (Note [Rebound inside the block]).
    c10::intrusive_ptr<c10::TensorImpl> held_origin;
    // Dropped: the storage the saved tensor had, its data pointer and size then (see Note [a dropped tensor still
    // alive], block_call_replay.cpp).
    const void* storage = nullptr;
    const void* storage_data = nullptr;
    size_t storage_nbytes = 0;
    // Dropped: its storage (weak), alive while anything else holds it (Note [dropped values alive elsewhere]).
    c10::weak_intrusive_ptr<c10::StorageImpl> storage_weak{c10::intrusive_ptr<c10::StorageImpl>()};
  };

  // close_forward(), in order.
  void keep_rebound(std::vector<c10::intrusive_ptr<c10::TensorImpl>>& origins);
  void take_recording();
  /// decide_keep() for this call, or the memo's decision when its key matches (Note [Decisions reused]); sets memo_.
  KeepDecision decide();
  void observe(const KeepDecision& d);
  void prepare_approx(KeepDecision& d);
  std::vector<Read> drop(const KeepDecision& d);
  /// Takes back the allocator marks drop() set on dropped storages still alive (Note [Dropped bytes still alive]).
  /// Marks the dropped slots' storages still alive (Note [Dropped bytes still alive]), tagged with this call.
  void mark_alive(const std::vector<const Slot*>& dropped_slots);
  void unmark_alive() noexcept;
  void trim_live(const std::vector<Read>& targets);

  // One replay of the schedule's segment (Note [Replay schedule] in schedule.h; block_call_schedule.cpp).
  struct SegmentInputs {
    int32_t segment = -1;
    std::vector<Read> targets;
    /// Values the replay also returns because a later segment holds them.
    std::vector<ValueId> extras;
    PruneResult plan;
    /// What the replay reads live: available_, plus the held values and the rebuilt values still waiting.
    std::vector<uint8_t> available;
    /// Their tensors, by ValueId (empty: live_).
    std::vector<at::Tensor> live;
  };

  // unpack(), in order.
  void begin_backward();
  at::Tensor serve_kept(int32_t slot);
  at::Tensor still_alive(const Slot& s) const;
  at::Tensor replaced_data(const Slot& s) const;
  at::Tensor on_live_storage(const Slot& s) const;
  /// Whether a dropped slot's storage still holds the allocation it had at the drop (held by something else).
  bool storage_alive(const Slot& s) const;
  void replay_for(ValueId wanted);
  std::unordered_map<ValueId, at::Tensor> run_replay(SegmentInputs& in, const std::vector<at::Tensor>& live,
                                                     ValueId wanted);
  void account_replay(int64_t window_start, int64_t allocated_before, int64_t begin_ns, int64_t held_before);
  void keep_rebuilt(std::unordered_map<ValueId, at::Tensor>& out, const std::string& recovered, int64_t replay_ns);

  // The schedule (block_call_schedule.cpp).
  void resolve_schedule(const std::vector<Read>& targets);
  std::vector<ValueId> default_order() const;
  ReplaySchedule default_schedule(const std::vector<Read>& targets) const;
  int32_t segment_of(ValueId v) const;
  SegmentInputs segment_inputs(ValueId wanted);
  void note_unpack(ValueId v);
  void finish_segment(int32_t segment);
  void release_holds(int32_t before);
  void restart_schedule();
  /// Removes `v` from the rebuilt values after its last unpack, or moves it to the held ones when a later segment's
  /// replay still reads it.
  void drop_cached(ValueId v);
  /// `v`'s last unpack of the round happened (it is not needed any more in this round).
  void note_last_unpack(ValueId v);
  /// Bytes of the distinct storages of the rebuilt values waiting for unpacks and of the held ones; with
  /// `later_only`, only the held ones and the rebuilt values of segments after `segment`.
  int64_t block_held_bytes(bool later_only = false, int32_t segment = -1) const;
  /// Drops from in.extras what does not fit under the limit with `in_use` in use, keeping the extras whose rebuild
  /// costs most per byte first; returns the working set of what is left.
  int64_t fit_extras(SegmentInputs& in, int64_t in_use, int64_t limit);

  void resolve_pending(bool final);
  void release_all() noexcept;
  /// Note [Kept values freed with their slots]: lets go of the kept values in live_ that no replay of a dropped value
  /// with a handle left can read, and of the externals it does not hold for the replays alone (Note [Externals freed
  /// with their readers]).
  void release_kept_live() noexcept;
  /// Applies the memory limit to the replay `in`: keeps the extras that fit (fit_extras), then replays all of
  /// in.targets, or only `wanted` when they would not fit (in.plan and in.targets updated); throws MemoryLimitError
  /// when even `wanted` alone cannot fit.
  void limit_targets(SegmentInputs& in, const Read& wanted);
  /// The CUDA device of the tensors this call holds live, or -1 (CPU).
  int live_cuda_device() const;
  /// Replays `targets` through the session's graph cache; empty when it ran nothing (warm-up or fallback: the
  /// caller replays eagerly). Updates the graph fields of the stats.
  std::unordered_map<ValueId, at::Tensor> replay_graph(const SegmentInputs& in, const std::vector<at::Tensor>& live);
  void count_graph_outcome(const GraphReplayOutcome& outcome, const PruneResult& plan);

  std::string name_;
  BlockContext ctx_;
  const SessionOptions& options_;
  int64_t forward_begin_ns_ = 0;
  capture::Recorder recorder_;
  ReplayContract contract_;

  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<int32_t> pending_;
  bool forward_closed_ = false;
  bool aborted_ = false;  // Note [A block call whose forward raised]
  bool step_closed_ = false;
  std::vector<uint8_t> available_;
  std::vector<at::Tensor> live_;
  // Per value (indexed by ValueId, sized by drop()): the state a dropped value was saved at, -1 for a value that
  // was not dropped.
  std::vector<int32_t> value_state_;
  bool dropped(ValueId v) const {
    return v >= 0 && static_cast<size_t>(v) < value_state_.size() && value_state_[static_cast<size_t>(v)] >= 0;
  }
  /// The state dropped value `v` was saved at (asserts it is one).
  int32_t saved_state(ValueId v) const;
  // The dropped values, ascending.
  std::vector<capture::ValueId> dropped_values_;
  // Per value: a dropped value's live handles, and its handles not yet unpacked in this round (a round is one
  // backward over the graph; retain_graph=True starts another); 0 for the others.
  std::vector<int32_t> handles_;
  std::vector<int32_t> remaining_;
  int64_t round_ = 0;
  int64_t alive_slots_ = 0;
  std::unordered_map<capture::ValueId, at::Tensor> cache_;
  ReplayStats replay_stats_;
  std::unique_ptr<BlockApprox> approx_;  // null: exact replay
  int64_t replays_ = 0;
  uint64_t signature_ = 0;
  DecisionMemo* memo_ = nullptr;  // while close_forward() runs: this block name's memo (null: none)
  std::vector<int64_t> graph_op_ns_;         // per tape op, summed over the timed launches
  std::vector<std::string> graph_op_names_;  // op names, taken at the first timed launch (the tape goes at step end)
  // The replay schedule of this call (resolved at close_forward) and its state in the current round.
  ReplaySchedule schedule_;
  std::vector<int32_t> segment_of_;    // per ValueId: its segment, -1 outside the schedule
  std::vector<int32_t> hold_until_;    // per ValueId: held until that segment replayed, -1: not held
  std::vector<int32_t> hold_from_;     // per ValueId: held when a segment from this one on produces it
  std::vector<uint8_t> segment_done_;  // per segment: replayed in this round
  std::unordered_map<ValueId, at::Tensor> held_;
  std::vector<ValueId> unpack_order_;  // dropped values, first unpacks in order
  std::vector<uint8_t> unpacked_;      // per ValueId
  std::vector<int32_t> dies_before_;   // per ValueId: unpack_order_.size() at its last unpack, -1: not yet
  BlockStats closed_stats_;
  // Note [dropped values alive elsewhere]: dropped slots whose storage was alive at the refresh (null before it),
  // the values whose storage was alive at their first unpack, and the inputs held only for the replay.
  std::optional<std::vector<int32_t>> alive_dropped_slots_;
  std::unordered_set<ValueId> alive_at_unpack_;
  int64_t held_for_replay_bytes_ = 0;
  std::unordered_set<const void*> held_for_replay_;  // their storages (storage_key)
  std::vector<capture::OpIndex> first_reader_;       // per ValueId: the first op reading it (built on first use)
  // Data pointers of the dropped storages drop() marked alive, until their free or the step's end.
  std::vector<const void*> marked_alive_;
  int32_t alive_tag_ = -1;  // this call's tag on the memory timeline (StepMemory::alive_tag)
  // The first backward's rebuilt values (weak), and those still alive when a second backward over the graph began.
  std::vector<std::pair<ValueId, c10::weak_intrusive_ptr<c10::StorageImpl>>> rebuilt_first_round_;
  std::vector<int32_t> rebuilt_alive_at_second_;
  int64_t second_backward_ns_ = -1;
  // Note [A graph held through its backward]: the step's unpack clock after this call's last unpack (-1: none), and
  // its value at the first release of a slot this call had served (INT64_MAX: none released).
  int64_t last_unpack_at_ = -1;
  int64_t first_served_release_at_ = INT64_MAX;
};

/// What pack hands to autograd for one saved tensor: unpack() serves it; destruction releases it (autograd
/// destroys it with the graph node that saved it). Shared by the Python handle object; not copyable.
class SavedSlot {
 public:
  SavedSlot(std::shared_ptr<BlockCall> block, int32_t slot) : block_(std::move(block)), slot_(slot) {}
  ~SavedSlot() {
    if (block_) block_->release(slot_);
  }
  /// Hands the slot over (the moved-from handle releases nothing).
  SavedSlot(SavedSlot&& other) noexcept : block_(std::move(other.block_)), slot_(other.slot_) {}
  SavedSlot(const SavedSlot&) = delete;
  SavedSlot& operator=(const SavedSlot&) = delete;
  SavedSlot& operator=(SavedSlot&&) = delete;
  at::Tensor unpack() const { return block_->unpack(slot_); }
  int32_t slot() const { return slot_; }

 private:
  std::shared_ptr<BlockCall> block_;
  int32_t slot_;
};

}  // namespace tapesac::replay
