// Preservation of external state that changes between a block's forward and its replay.
//
// A replay reads *live* tensors: block inputs, parameters, buffers and other tensors the block did not create. When
// the step writes one of them in place after the block's forward (a memory bank updated in a few rows, a queue
// rotated, an input modified), the replay would see different bytes than the forward did. The WriteWatcher sees
// every top-level in-place op on the stepping thread while it is installed; for a storage some block's replay will
// read (watch()), it saves, just before the write, what restore() needs to give the replay the bytes the forward
// saw:
//   * kRegions: only the old entries of the region the op overwrites (the written view; or the rows of index_put_/
//     index_copy_/index_fill_/index_add_/index_reduce_, the gathered entries of scatter_*, the masked entries of
//     masked_fill_/masked_scatter_). At replay they are swapped back into the storage itself, newest write first,
//     and the step's entries are put back when the replay is done (Swap): only the regions are copied, never the
//     storage, and replays that swap are serialized;
//   * kSnapshots: the whole storage, copied at its first write after a block read it; the replay reads a view of
//     that snapshot instead of the tensor (no further copy).
// The watcher sees writes for the whole step on the stepping thread: while forwards run, between the forward and the
// backward (where a step updates a bank or a queue), inside the backward (a tensor hook) and between two backwards
// of one step (see Note [watching the backward]). The version counter guards completeness:
// when a tensor's version moved by more than the writes the watcher saw (a write on another thread, or one that
// bypassed the dispatcher), restore() refuses and the replay is rejected.
//
// Note [watching the backward]: the watcher used to pause when the backward started (seeing writes costs a boxed copy
// of every op's arguments). But a write through `.data` (or another detached alias) does not move the version
// counter, so one made in a backward hook or between two backwards of a step (loss1.backward(retain_graph=True);
// w.data.mul_(0.5); loss2.backward()) reached the next replay silently: wrong gradients with no error (issue 18
// item 2). Seeing it costs the boxed arguments of the backward's ops on the stepping thread; the CUDA backward runs
// on autograd's device threads, which the thread-local callback does not see (there, such a write is still unseen).
// pause() and resume() remain for callers that know no write can happen.
//
// Threads: install(), resume(), the writes it sees and end() happen on the stepping thread; watch() and restore() are
// called under the owning BlockCall's lock, from the forward thread and the backward's threads — the watcher's own
// mutex orders them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include "tapesac/capture/dispatch_hook.h"

namespace tapesac::replay {

// Note [Writes counted under preserve="off"]: kOff saves nothing, but its watcher still counts the writes it sees to
// the storages replays read, so that one which moves no version counter (`.data`, an alias made by set_,
// untyped_storage().copy_) rejects the replay like an in-place op does, instead of reaching it silently.
enum class PreserveMode : uint8_t {
  kOff,        // nothing saved: a changed input rejects the replay (ReplayContractError)
  kRegions,    // save the overwritten regions' old bytes
  kSnapshots,  // save the whole storage at its first write
};

const char* preserve_mode_name(PreserveMode m);

/// Measured figures of one watched storage in one step (reported, and the planner's input for the choice).
struct PreservedStorage {
  PreserveMode mode = PreserveMode::kRegions;
  const void* key = nullptr;  // the StorageImpl (identity within the process; stable across steps for a buffer)
  int64_t nbytes = 0;         // storage size
  int64_t writes = 0;         // writes seen after a block read it
  int64_t held_bytes = 0;     // bytes saved to undo them (regions or snapshots), held until the step ends
  int64_t save_ns = 0;        // time spent saving at the writes
  int64_t restores = 0;       // private copies rebuilt for replays
  int64_t restore_ns = 0;     // time spent rebuilding them
  /// When the last save was made (-1: none): WriteWatcher::stats() gives it on common::now_ns()'s clock,
  /// Session::last_preserved() on the step's memory clock (ns since the step began, as the timeline's points).
  int64_t last_save_ns = -1;
  /// Every save that held bytes: (when, on the same clock as last_save_ns; the bytes it added to held_bytes). The
  /// planner subtracts each from its own moment on (random programs 645, 2575 and six more: a write made in each of
  /// two backwards, both copies counted from the second one, so keeping everything was predicted one copy above the
  /// no-checkpoint peak and auto dropped values at that limit).
  std::vector<std::pair<int64_t, int64_t>> saves;
};

class WriteWatcher : private capture::CallObserver {
 public:
  struct Write;
  /// `overrides`: the mode of particular storages (kRegions or kSnapshots), e.g. as the planner chose them.
  explicit WriteWatcher(PreserveMode mode, std::unordered_map<const void*, PreserveMode> overrides = {});
  ~WriteWatcher();
  WriteWatcher(const WriteWatcher&) = delete;
  WriteWatcher& operator=(const WriteWatcher&) = delete;

  PreserveMode mode() const { return mode_; }
  /// Starts seeing writes on this thread (through the dispatch hook, or a thread-local RecordFunction callback where
  /// the recorder uses one: capture::default_recorder_hook()). Idempotent.
  void install();
  /// Stops seeing writes but keeps what was saved (called when the backward starts: seeing writes costs a boxed
  /// copy of every op's arguments, and the backward's own ops write no watched tensor). Later writes are caught by
  /// the version check only, and rejected. Any thread; never throws.
  void pause() noexcept;
  /// Sees writes again after pause() (a block's forward starts again within the step, e.g. gradient accumulation).
  void resume();
  /// Stops seeing writes and releases everything saved. Never throws.
  void end() noexcept;

  /// Note [a storage reallocated unseen]: looks at every watched storage's allocation (its bytes and address) and
  /// marks the ones that changed since as reallocated, so their next writes are refills. Called at block boundaries
  /// (a block's forward starting, a replay starting): FSDP2 frees a parameter after its block's forward and
  /// reallocates it before its backward, with other blocks in between. Never throws.
  void check_allocations() noexcept;

  /// A replay will read `t`: from now on, writes to its storage are saved. Returns the mark to restore to (the
  /// number of writes already seen on the storage).
  int64_t watch(const at::Tensor& t);

  /// While alive, the overwritten regions of one storage hold the bytes the forward saw (kRegions); destruction
  /// puts the step's bytes back. Holds the watcher's swap lock (replays that swap are serialized).
  class Swap {
   public:
    ~Swap();
    Swap(const Swap&) = delete;
    Swap& operator=(const Swap&) = delete;

   private:
    friend class WriteWatcher;
    explicit Swap(std::recursive_mutex& mu) : lock_(mu) {}
    std::unique_lock<std::recursive_mutex> lock_;
    at::Tensor storage_;                // bytes of the storage (the real one)
    std::vector<const Write*> writes_;  // oldest first
    std::vector<at::Tensor> current_;   // the step's entries of each region, oldest first
  };
  struct Restored {
    at::Tensor copy;              // kSnapshots: a tensor with t's view over the snapshot
    std::unique_ptr<Swap> swap;   // kRegions: keep alive while the replay runs
  };
  /// Makes the bytes `t` had at `mark` available to a replay, when every version bump since (`version_delta`) is a
  /// write the watcher saved: kSnapshots returns a view of the snapshot to read instead of `t`; kRegions swaps the
  /// overwritten regions of t's storage back to their old bytes until the returned Swap is destroyed (the replay
  /// reads `t` itself). Returns neither and sets `why` when it cannot.
  Restored restore(const at::Tensor& t, int64_t mark, uint32_t version_delta, std::string* why);

  /// Writes the watcher saved on t's storage since `mark` (also those that bypass version counters, e.g. through
  /// `.data`).
  /// `unfilled` (when given): set to why when t's storage was emptied or reallocated since the watch (unseen by the
  /// operator calls) and its bytes were not all written again since — a replay reading it would read the allocator's
  /// bytes (Note [a storage reallocated unseen], read unfilled).
  int64_t writes_since(const at::Tensor& t, int64_t mark, std::string* unfilled = nullptr);

  std::vector<PreservedStorage> stats() const;
  int64_t held_bytes() const;

  /// `t` is a saved tensor a block call dropped (Note [A dropped value on a live storage], block_call_replay.cpp):
  /// at the first write the watcher sees to its storage while that storage is still alive (a `.data` write to the
  /// block's output by the next block, a hook, the user), the watcher keeps the storage until end(), so that the
  /// unpack serves the written bytes, which autograd's saved tensor would read, instead of replaying older ones.
  void keep_if_written(const at::Tensor& t);
  /// Whether the storage `key` (a StorageImpl) was kept by keep_if_written(): written while alive.
  bool kept_written(const void* key) const;

 private:
  struct Entry;
  static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn);
  static void on_exit(const at::RecordFunction& fn, at::ObserverContext* ctx);
  bool on_call_enter(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int depth) noexcept override;
  void on_call_exit(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> returns) noexcept override;
  /// Removes the hook or the callback (owner thread).
  void detach() noexcept;
  static at::Tensor take(const Write& w, const at::Tensor& region);
  /// The region `op` is about to write in `target` (its argument `arg`), with the bytes it overwrites.
  static Write region_write(const char* op, c10::ArrayRef<c10::IValue> inputs, size_t arg, const at::Tensor& target);
  /// Bytes a saved write holds (the overwritten values, its indices or mask).
  static int64_t held_bytes(const Write& w);
  static void put(const Write& w, at::Tensor& region, const at::Tensor& values);
  void attach();
  /// A call from user code: saves what it is about to write on watched storages.
  void see(const char* name, c10::ArrayRef<c10::IValue> inputs,
           const std::function<std::optional<c10::OperatorName>()>& operator_name);
  /// True for an operator call, false for a named region (Note [Operator calls by name]). Owner thread only.
  bool operator_call(const at::RecordFunction& fn);
  void save(Entry& e, const std::string& op, c10::ArrayRef<c10::IValue> inputs, size_t arg, const at::Tensor& target);
  /// True when a write into a storage reallocated unseen refills bytes not written since (not saved, not counted);
  /// `first`: the write that showed the reallocation (Note [a storage reallocated unseen]).
  static bool refills(Entry& e, const char* op, size_t arg, const at::Tensor& target, bool first);
  /// Note [a storage reallocated unseen], seen freed (preserve.cpp): puts the watcher's hold on a CPU allocator's
  /// allocation, so that its free is counted; release_allocation() gives the allocator's DataPtr back.
  static void hold_allocation(Entry& e, c10::StorageImpl& s);
  static void release_allocation(Entry& e) noexcept;
  /// hold_allocation(), and the entry joins unheld_ (once) when nothing could be held.
  void hold(Entry& e, c10::StorageImpl& s);
  /// True when the storage's allocation is no longer the one the entry last saw (let go of while held, or another size
  /// or address); the entry is then marked reallocated — keeping its bytes (its saved writes still undo), or not (its
  /// next writes refill it).
  bool allocation_changed(Entry& e, c10::StorageImpl& s);
  /// After a call that refilled watched storages: compares their probe samples inside the refilled bytes with the
  /// watched ones (Note [a storage reallocated unseen], refilled with other bytes, preserve.cpp).
  void check_probes() noexcept;

  PreserveMode mode_;
  std::unordered_map<const void*, PreserveMode> overrides_;
  mutable std::mutex mu_;
  std::recursive_mutex swap_mu_;
  std::unordered_map<const void*, std::unique_ptr<Entry>> entries_;
  std::vector<Entry*> unheld_;  // entries whose allocation was not held when watched: check_allocations() checks them
  std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> dropped_;  // keep_if_written()
  std::unordered_map<const void*, c10::Storage> written_dropped_;  // dropped storages written while alive: held until end()
  std::unordered_map<const char*, std::vector<bool>> writes_by_name_;
  std::unordered_set<const char*> operator_names_;  // see operator_call()
  at::CallbackHandle callback_ = 0;
  bool attached_ = false;  // the hook or the callback is in place on the owner thread
  bool hooked_ = false;    // through the dispatch hook (else callback_)
  std::thread::id owner_;
  std::atomic<bool> paused_{false};
  int depth_ = 0;
  bool busy_ = false;
  struct PendingProbe {
    Entry* entry;
    int64_t lo, hi;  // the refilled bytes
  };
  std::vector<PendingProbe> probes_after_;  // check_probes() after the current call
};

}  // namespace tapesac::replay
