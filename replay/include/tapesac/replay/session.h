// One TapeSAC instance's runtime across steps: the step (its block calls, memory and statistics), and what persists
// between steps (plans, preservation choices, approximation, captured graphs). The Python package only wires hooks
// to these calls; what happens between steps (planning, preservation choice) is runtime/'s.
//
// Types of a step live in their own headers: SessionOptions and BlockTapeView (session_options.h), BlockCall and
// SavedSlot (block_call.h), the keep/drop decision (decide.h), the replay contract (contract.h), BlockStats
// (block_stats.h), the step's memory (step_memory.h) and its summary (step_summary.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tapesac/allocator/telemetry.h"
#include "tapesac/replay/block_call.h"
#include "tapesac/replay/block_stats.h"
#include "tapesac/replay/session_options.h"
#include "tapesac/replay/step_memory.h"
#include "tapesac/replay/step_summary.h"

namespace tapesac::replay {

/// The runtime state of one TapeSAC instance across steps. Steps run on one thread at a time; pack/unpack of a
/// step's block calls may come from autograd's threads.
class Session {
 public:
  explicit Session(SessionOptions options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// Starts a step; `params` are the model's parameters and buffers (their storages are not activations; their
  /// bytes and their gradients' are the step's memory baseline). Makes the step's memory counter active on this
  /// thread until end_step(), which must run on the same thread.
  void begin_step(const std::vector<at::Tensor>& params);
  /// Ends the step: closes every block call (releasing memory) and keeps their stats. Never throws.
  void end_step() noexcept;
  bool in_step() const { return in_step_; }
  /// An unpack of this step raised (a MemoryLimitError or ReplayContractError in the backward): the step's backward
  /// failed; the step-free mode ends such a step as failed at the next block forward (attach.py). Reset by
  /// begin_step(). Any thread.
  bool backward_failed() const { return backward_failed_->load(std::memory_order_relaxed); }
  void note_backward_error() noexcept { backward_failed_->store(true, std::memory_order_relaxed); }
  /// The flag behind backward_failed(), for a saved-tensor handle that may outlive the Session.
  std::shared_ptr<std::atomic<bool>> backward_failed_flag() const { return backward_failed_; }

  /// Opens a block call (starts recording on this thread). Returns nullptr when a block is already open (nested
  /// blocks record into the outer one).
  std::shared_ptr<BlockCall> begin_block(const std::string& name);
  /// Closes the open block call started by begin_block (no-op when none); the block is closed even if it throws.
  /// `aborted`: its forward raised (Note [A block call whose forward raised], block_call.cpp).
  void end_block(bool aborted = false);
  std::shared_ptr<BlockCall> current_block() const { return current_; }
  /// Note [Forwards whose graph died] (session.cpp): no block call is open, and every block call of the step that
  /// saved tensors had them all released by autograd without an unpack (at least one did).
  bool forwards_died() const;

  const std::vector<BlockStats>& last_stats() const { return last_stats_; }
  /// Per block call of the last step (last_stats() order), its dropped values that were alive anyway (Note
  /// [dropped values alive elsewhere], block_call.h); collected only while a tape observer is set (the planner).
  const std::vector<DroppedLiveness>& last_liveness() const { return last_liveness_; }
  /// The last step's totals and per-step figures (computed from last_stats() and the records).
  const StepSummary& last_summary() const { return last_summary_; }
  /// Replayed op counts of the last step, by op name.
  const std::unordered_map<std::string, int64_t>& last_replayed_by_name() const { return last_replayed_; }
  const SessionOptions& options() const { return options_; }
  /// Memory of the last finished step.
  const StepMemoryStats& last_memory() const { return last_memory_; }
  void set_memory_limit(int64_t bytes);
  void set_graph_memory_limit(int64_t bytes) { options_.graph_memory_limit = bytes; }
  /// Makes every block call follow `shape` instead of its plan's or its default schedule (schedule.h; tests and
  /// diagnosis). Between steps.
  void force_schedule(ForcedSchedule shape);
  /// The shape of a block call without a plan's schedule (SessionOptions::unplanned_schedule; kNone means one
  /// segment). Between steps.
  void set_unplanned_schedule(ForcedSchedule shape);
  /// The plans by block name (replaces the previous ones). Policy kPlan: a block call whose tape signature differs
  /// from its plan's, or without a plan, runs as "full" (BlockStats::planned == false). Every policy: a block call
  /// whose signature matches its plan's follows the plan's replay schedule, others their default schedule.
  void set_plans(std::unordered_map<std::string, BlockPlan> plans);
  const std::unordered_map<std::string, BlockPlan>& plans() const { return plans_; }
  /// Per tape signature, the order in which a step's backward first unpacked the dropped values (the first
  /// observation; Note [Replay schedule] in schedule.h). The default schedules and the planner read it.
  const UnpackOrders& unpack_orders() const { return orders_; }
  /// Called at the end of every block call's forward (after keep/drop is decided), on the forward thread; the
  /// view is valid only during the call. Used by the planner (runtime/auto_planner.h) to build problems and costs.
  void set_tape_observer(TapeObserver observer) { observer_ = std::move(observer); }
  const TapeObserver& tape_observer() const { return observer_; }
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

  /// The memory baseline begin_step(params) records: the distinct storages of `params` and of their gradients, plus
  /// the captured graphs' static bytes.
  int64_t baseline_of(const std::vector<at::Tensor>& params);

 private:
  BlockContext block_context(const std::string& name);
  void collect_block_stats() noexcept;
  void remember_order(const BlockCall& b);
  void collect_memory() noexcept;
  /// The first time `done` is set in a step: `locked` on `caller` (whose lock its unpack holds), `unlocked` on
  /// every other call of the step.
  void once_on_every_call(std::atomic<bool>& done, BlockCall& caller, void (BlockCall::*locked)(),
                          void (BlockCall::*unlocked)());

  SessionOptions options_;
  bool in_step_ = false;
  std::shared_ptr<std::atomic<bool>> backward_failed_ = std::make_shared<std::atomic<bool>>(false);
  std::unordered_set<const void*> param_storages_;
  SaveOpCache save_cache_;
  std::vector<std::shared_ptr<BlockCall>> blocks_;
  std::shared_ptr<BlockCall> current_;
  std::vector<BlockStats> last_stats_;
  std::vector<DroppedLiveness> last_liveness_;
  // Note [dropped values alive elsewhere] (block_call.h): refreshes every call's liveness once per step, when its
  // backward starts (set while a tape observer is).
  std::function<void(BlockCall&)> backward_starts_;
  std::atomic<bool> backward_started_{false};
  std::function<void(BlockCall&)> second_backward_starts_;
  std::atomic<bool> second_backward_started_{false};
  std::atomic<int64_t> unpack_clock_{0};  // Note [A graph held through its backward] (block_call.cpp)
  StepSummary last_summary_;
  std::unordered_map<std::string, int64_t> last_replayed_;
  // Ops recorded per block name in the previous step: the recorder pre-sizes its tables from it.
  std::unordered_map<std::string, size_t> expected_ops_;
  // Installed from the first step until the Session is destroyed (the counting CPU allocator layer).
  std::unique_ptr<allocator::CountingAllocatorUse> allocator_use_;
  std::shared_ptr<StepMemory> memory_;
  std::optional<allocator::ScopedCounter> counter_scope_;
  StepMemoryStats last_memory_;
  std::unordered_map<std::string, BlockPlan> plans_;
  static constexpr size_t kMaxOrders = 1024;  // signatures whose unpack order is remembered
  UnpackOrders orders_;
  DecisionMemos decisions_;  // Note [Decisions reused]: the last decision per block name
  TapeObserver observer_;
  std::shared_ptr<Approx> approx_;
  std::shared_ptr<WriteWatcher> watcher_;
  std::unordered_map<const void*, PreserveMode> preserve_modes_;
  std::unordered_set<const void*> keep_dependents_;
  std::vector<PreservedStorage> last_preserved_;
  std::vector<ReplayRecord> last_records_;
  std::unique_ptr<GraphCache> graphs_;
  int64_t last_peak_ = 0;
};

}  // namespace tapesac::replay
