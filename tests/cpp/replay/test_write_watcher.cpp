// WriteWatcher: in-place writes made on the watching thread to a watched storage are counted and saved; writes to
// other storages are not — even to a new storage that the allocator put at the address of a freed watched one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>

#include "tapesac/replay/preserve.h"

namespace tapesac::replay {
namespace {

int64_t total_writes(const WriteWatcher& w) {
  int64_t n = 0;
  for (const PreservedStorage& s : w.stats()) n += s.writes;
  return n;
}

TEST(WriteWatcher, CountsWritesToTheWatchedStorageOnly) {
  WriteWatcher w(PreserveMode::kRegions);
  w.install();
  at::Tensor bank = torch::zeros({16, 4});
  at::Tensor other = torch::zeros({16, 4});
  const int64_t mark = w.watch(bank);
  EXPECT_EQ(mark, 0);
  bank.index_fill_(0, torch::tensor({1, 3}), 2.0);
  other.index_fill_(0, torch::tensor({1, 3}), 2.0);
  bank.add_(1.0);
  EXPECT_EQ(w.writes_since(bank, mark), 2);
  EXPECT_EQ(w.writes_since(other, 0), 0);
  EXPECT_EQ(total_writes(w), 2);
  w.end();
}

// Every save is reported with its moment and its bytes (random programs 645 and 2575: with only the last save's
// moment, the keep-everything ceiling counted the first copy until the second was made).
TEST(WriteWatcher, ReportsEachSaveWithItsMomentAndBytes) {
  WriteWatcher w(PreserveMode::kRegions);
  w.install();
  at::Tensor bank = torch::zeros({16, 4});
  w.watch(bank);
  bank.index_fill_(0, torch::tensor({1, 3}), 2.0);  // two rows of 4 floats
  bank.mul_(0.5);                                   // the whole storage
  const std::vector<PreservedStorage> st = w.stats();
  w.end();
  ASSERT_EQ(st.size(), 1u);
  ASSERT_EQ(st[0].saves.size(), 2u);
  EXPECT_LT(st[0].saves[0].first, st[0].saves[1].first);
  EXPECT_EQ(st[0].saves[1].first, st[0].last_save_ns);
  EXPECT_EQ(st[0].saves[1].second, 16 * 4 * 4);
  EXPECT_EQ(st[0].saves[0].second + st[0].saves[1].second, st[0].held_bytes);
}

TEST(WriteWatcher, AFreedWatchedStorageIsNotConfusedWithANewOneAtItsAddress) {
  // The entries are keyed by StorageImpl address. The step's pattern: a block input is watched in the forward, the
  // backward (watcher paused) frees it, and the next forward allocates. Without a hold on the watched StorageImpl,
  // malloc hands its address to the next storage, and the watcher counts — and in snapshot mode restores — the new
  // storage's writes as the old one's.
  for (PreserveMode mode : {PreserveMode::kRegions, PreserveMode::kSnapshots}) {
    WriteWatcher w(mode);
    w.install();
    {
      at::Tensor gone = torch::zeros({8, 32});
      w.watch(gone);
      w.pause();
    }
    at::Tensor fresh = torch::zeros({8, 32});
    w.resume();
    fresh.mul_(2.0);
    EXPECT_EQ(w.writes_since(fresh, 0), 0);
    EXPECT_EQ(total_writes(w), 0) << "a write to a storage nobody watched was counted";
    // Watching the new storage starts it from zero writes, not from the dead one's count.
    EXPECT_EQ(w.watch(fresh), 0);
    w.end();
  }
}

TEST(WriteWatcher, PauseAndResumeOnTheOwningThread) {
  WriteWatcher w(PreserveMode::kRegions);
  w.install();
  at::Tensor bank = torch::zeros({16, 4});
  const int64_t mark = w.watch(bank);
  bank.add_(1.0);
  w.pause();
  bank.add_(1.0);  // not seen: the backward's writes are the version check's business
  w.resume();
  bank.add_(1.0);
  EXPECT_EQ(w.writes_since(bank, mark), 2);
  w.end();
}

// Note [a storage reallocated unseen], at the same address. An allocator that hands back the one block it owns, as
// glibc or a caching allocator can after a free: the reallocation keeps the address, the size and the StorageImpl,
// and the bytes in between are the allocator's (glibc's free-list pointers), not the forward's.
struct SameBlockAllocator final : c10::Allocator {
  explicit SameBlockAllocator(size_t n) : block(n) {}
  c10::DataPtr allocate(size_t n) override {
    if (in_use || n != block.size()) return c10::GetDefaultCPUAllocator()->allocate(n);
    in_use = true;
    return {block.data(), this, &release, c10::Device(c10::kCPU)};
  }
  static void release(void* self) { static_cast<SameBlockAllocator*>(self)->in_use = false; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  std::vector<char> block;
  bool in_use = false;
};

/// A float tensor of `n` elements on a resizable storage of `alloc`, holding 1, 2, ..., n.
at::Tensor on_allocator(c10::Allocator* alloc, int64_t n) {
  c10::Storage s(c10::Storage::use_byte_size_t(), n * 4, alloc, /*resizable=*/true);
  at::Tensor t = at::empty({0}).set_(s, 0, {n}, {1});
  t.copy_(at::arange(1, n + 1, at::kFloat));
  return t;
}

/// FSDP2's pattern on `t`: freed after the forward, `between` runs, then reallocated (the allocator's bytes scribbled
/// over it, as a free list does) and refilled with the forward's values by an operator call. Returns what a replay
/// restoring t as of `mark` reads.
at::Tensor free_and_refill(WriteWatcher& w, at::Tensor& t, int64_t mark, const std::function<void()>& between) {
  const at::Tensor values = t.clone();
  const size_t n = t.storage().nbytes();
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
  between();
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), n);
  std::memset(t.storage().mutable_data(), 0x5a, 16);
  t.copy_(values);  // the refill: an operator call the watcher sees
  if (w.writes_since(t, mark) == 0) return t.clone();  // nothing to undo: the replay reads t (ReplayContract)
  std::string why;
  WriteWatcher::Restored r = w.restore(t, mark, 0, &why);
  EXPECT_TRUE(r.copy.defined() || r.swap) << why;
  return r.swap ? t.clone() : r.copy.clone();  // a Swap puts t's regions back when r goes
}

TEST(WriteWatcher, AStorageFreedAndHandedBackAtItsAddressIsSeenReallocated) {
  // A CPU storage of the process's CPU allocator: its free is seen as it happens (the watcher holds its allocation).
  for (PreserveMode mode : {PreserveMode::kRegions, PreserveMode::kSnapshots}) {
    SameBlockAllocator alloc(64);
    c10::Allocator* before = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&alloc, /*priority=*/255);
    {
      WriteWatcher w(mode);
      w.install();
      at::Tensor t = on_allocator(&alloc, 16);
      const at::Tensor forward = t.clone();
      const int64_t mark = w.watch(t);
      const at::Tensor read = free_and_refill(w, t, mark, [] {});
      EXPECT_EQ(t.data_ptr(), static_cast<void*>(alloc.block.data()));
      EXPECT_TRUE(at::equal(read, forward)) << "the replay read the allocator's bytes";
      EXPECT_EQ(w.writes_since(t, mark), 0) << "the refill was saved as a write";
      w.end();
    }
    c10::SetCPUAllocator(before, /*priority=*/255);
  }
}

TEST(WriteWatcher, AStorageSeenFreedAtABlockBoundaryIsSeenReallocated) {
  // A storage the watcher cannot hold the allocation of (another allocator: CUDA's caching allocator, pinned memory):
  // a free is seen when a block boundary finds the storage empty (check_allocations), then the refill is one.
  SameBlockAllocator alloc(64);
  WriteWatcher w(PreserveMode::kRegions);
  w.install();
  at::Tensor t = on_allocator(&alloc, 16);
  const at::Tensor forward = t.clone();
  const int64_t mark = w.watch(t);
  const at::Tensor read = free_and_refill(w, t, mark, [&w] { w.check_allocations(); });
  EXPECT_TRUE(at::equal(read, forward)) << "the replay read the allocator's bytes";
  EXPECT_EQ(w.writes_since(t, mark), 0) << "the refill was saved as a write";
  w.end();
}

TEST(WriteWatcher, AWatchedStorageKeepsItsAllocatorsDeleterAfterTheStep) {
  // The watcher's hold on a CPU allocation lasts while the storage is watched: end() puts the allocator's own
  // deleter back (code that inspects it, e.g. shared-memory checks, sees the storage as it was).
  at::Tensor t = at::ones({64});
  const c10::DeleterFnPtr deleter = t.storage().data_ptr().get_deleter();
  void* const ctx = t.storage().data_ptr().get_context();
  WriteWatcher w(PreserveMode::kRegions);
  w.install();
  w.watch(t);
  w.end();
  EXPECT_EQ(t.storage().data_ptr().get_deleter(), deleter);
  EXPECT_EQ(t.storage().data_ptr().get_context(), ctx);
  EXPECT_EQ(t.sum().item<float>(), 64.0f);
}

// A reallocation that keeps the bytes (resize_ to the same size copies them, as share_memory_() does) is not a free:
// the write after it is a write, undone for the replay. Taken for a refill, the replay read the written bytes (an
// adversarial test: gradients off by 0.2-0.36).
TEST(WriteWatcher, AReallocationThatKeepsTheBytesIsNoRefill) {
  for (PreserveMode mode : {PreserveMode::kRegions, PreserveMode::kSnapshots}) {
    WriteWatcher w(mode);
    w.install();
    at::Tensor t = at::arange(1, 17, at::kFloat);
    const at::Tensor forward = t.clone();
    const int64_t mark = w.watch(t);
    const void* before = t.data_ptr();
    at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), t.storage().nbytes());
    EXPECT_NE(t.data_ptr(), before);
    t.mul_(2.0);
    w.check_allocations();
    EXPECT_EQ(w.writes_since(t, mark), 1);
    std::string why;
    {
      WriteWatcher::Restored r = w.restore(t, mark, 1, &why);
      ASSERT_TRUE(r.copy.defined() || r.swap) << why;
      EXPECT_TRUE(at::equal(r.swap ? t : r.copy, forward));
    }
    EXPECT_TRUE(at::equal(t, forward * 2));
    w.end();
  }
}

// A copy-on-write storage (torch._lazy_clone) is not held; its first write copies it (materializes) to a new address
// after the watcher saved the region: the saved write still undoes onto the copy (it was refused as "reallocated").
TEST(WriteWatcher, ACopyOnWriteStorageCopiedAtItsFirstWriteKeepsItsSavedWrite) {
  WriteWatcher w(PreserveMode::kRegions);
  w.install();
  at::Tensor t = at::arange(1, 17, at::kFloat);
  const at::Tensor sibling = at::_lazy_clone(t);
  const at::Tensor forward = t.clone();
  const int64_t mark = w.watch(t);
  t.mul_(2.0);
  w.check_allocations();
  std::string why;
  WriteWatcher::Restored r = w.restore(t, mark, 1, &why);
  ASSERT_TRUE(r.swap) << why;
  EXPECT_TRUE(at::equal(t, forward));
  EXPECT_TRUE(at::equal(sibling, forward));
  r.swap.reset();
  EXPECT_TRUE(at::equal(t, forward * 2));
  w.end();
}

// Two sessions' watchers on one storage (steps open on two threads): both hold it, both see its free, and each takes
// its own layer out whichever ends first (before, the second watcher could not hold it and missed a same-address
// refill).
TEST(WriteWatcher, TwoWatchersHoldOneStorageAndEndInEitherOrder) {
  for (bool first_ends_first : {true, false}) {
    SameBlockAllocator alloc(64);
    c10::Allocator* before = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&alloc, /*priority=*/255);
    {
      at::Tensor t = on_allocator(&alloc, 16);
      const c10::DeleterFnPtr deleter = t.storage().data_ptr().get_deleter();
      const at::Tensor forward = t.clone();
      WriteWatcher a(PreserveMode::kRegions);
      WriteWatcher b(PreserveMode::kRegions);
      const int64_t ma = a.watch(t);
      const int64_t mb = b.watch(t);
      b.install();  // b's thread makes the writes (one watcher per thread)
      const at::Tensor read = free_and_refill(b, t, mb, [] {});
      EXPECT_TRUE(at::equal(read, forward));
      EXPECT_EQ(b.writes_since(t, mb), 0);
      EXPECT_EQ(a.writes_since(t, ma), 0);
      (first_ends_first ? a : b).end();
      (first_ends_first ? b : a).end();
      EXPECT_EQ(t.storage().data_ptr().get_deleter(), deleter);
    }
    c10::SetCPUAllocator(before, /*priority=*/255);
  }
}


// Note [A region that cannot be indexed]: a write whose region the watcher cannot index (here index_fill_ on a 0-dim
// tensor, whose dimension 0 the negative-index wrap cannot size) saves the whole written view and restores from it.
TEST(WriteWatcher, AWriteWhoseRegionCannotBeIndexedSavesTheWholeView) {
  WriteWatcher w(PreserveMode::kRegions);
  w.install();
  at::Tensor scalar = torch::tensor(5.0f);
  const at::Tensor forward = scalar.clone();
  const int64_t mark = w.watch(scalar);
  scalar.index_fill_(0, torch::tensor({0}), 1.0);
  EXPECT_EQ(w.writes_since(scalar, mark), 1);
  const std::vector<PreservedStorage> st = w.stats();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].held_bytes, 4);  // the one float of the view
  std::string why;
  {
    WriteWatcher::Restored r = w.restore(scalar, mark, 1, &why);
    ASSERT_TRUE(r.copy.defined() || r.swap) << why;
    EXPECT_TRUE(at::equal(r.swap ? scalar : r.copy, forward));
  }
  EXPECT_EQ(scalar.item<float>(), 1.0f);
  w.end();
}

}  // namespace
}  // namespace tapesac::replay
