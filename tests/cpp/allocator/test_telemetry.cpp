// Tests of the counting CPU allocator layer and MemoryCounter (allocator/telemetry.h) with real torch tensors.
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include "tapesac/allocator/telemetry.h"

namespace tapesac::allocator {
namespace {

TEST(CountingAllocator, InstalledWhileUsedAndRestoredAfter) {
  c10::Allocator* before = c10::GetCPUAllocator();
  {
    CountingAllocatorUse use;
    EXPECT_TRUE(CountingAllocatorUse::installed());
    {
      CountingAllocatorUse nested;
      EXPECT_TRUE(CountingAllocatorUse::installed());
    }
    EXPECT_TRUE(CountingAllocatorUse::installed());
  }
  EXPECT_FALSE(CountingAllocatorUse::installed());
  EXPECT_EQ(c10::GetCPUAllocator(), before);
}

TEST(CountingAllocator, CountsExactBytesOfScopedAllocationsAndTheirFrees) {
  CountingAllocatorUse use;
  auto counter = std::make_shared<MemoryCounter>();
  at::Tensor outside = at::empty({100}, at::kFloat);  // not counted: no scope yet
  {
    ScopedCounter scope(counter);
    at::Tensor a = at::empty({1000}, at::kFloat);  // 4000 bytes
    at::Tensor b = at::empty({250}, at::kDouble);  // 2000 bytes
    EXPECT_EQ(counter->current(), 6000);
    a.reset();
    EXPECT_EQ(counter->current(), 2000);
    outside.reset();  // freeing an uncounted tensor changes nothing
    EXPECT_EQ(counter->current(), 2000);
  }
  EXPECT_EQ(counter->current(), 0);
  EXPECT_EQ(counter->peak(), 6000);
  EXPECT_EQ(counter->total().allocated, 6000);
  EXPECT_EQ(counter->total().allocations, 2);
}

TEST(CountingAllocator, NestedScopesCountIntoBoth) {
  CountingAllocatorUse use;
  auto outer = std::make_shared<MemoryCounter>();
  auto inner = std::make_shared<MemoryCounter>();
  ScopedCounter s1(outer);
  at::Tensor a = at::empty({10}, at::kFloat);
  {
    ScopedCounter s2(inner);
    at::Tensor b = at::empty({20}, at::kFloat);
    EXPECT_EQ(inner->current(), 80);
    EXPECT_EQ(outer->current(), 120);
  }
  EXPECT_EQ(inner->current(), 0);
  EXPECT_EQ(outer->current(), 40);
  EXPECT_EQ(outer->peak(), 120);
}

TEST(CountingAllocator, FreeOnAnotherThreadIsCounted) {
  CountingAllocatorUse use;
  auto counter = std::make_shared<MemoryCounter>();
  at::Tensor t;
  {
    ScopedCounter scope(counter);
    t = at::empty({256}, at::kFloat);
  }
  EXPECT_EQ(counter->current(), 1024);
  std::thread([&t] { t.reset(); }).join();
  EXPECT_EQ(counter->current(), 0);
}

TEST(CountingAllocator, OtherThreadsAreNotCounted) {
  CountingAllocatorUse use;
  auto counter = std::make_shared<MemoryCounter>();
  ScopedCounter scope(counter);
  std::thread([] { at::Tensor t = at::empty({1000}, at::kFloat); }).join();
  EXPECT_EQ(counter->total().allocated, 0);
}

TEST(CountingAllocator, CountedMemoryOutlivesTheLayer) {
  auto counter = std::make_shared<MemoryCounter>();
  at::Tensor t;
  {
    CountingAllocatorUse use;
    ScopedCounter scope(counter);
    t = at::ones({64}, at::kFloat);
  }
  EXPECT_FALSE(CountingAllocatorUse::installed());
  EXPECT_EQ(t.sum().item<float>(), 64.0f);
  t.reset();  // freed through the layer's deleter after the layer was removed
  EXPECT_EQ(counter->current(), 0);
}

TEST(CountingAllocator, RawAllocateAndDeallocateWork) {
  // oneDNN allocates through raw_allocate()/raw_deallocate(): a counted DataPtr must keep context == data.
  CountingAllocatorUse use;
  auto counter = std::make_shared<MemoryCounter>();
  c10::Allocator* alloc = c10::GetCPUAllocator();
  ASSERT_NE(alloc->raw_deleter(), nullptr);
  void* uncounted = alloc->raw_allocate(128);
  {
    ScopedCounter scope(counter);
    void* p = alloc->raw_allocate(512);
    EXPECT_EQ(counter->current(), 512);
    alloc->raw_deallocate(p);
    EXPECT_EQ(counter->current(), 0);
  }
  alloc->raw_deallocate(uncounted);  // made without a counter: goes to the inner allocator's deleter
}

TEST(MemoryCounter, PhasesAttributeAllocationsAndFrees) {
  CountingAllocatorUse use;
  auto counter = std::make_shared<MemoryCounter>();
  ScopedCounter scope(counter);
  counter->set_phase(Phase::kForward);
  at::Tensor f = at::empty({100}, at::kFloat);
  counter->set_phase(Phase::kReplay);
  at::Tensor r = at::empty({50}, at::kFloat);
  counter->set_phase(Phase::kBackward);
  f.reset();  // freed in backward, but allocated in forward: forward's alive bytes drop
  const Gauge fw = counter->phase_gauge(Phase::kForward);
  const Gauge rp = counter->phase_gauge(Phase::kReplay);
  EXPECT_EQ(fw.allocated, 400);
  EXPECT_EQ(fw.current, 0);
  EXPECT_EQ(fw.peak, 400);
  EXPECT_EQ(rp.allocated, 200);
  EXPECT_EQ(rp.current, 200);
  EXPECT_EQ(rp.peak, 600);
  EXPECT_EQ(counter->phase_gauge(Phase::kBackward).allocated, 0);
}

TEST(MemoryCounter, WindowPeakIsRelativeToItsStart) {
  CountingAllocatorUse use;
  auto counter = std::make_shared<MemoryCounter>();
  ScopedCounter scope(counter);
  at::Tensor a = at::empty({1000}, at::kFloat);
  const int64_t start = counter->begin_window();
  { at::Tensor b = at::empty({10}, at::kFloat); }
  EXPECT_EQ(counter->window_peak() - start, 40);
}

TEST(MemoryCounter, TimelineIsBoundedAndKeepsThePeak) {
  auto counter = std::make_shared<MemoryCounter>(/*timeline_points=*/64);
  int64_t peak = 0;
  for (int i = 0; i < 1000; ++i) {
    const int64_t n = (i == 617) ? 1 << 20 : 8 + (i % 7);
    counter->on_alloc(n, Phase::kForward);
    peak = std::max(peak, counter->current());
    counter->on_free(n, Phase::kForward);
  }
  const auto points = counter->timeline();
  EXPECT_LE(points.size(), 64u);
  int64_t seen = 0;
  for (const auto& p : points) seen = std::max(seen, p.bytes);
  EXPECT_EQ(seen, peak);
  for (size_t i = 1; i < points.size(); ++i) EXPECT_LE(points[i - 1].t_ns, points[i].t_ns);
}

// The sequence peak model's backward levels (planner/peak_model.h, Note [Backward levels]) read the replays' bytes
// alive at every point: allocated in the replay phase, freed in whatever phase.
TEST(MemoryCounter, TimelinePointsCarryTheReplayBytesAlive) {
  auto counter = std::make_shared<MemoryCounter>(/*timeline_points=*/64);
  counter->set_phase(Phase::kBackward);
  counter->on_alloc(100, Phase::kBackward);
  counter->set_phase(Phase::kReplay);
  counter->on_alloc(30, Phase::kReplay);
  counter->set_phase(Phase::kBackward);
  counter->on_alloc(7, Phase::kBackward);
  counter->on_free(30, Phase::kReplay);
  const auto points = counter->timeline();
  std::vector<int64_t> bytes, replay;
  for (const auto& p : points) {
    bytes.push_back(p.bytes);
    replay.push_back(p.replay_bytes);
  }
  EXPECT_EQ(bytes, (std::vector<int64_t>{0, 100, 100, 130, 130, 137, 107}));
  EXPECT_EQ(replay, (std::vector<int64_t>{0, 0, 0, 30, 30, 30, 0}));
}

// Note [Dropped bytes still alive]: a marked allocation's bytes are in dropped_alive() and in the timeline's points
// until it is unmarked or freed, in every counter of the chain; marking twice, or what no counter counted, is a no-op.
TEST(CountingAllocator, MarkedDroppedBytesAreOnTheTimelineUntilUnmarkedOrFreed) {
  CountingAllocatorUse use;
  auto outer = std::make_shared<MemoryCounter>(/*timeline_points=*/64);
  auto counter = std::make_shared<MemoryCounter>(/*timeline_points=*/64);
  at::Tensor uncounted = at::empty({64}, at::kFloat);
  ScopedCounter outer_scope(outer);
  ScopedCounter scope(counter);
  at::Tensor a = at::empty({100}, at::kFloat);  // 400 bytes
  at::Tensor b = at::empty({25}, at::kFloat);   // 100 bytes
  EXPECT_EQ(mark_dropped_alive(a.storage().data()), 400);
  EXPECT_EQ(mark_dropped_alive(a.storage().data()), 0);  // already marked
  EXPECT_EQ(mark_dropped_alive(uncounted.storage().data()), 0);
  EXPECT_EQ(mark_dropped_alive(nullptr), 0);
  EXPECT_EQ(mark_dropped_alive(b.storage().data()), 100);
  EXPECT_EQ(counter->dropped_alive(), 500);
  EXPECT_EQ(outer->dropped_alive(), 500);
  unmark_dropped_alive(b.storage().data());
  unmark_dropped_alive(b.storage().data());  // not marked any more: no-op
  EXPECT_EQ(counter->dropped_alive(), 400);
  a.reset();  // freed while marked
  EXPECT_EQ(counter->dropped_alive(), 0);
  EXPECT_EQ(outer->dropped_alive(), 0);
  EXPECT_EQ(counter->current(), 100);
  std::vector<int64_t> bytes, dropped;
  for (const auto& p : counter->timeline()) {
    bytes.push_back(p.bytes);
    dropped.push_back(p.dropped_alive_bytes);
  }
  EXPECT_EQ(bytes, (std::vector<int64_t>{400, 500, 500, 500, 500, 100}));  // allocs, marks, unmark, free
  EXPECT_EQ(dropped, (std::vector<int64_t>{0, 0, 400, 500, 400, 0}));
}

// A tagged mark's changes are logged per counter (AliveChange): marked, unmarked, freed while marked; untagged marks
// log nothing, and an unmark with another tag (an address handed out again) leaves the mark alone.
TEST(CountingAllocator, TaggedMarksLogTheirChanges) {
  CountingAllocatorUse use;
  auto outer = std::make_shared<MemoryCounter>(/*timeline_points=*/64);
  auto counter = std::make_shared<MemoryCounter>(/*timeline_points=*/64);
  ScopedCounter outer_scope(outer);
  ScopedCounter scope(counter);
  at::Tensor a = at::empty({100}, at::kFloat);  // 400 bytes
  at::Tensor b = at::empty({25}, at::kFloat);   // 100 bytes
  at::Tensor c = at::empty({10}, at::kFloat);   // 40 bytes
  EXPECT_EQ(mark_dropped_alive(a.storage().data(), 3), 400);
  EXPECT_EQ(mark_dropped_alive(b.storage().data(), 5), 100);
  EXPECT_EQ(mark_dropped_alive(c.storage().data()), 40);  // untagged
  unmark_dropped_alive(b.storage().data(), 4);  // another tag's unmark: no-op
  EXPECT_EQ(counter->dropped_alive(), 540);
  unmark_dropped_alive(b.storage().data(), 5);
  a.reset();  // freed while marked
  unmark_dropped_alive(c.storage().data());
  EXPECT_EQ(counter->dropped_alive(), 0);
  for (const auto& m : {counter, outer}) {
    const std::vector<AliveChange> changes = m->alive_changes();
    std::vector<std::pair<int32_t, int64_t>> got;
    int64_t last = 0;
    for (const AliveChange& ch : changes) {
      got.emplace_back(ch.tag, ch.bytes);
      EXPECT_GE(ch.t_ns, last);
      last = ch.t_ns;
    }
    EXPECT_EQ(got, (std::vector<std::pair<int32_t, int64_t>>{{3, 400}, {5, 100}, {5, -100}, {3, -400}}));
  }
  // The free's change comes no later than its timeline point (a reader sees the bytes gone at that point).
  const std::vector<TimelinePoint> pts = counter->timeline();
  ASSERT_FALSE(pts.empty());
  EXPECT_LE(counter->alive_changes().back().t_ns, pts[pts.size() - 2].t_ns);
}

TEST(CountingAllocator, ScopesEndedOutOfOrderLeaveNoDanglingCounter) {
  CountingAllocatorUse use;
  auto a = std::make_shared<MemoryCounter>();
  auto b = std::make_shared<MemoryCounter>();
  auto sa = std::make_unique<ScopedCounter>(a);
  auto sb = std::make_unique<ScopedCounter>(b);
  sa.reset();  // out of order: b stays active
  a.reset();   // the counter can go; nothing on this thread points to it any more
  { at::Tensor t = at::empty({10}, at::kFloat); }
  EXPECT_EQ(b->total().allocated, 40);
  sb.reset();
  { at::Tensor t = at::empty({10}, at::kFloat); }
  EXPECT_EQ(active_counter(), nullptr);
  EXPECT_EQ(b->total().allocated, 40);
}

TEST(CountingAllocator, RawFreeWhileUninstalledLeavesNoDoubleFree) {
  // A counted raw allocation freed through raw_deallocate() after the layer was removed goes to the inner
  // deleter and leaves a stale table entry; when malloc hands the address out again, the new allocation must
  // replace that entry without freeing its bytes.
  auto counter = std::make_shared<MemoryCounter>();
  void* p = nullptr;
  {
    CountingAllocatorUse use;
    ScopedCounter scope(counter);
    p = c10::GetCPUAllocator()->raw_allocate(4096);
    EXPECT_EQ(counter->current(), 4096);
  }
  c10::GetCPUAllocator()->raw_deallocate(p);  // the default allocator now: the entry stays behind
  {
    CountingAllocatorUse use;
    ScopedCounter scope(counter);
    for (int i = 0; i < 8; ++i) {
      at::Tensor t = at::empty({1024}, at::kFloat);  // 4096 bytes: likely the same address
      t.fill_(1.0f);
      EXPECT_EQ(t.sum().item<float>(), 1024.0f);
    }
  }
  // 0 when an allocation reused the address (the stale entry's 4096 bytes were taken back); 4096 when malloc never
  // handed it out again (the stale entry still holds its count). Either way every tensor of the loop was freed
  // exactly once and kept its contents.
  EXPECT_TRUE(counter->current() == 0 || counter->current() == 4096) << counter->current();
  EXPECT_GE(counter->total().allocations, 9);
}

}  // namespace
}  // namespace tapesac::allocator
