// Memory telemetry of the CPU allocator: a counting layer over torch's CPU allocator and the counters it feeds.
//
// Contract.
//  * A MemoryCounter counts the CPU tensor allocations made on a thread while it is *active* there (a
//    ScopedCounter on the stack), and the frees of exactly those allocations, on whatever thread they happen.
//    Allocations made before, or on other threads, are not counted — neither when made nor when freed — so
//    `current()` is "bytes allocated inside the scope and still alive" and `peak()` its maximum.
//  * Scopes nest: a counter pushed while another is active counts into both (a MemoryMeter around a step sees
//    what the step's own counter sees).
//  * The counting layer is installed as torch's CPU allocator while at least one CountingAllocatorUse is alive
//    and removed when the last one goes (if nobody replaced it in between). Allocations it made stay valid
//    after removal: their deleter belongs to a process-lifetime object. Threads without an active counter get
//    the inner allocator's own DataPtr unchanged (one thread-local load of overhead). A counted DataPtr keeps
//    context == data, so raw_allocate()/raw_deallocate() (used by oneDNN) keep working; the deleter finds the
//    counted allocation in a sharded table (one lock and one hash-map entry per counted allocation).
//  * Each counter tracks gauges per phase (forward, backward, replay): bytes allocated in the phase, the
//    counter's peak while in the phase, and bytes allocated in the phase still alive. With a timeline enabled
//    it also keeps (time, bytes, phase, replay bytes alive) points, bounded: when full, adjacent pairs are
//    merged keeping the point of the larger value, so the peak is never lost.
//  * Note [Dropped bytes still alive]. A counted allocation can be marked (mark_dropped_alive): a tensor tapesac
//    dropped still lives on it because something else holds it (autocast's cast cache, a module that stored its
//    activation, a later block). Until it is unmarked or freed its bytes are also in the counter's
//    `dropped_alive()` gauge and in every timeline point's `dropped_alive_bytes`, so a reader of the timeline can
//    tell when such bytes died (the cast cache is cleared at the end of the autocast region, which is not the end
//    of the forward nor the start of the backward). A mark may carry a tag (the block call it belongs to): with a
//    timeline enabled, the counter then also logs each change of a tagged mark (marked, unmarked, freed while
//    marked) as an AliveChange, so a reader can tell whose dropped bytes were alive when (the keep-everything
//    ceiling counts them only while their call's dropped bytes are pending).
//  * Thread-safe: gauges are atomics; the timeline has a mutex (taken only when a timeline is enabled).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace tapesac::allocator {

enum class Phase : uint8_t { kForward = 0, kBackward = 1, kReplay = 2 };
constexpr int kNumPhases = 3;
const char* phase_name(Phase p) noexcept;

/// A snapshot of one gauge.
struct Gauge {
  int64_t current = 0;      // bytes allocated (in this phase) and still alive
  int64_t peak = 0;         // the counter's peak while in this phase (for the whole counter: its peak)
  int64_t allocated = 0;    // bytes allocated (in this phase), alive or not
  int64_t allocations = 0;  // number of allocations
};

struct TimelinePoint {
  int64_t t_ns = 0;   // since the counter was created
  int64_t bytes = 0;  // the counter's current bytes after the event
  Phase phase = Phase::kForward;
  int64_t replay_bytes = 0;  // of `bytes`, those allocated in the replay phase and still alive (rebuilt values)
  int64_t dropped_alive_bytes = 0;  // of `bytes`, those marked dropped but still alive (Note [Dropped bytes still alive])
};

/// A change of a tagged mark (Note [Dropped bytes still alive]): `bytes` > 0 marked, < 0 unmarked or freed.
struct AliveChange {
  int64_t t_ns = 0;  // the timeline's clock
  int32_t tag = -1;
  int64_t bytes = 0;
};

class MemoryCounter : public std::enable_shared_from_this<MemoryCounter> {
 public:
  /// `timeline_points`: 0 disables the timeline; otherwise its bound (at least 64).
  explicit MemoryCounter(size_t timeline_points = 0);

  void on_alloc(int64_t bytes, Phase phase) noexcept;
  /// `dropped_alive`: the allocation was marked (Note [Dropped bytes still alive]) with tag `alive_tag` (-1: none);
  /// its bytes leave that gauge too.
  void on_free(int64_t bytes, Phase alloc_phase, bool dropped_alive = false, int32_t alive_tag = -1) noexcept;
  /// `bytes` of the counter's allocations were marked (> 0) or unmarked / freed while marked (< 0) as dropped but
  /// still alive (Note [Dropped bytes still alive]); records a timeline point, and an AliveChange for a tag >= 0.
  void on_dropped_alive(int64_t bytes, int32_t tag = -1) noexcept;
  int64_t dropped_alive() const noexcept { return dropped_alive_.load(std::memory_order_relaxed); }

  void set_phase(Phase p) noexcept;
  Phase phase() const noexcept { return static_cast<Phase>(phase_.load(std::memory_order_relaxed)); }

  Gauge total() const noexcept;
  Gauge phase_gauge(Phase p) const noexcept;
  int64_t current() const noexcept { return current_.load(std::memory_order_relaxed); }
  int64_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  /// Nanoseconds since construction (the timeline's clock).
  int64_t elapsed_ns() const noexcept;
  /// Starts a measurement window (one replay): window_peak() is the peak since, returned relative to `current()`
  /// at the start. One window at a time per counter.
  int64_t begin_window() noexcept;
  int64_t window_peak() const noexcept { return window_peak_.load(std::memory_order_relaxed); }
  std::vector<TimelinePoint> timeline() const;
  /// The changes of tagged marks, in time order (empty without a timeline).
  std::vector<AliveChange> alive_changes() const;

  /// The counter that was active when this one was first pushed (nested scopes count into both).
  const std::shared_ptr<MemoryCounter>& parent() const noexcept { return parent_; }

 private:
  friend class ScopedCounter;
  struct PhaseAtomics {
    std::atomic<int64_t> current{0}, peak{0}, allocated{0}, allocations{0};
  };
  void record(int64_t bytes) noexcept;
  void record_alive(int32_t tag, int64_t bytes) noexcept;

  std::shared_ptr<MemoryCounter> parent_;
  std::atomic<int64_t> current_{0}, peak_{0}, allocated_{0}, allocations_{0}, window_peak_{0}, dropped_alive_{0};
  std::array<PhaseAtomics, kNumPhases> phases_;
  std::atomic<uint8_t> phase_{0};
  int64_t start_ns_;
  size_t max_points_;
  mutable std::mutex timeline_mu_;
  std::vector<TimelinePoint> points_;
  std::vector<AliveChange> alive_changes_;  // guarded by timeline_mu_
};

/// Keeps the counting layer installed as torch's CPU allocator while alive (reference counted).
class CountingAllocatorUse {
 public:
  CountingAllocatorUse();
  ~CountingAllocatorUse();
  CountingAllocatorUse(const CountingAllocatorUse&) = delete;
  CountingAllocatorUse& operator=(const CountingAllocatorUse&) = delete;
  /// Whether the counting layer is torch's CPU allocator right now.
  static bool installed() noexcept;
};

/// Makes `counter` active on this thread for the scope (LIFO). Requires a CountingAllocatorUse to count.
class ScopedCounter {
 public:
  explicit ScopedCounter(std::shared_ptr<MemoryCounter> counter);
  ~ScopedCounter();
  ScopedCounter(const ScopedCounter&) = delete;
  ScopedCounter& operator=(const ScopedCounter&) = delete;

 private:
  std::shared_ptr<MemoryCounter> counter_;
  MemoryCounter* previous_;
};

/// The innermost counter active on this thread (nullptr when none).
MemoryCounter* active_counter() noexcept;

/// Marks the counted allocation whose data pointer is `data` as holding a dropped tensor that is still alive (Note
/// [Dropped bytes still alive]): its bytes join the dropped_alive() gauge of every counter that counted it, until
/// unmark_dropped_alive() or its free. Returns the bytes marked: 0 when `data` is not a counted allocation (made
/// outside any counter, on the GPU) or is marked already. `tag` >= 0: whose bytes these are (the counters log
/// the mark's changes as AliveChange). Any thread.
int64_t mark_dropped_alive(const void* data, int32_t tag = -1) noexcept;
/// Takes a mark back (no-op when `data` is not marked, or freed already; with `tag` >= 0, also when it is marked
/// with another tag: the address was freed and handed out again). Any thread.
void unmark_dropped_alive(const void* data, int32_t tag = -1) noexcept;

}  // namespace tapesac::allocator
