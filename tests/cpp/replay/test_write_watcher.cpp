// WriteWatcher: in-place writes made on the watching thread to a watched storage are counted and saved; writes to
// other storages are not — even to a new storage that the allocator put at the address of a freed watched one.
#include <gtest/gtest.h>
#include <torch/torch.h>

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

}  // namespace
}  // namespace tapesac::replay
