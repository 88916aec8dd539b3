// The counting CPU allocator layer and MemoryCounter (see telemetry.h for the contract).
#include "tapesac/allocator/telemetry.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory_resource>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "tapesac/common/clock.h"

namespace tapesac::allocator {
namespace {

using common::now_ns;

void atomic_max(std::atomic<int64_t>& a, int64_t v) noexcept {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// The counters active on this thread, innermost last. Owning: a scope that ends on another thread, or out of
// order, leaves its counter here (still counting) rather than a dangling pointer.
thread_local std::vector<std::shared_ptr<MemoryCounter>> tls_stack;
thread_local MemoryCounter* tls_active = nullptr;

// Deepest nesting whose per-phase gauges are kept exactly (deeper counters still count totals).
constexpr int kMaxChain = 4;

// What a counted allocation carries to its deleter: the inner allocator's DataPtr (which frees the bytes), the
// counter that saw the allocation (keeping its parent chain alive) and the phase of each counter in the chain.
struct CountedContext {
  c10::DataPtr inner;
  std::shared_ptr<MemoryCounter> counter;
  int64_t bytes = 0;
  std::array<Phase, kMaxChain> phases{};
  bool dropped_alive = false;  // Note [Dropped bytes still alive]
  int32_t alive_tag = -1;      // the mark's tag (-1: none)
};

// Counted allocations by data pointer. A counted DataPtr has context == data (like the default CPU allocator's),
// so Allocator::raw_allocate()/raw_deallocate() keep working (oneDNN's ideep allocates through them); the
// deleter finds the rest here. Sharded to keep the lock uncontended across threads.
class CountedTable {
 public:
  /// Registers a counted allocation. An entry already at `data` is stale: its bytes were freed through
  /// raw_deallocate() while the layer was not installed (the inner deleter ran, the entry stayed) and malloc has
  /// handed the address out again. Its bytes must not be freed twice: its DataPtr lets go of them, and its counts
  /// are taken back.
  void insert(void* data, CountedContext ctx);
  bool take(void* data, CountedContext& out) {
    Shard& sh = shard(data);
    std::lock_guard<std::mutex> lock(sh.mu);
    auto it = sh.map.find(data);
    if (it == sh.map.end()) return false;
    out = std::move(it->second);
    sh.map.erase(it);
    return true;
  }
  /// Sets the entry's dropped_alive flag to `on` (marking with `tag`); the counter, bytes and the mark's tag to
  /// tell when it changed (null otherwise).
  std::shared_ptr<MemoryCounter> set_dropped_alive(const void* data, bool on, int32_t& tag, int64_t& bytes) {
    Shard& sh = shard(data);
    std::lock_guard<std::mutex> lock(sh.mu);
    auto it = sh.map.find(const_cast<void*>(data));
    if (it == sh.map.end() || it->second.dropped_alive == on) return nullptr;
    if (!on && tag >= 0 && it->second.alive_tag != tag) return nullptr;  // another owner's mark (a reused address)
    it->second.dropped_alive = on;
    if (on) it->second.alive_tag = tag;
    tag = it->second.alive_tag;
    bytes = it->second.bytes;
    return it->second.counter;
  }

 private:
  // Note [Counted table without malloc]. One entry per counted allocation, inserted by allocate() and erased by its
  // deleter: with std::unordered_map each entry was a node from malloc and back (~300 of the ~450 instructions the
  // table cost per allocation; perf/bench_record.py's tiny ops allocate 300 times a forward). The nodes come from a
  // pool per shard instead (guarded by the shard's lock, like the map): a freed node is the next insert's.
  struct Shard {
    std::mutex mu;
    std::pmr::unsynchronized_pool_resource pool;
    std::pmr::unordered_map<void*, CountedContext> map{&pool};
  };
  Shard& shard(const void* p) { return shards_[(reinterpret_cast<uintptr_t>(p) >> 6) % kShards]; }
  static constexpr size_t kShards = 64;
  std::array<Shard, kShards> shards_;
};

CountedTable& counted_table() {
  static auto* table = new CountedTable();  // process lifetime, like the allocator
  return *table;
}

// The inner allocator's raw deleter (nullptr when it has none), for pointers the layer did not count.
std::atomic<c10::DeleterFnPtr> inner_raw_deleter{nullptr};

void uncount(const CountedContext& ctx) noexcept;

void delete_counted(void* data) {
  CountedContext ctx;
  if (!counted_table().take(data, ctx)) {
    // Not counted: allocated by the inner allocator directly (pass-through or before the layer was installed)
    // and freed through raw_deallocate() while the layer is installed.
    c10::DeleterFnPtr inner = inner_raw_deleter.load();
    if (inner != nullptr) inner(data);
    return;
  }
  uncount(ctx);
  // ctx.inner goes out of scope here: the inner allocator frees the bytes.
}

void uncount(const CountedContext& ctx) noexcept {
  int depth = 0;
  for (MemoryCounter* c = ctx.counter.get(); c != nullptr; c = c->parent().get(), ++depth) {
    c->on_free(ctx.bytes, depth < kMaxChain ? ctx.phases[static_cast<size_t>(depth)] : c->phase(), ctx.dropped_alive,
               ctx.alive_tag);
  }
}

// Returns the bytes whose mark changed (0: not a counted allocation, or already in that state).
int64_t change_dropped_alive(const void* data, bool on, int32_t tag) noexcept {
  if (data == nullptr) return 0;
  int64_t bytes = 0;
  std::shared_ptr<MemoryCounter> counter;
  try {
    counter = counted_table().set_dropped_alive(data, on, tag, bytes);
  } catch (...) {
    return 0;  // the shard's lock failed: telemetry never fails the caller
  }
  for (MemoryCounter* c = counter.get(); c != nullptr; c = c->parent().get()) {
    c->on_dropped_alive(on ? bytes : -bytes, tag);
  }
  return counter ? bytes : 0;
}

void CountedTable::insert(void* data, CountedContext ctx) {
  CountedContext stale;
  {
    Shard& sh = shard(data);
    std::lock_guard<std::mutex> lock(sh.mu);
    auto [it, inserted] = sh.map.try_emplace(data, std::move(ctx));
    if (inserted) return;
    stale = std::move(it->second);
    it->second = std::move(ctx);
  }
  (void)stale.inner.release_context();  // already freed by the inner allocator's deleter
  uncount(stale);
}

// Installed as torch's CPU allocator; forwards to the allocator it replaced.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    MemoryCounter* active = tls_active;
    if (active == nullptr || inner.get() == nullptr) {
      return inner;
    }
    void* data = inner.get();
    const c10::Device device = inner.device();
    CountedContext ctx{std::move(inner), active->shared_from_this(), static_cast<int64_t>(n), {}};
    int depth = 0;
    for (MemoryCounter* c = active; c != nullptr && depth < kMaxChain; c = c->parent().get(), ++depth) {
      ctx.phases[static_cast<size_t>(depth)] = c->phase();
    }
    const auto phases = ctx.phases;
    const int64_t bytes = ctx.bytes;
    counted_table().insert(data, std::move(ctx));  // may throw (out of memory): nothing counted yet
    depth = 0;
    for (MemoryCounter* c = active; c != nullptr; c = c->parent().get(), ++depth) {
      c->on_alloc(bytes, depth < kMaxChain ? phases[static_cast<size_t>(depth)] : c->phase());
    }
    return c10::DataPtr(data, data, &delete_counted, device);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return inner_raw_deleter.load() != nullptr ? &delete_counted : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }

  void install() {
    std::lock_guard<std::mutex> lock(mu_);
    if (uses_++ > 0) return;
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current == this) return;  // left installed by a use that could not uninstall (see below)
    inner_ = current;
    inner_raw_deleter.store(current->raw_deleter());
    // Priority 255: only an allocator registered with the top priority could override ours.
    c10::SetCPUAllocator(this, /*priority=*/255);
  }

  void uninstall() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--uses_ > 0) return;
    // Someone else may have installed an allocator over ours: then leave theirs (it may forward to us).
    if (c10::GetCPUAllocator() == this) c10::SetCPUAllocator(inner_, /*priority=*/255);
  }

  bool is_installed() const noexcept { return c10::GetCPUAllocator() == this; }

 private:
  std::mutex mu_;
  int uses_ = 0;
  c10::Allocator* inner_ = nullptr;
};

// Process lifetime (never destroyed): counted allocations may outlive every user of the layer.
CountingCpuAllocator& counting_allocator() {
  static auto* alloc = new CountingCpuAllocator();
  return *alloc;
}

}  // namespace

const char* phase_name(Phase p) noexcept {
  switch (p) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kReplay: return "replay";
  }
  return "?";
}

MemoryCounter::MemoryCounter(size_t timeline_points)
    : start_ns_(now_ns()), max_points_(timeline_points == 0 ? 0 : std::max<size_t>(timeline_points, 64)) {
  if (max_points_ > 0) points_.reserve(std::min<size_t>(max_points_, 4096));
}

void MemoryCounter::on_alloc(int64_t bytes, Phase phase) noexcept {
  int64_t cur = current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  atomic_max(peak_, cur);
  atomic_max(window_peak_, cur);
  allocated_.fetch_add(bytes, std::memory_order_relaxed);
  allocations_.fetch_add(1, std::memory_order_relaxed);
  auto& g = phases_[static_cast<int>(phase)];
  g.current.fetch_add(bytes, std::memory_order_relaxed);
  g.allocated.fetch_add(bytes, std::memory_order_relaxed);
  g.allocations.fetch_add(1, std::memory_order_relaxed);
  atomic_max(phases_[static_cast<int>(this->phase())].peak, cur);
  if (max_points_ > 0) record(cur);
}

void MemoryCounter::on_free(int64_t bytes, Phase alloc_phase, bool dropped_alive, int32_t alive_tag) noexcept {
  if (dropped_alive) dropped_alive_.fetch_sub(bytes, std::memory_order_relaxed);
  int64_t cur = current_.fetch_sub(bytes, std::memory_order_relaxed) - bytes;
  phases_[static_cast<int>(alloc_phase)].current.fetch_sub(bytes, std::memory_order_relaxed);
  if (max_points_ > 0) {
    if (dropped_alive && alive_tag >= 0) record_alive(alive_tag, -bytes);  // before the point: gone at its time
    record(cur);
  }
}

void MemoryCounter::on_dropped_alive(int64_t bytes, int32_t tag) noexcept {
  dropped_alive_.fetch_add(bytes, std::memory_order_relaxed);
  if (max_points_ > 0) {
    if (tag >= 0) record_alive(tag, bytes);
    record(current());
  }
}

void MemoryCounter::record_alive(int32_t tag, int64_t bytes) noexcept {
  const AliveChange c{now_ns() - start_ns_, tag, bytes};
  std::lock_guard<std::mutex> lock(timeline_mu_);
  try {
    alive_changes_.push_back(c);  // a few per block call (its dropped tensors something else holds)
  } catch (...) {
    // Out of memory: the change is lost (telemetry never fails an allocation).
  }
}

void MemoryCounter::set_phase(Phase p) noexcept {
  phase_.store(static_cast<uint8_t>(p), std::memory_order_relaxed);
  atomic_max(phases_[static_cast<int>(p)].peak, current());
  if (max_points_ > 0) record(current());
}

int64_t MemoryCounter::begin_window() noexcept {
  const int64_t cur = current();
  window_peak_.store(cur, std::memory_order_relaxed);
  return cur;
}

void MemoryCounter::record(int64_t bytes) noexcept {
  TimelinePoint p{now_ns() - start_ns_, bytes, phase(),
                  phases_[static_cast<int>(Phase::kReplay)].current.load(std::memory_order_relaxed),
                  dropped_alive_.load(std::memory_order_relaxed)};
  std::lock_guard<std::mutex> lock(timeline_mu_);
  try {
    if (points_.size() >= max_points_) {
      // Merge adjacent pairs, keeping the larger level (and the later time of the pair's phase change).
      size_t out = 0;
      for (size_t i = 0; i + 1 < points_.size(); i += 2) {
        const TimelinePoint& a = points_[i];
        const TimelinePoint& b = points_[i + 1];
        points_[out++] = a.bytes >= b.bytes ? a : b;
      }
      if (points_.size() % 2 == 1) points_[out++] = points_.back();
      points_.resize(out);
    }
    points_.push_back(p);
  } catch (...) {
    // Out of memory while growing the timeline: drop the point (telemetry never fails an allocation).
  }
}

Gauge MemoryCounter::total() const noexcept {
  return Gauge{current_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
               allocated_.load(std::memory_order_relaxed), allocations_.load(std::memory_order_relaxed)};
}

Gauge MemoryCounter::phase_gauge(Phase p) const noexcept {
  const auto& g = phases_[static_cast<int>(p)];
  return Gauge{g.current.load(std::memory_order_relaxed), g.peak.load(std::memory_order_relaxed),
               g.allocated.load(std::memory_order_relaxed), g.allocations.load(std::memory_order_relaxed)};
}

int64_t MemoryCounter::elapsed_ns() const noexcept { return now_ns() - start_ns_; }

std::vector<TimelinePoint> MemoryCounter::timeline() const {
  std::lock_guard<std::mutex> lock(timeline_mu_);
  return points_;
}

std::vector<AliveChange> MemoryCounter::alive_changes() const {
  std::lock_guard<std::mutex> lock(timeline_mu_);
  return alive_changes_;
}

CountingAllocatorUse::CountingAllocatorUse() { counting_allocator().install(); }
CountingAllocatorUse::~CountingAllocatorUse() { counting_allocator().uninstall(); }
bool CountingAllocatorUse::installed() noexcept { return counting_allocator().is_installed(); }

ScopedCounter::ScopedCounter(std::shared_ptr<MemoryCounter> counter)
    : counter_(std::move(counter)), previous_(tls_active) {
  if (previous_ != nullptr && !counter_->parent_ && previous_ != counter_.get()) {
    // Never create a cycle: only adopt a parent chain that does not contain this counter.
    bool cycle = false;
    for (MemoryCounter* c = previous_; c != nullptr; c = c->parent().get()) cycle |= (c == counter_.get());
    if (!cycle) counter_->parent_ = previous_->shared_from_this();
  }
  tls_stack.push_back(counter_);
  tls_active = counter_.get();
}

ScopedCounter::~ScopedCounter() {
  // Remove this scope's entry wherever it sits on this thread's stack (scopes normally end in LIFO order on the
  // thread that began them; one ended elsewhere leaves its entry, owned, on the original thread).
  for (auto it = tls_stack.rbegin(); it != tls_stack.rend(); ++it) {
    if (it->get() == counter_.get()) {
      tls_stack.erase(std::next(it).base());
      break;
    }
  }
  tls_active = tls_stack.empty() ? nullptr : tls_stack.back().get();
}

MemoryCounter* active_counter() noexcept { return tls_active; }

int64_t mark_dropped_alive(const void* data, int32_t tag) noexcept { return change_dropped_alive(data, true, tag); }

void unmark_dropped_alive(const void* data, int32_t tag) noexcept { change_dropped_alive(data, false, tag); }

}  // namespace tapesac::allocator
