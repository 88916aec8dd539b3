// Tests of ByteCover (capture/byte_cover.h): the bytes of a storage written by recorded ops, per strided view.
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/capture/byte_cover.h"

namespace tapesac::capture {
namespace {

// A float32 view: sizes, strides (elements), storage offset (elements).
TensorMeta view(std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset = 0) {
  TensorMeta m;
  m.sizes.assign(sizes.begin(), sizes.end());
  m.strides.assign(strides.begin(), strides.end());
  m.storage_offset = offset;
  m.dtype = 6;
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  m.nbytes = numel * 4;
  return m;
}

using Runs = std::vector<std::pair<int64_t, int64_t>>;

Runs runs_of(const TensorMeta& m) {
  Runs r;
  EXPECT_TRUE(ByteCover::view_runs(m, &r));
  return r;
}

TEST(ByteCover, ContiguousAndPermutedViewsAreOneRun) {
  EXPECT_EQ(runs_of(view({4, 8}, {8, 1})), (Runs{{0, 128}}));
  EXPECT_EQ(runs_of(view({8, 4}, {1, 8})), (Runs{{0, 128}}));           // a transpose of a contiguous [4, 8]
  EXPECT_EQ(runs_of(view({2, 3, 4}, {1, 8, 2})), (Runs{{0, 96}}));      // a permutation of a contiguous [3, 4, 2]
  EXPECT_EQ(runs_of(view({4, 8}, {8, 1}, 16)), (Runs{{64, 192}}));      // with a storage offset
  EXPECT_EQ(runs_of(view({1, 8, 1}, {99, 1, 7})), (Runs{{0, 32}}));     // size-1 dims do not move the offset
}

TEST(ByteCover, SlicesAndStridesAreSeveralRuns) {
  // The left half of a [4, 8]: four runs of 4 floats.
  EXPECT_EQ(runs_of(view({4, 4}, {8, 1})), (Runs{{0, 16}, {32, 48}, {64, 80}, {96, 112}}));
  // Every second element of 4: four runs of one float.
  EXPECT_EQ(runs_of(view({4}, {2}, 1)), (Runs{{4, 8}, {12, 16}, {20, 24}, {28, 32}}));
  // An expand (stride 0) adds nothing new; overlapping windows (unfold) merge.
  EXPECT_EQ(runs_of(view({3, 4}, {0, 1})), (Runs{{0, 16}}));
  EXPECT_EQ(runs_of(view({3, 4}, {2, 1})), (Runs{{0, 32}}));
}

TEST(ByteCover, EmptyViewsSpanNothingAndTooStridedViewsAreRefused) {
  Runs r{{1, 2}};
  EXPECT_TRUE(ByteCover::view_runs(view({0, 8}, {8, 1}), &r));
  EXPECT_TRUE(r.empty());
  EXPECT_FALSE(ByteCover::view_runs(view({100, 100}, {200, 2}), &r, /*max_runs=*/4096));  // 10,000 runs
  EXPECT_TRUE(r.empty());
  TensorMeta no_strides = view({4}, {1});
  no_strides.strides = {};
  EXPECT_FALSE(ByteCover::view_runs(no_strides, &r));
}

TEST(ByteCover, TwoHalvesCoverTheWholeButOneDoesNot) {
  ByteCover c;
  const TensorMeta whole = view({4, 8}, {8, 1});
  EXPECT_FALSE(c.covers(whole));
  c.add(view({4, 4}, {8, 1}));     // left half
  EXPECT_FALSE(c.covers(whole));
  EXPECT_TRUE(c.covers(view({4, 4}, {8, 1})));
  EXPECT_TRUE(c.covers(view({2, 2}, {8, 1}, 9)));  // inside the left half
  EXPECT_FALSE(c.covers(view({4, 4}, {8, 1}, 4)));  // the right half
  c.add(view({4, 4}, {8, 1}, 4));  // right half
  EXPECT_TRUE(c.covers(whole));
  EXPECT_EQ(c.size(), 1u);  // merged into one run
  EXPECT_TRUE(c.covers(view({0}, {1}, 1000)));  // nothing to read
}

TEST(ByteCover, RangesMergeAndCoverage) {
  ByteCover c;
  c.add_range(10, 20);
  c.add_range(30, 40);
  EXPECT_EQ(c.size(), 2u);
  EXPECT_TRUE(c.covers_range(12, 18));
  EXPECT_FALSE(c.covers_range(15, 35));
  c.add_range(20, 30);  // adjacent on both sides
  EXPECT_EQ(c.size(), 1u);
  EXPECT_TRUE(c.covers_range(10, 40));
  EXPECT_FALSE(c.covers_range(9, 40));
  c.add_range(0, 5);
  c.add_range(3, 50);  // swallows everything
  EXPECT_EQ(c.size(), 1u);
  EXPECT_TRUE(c.covers_range(0, 50));
  c.clear();
  EXPECT_TRUE(c.empty());
  EXPECT_FALSE(c.covers_range(0, 1));
}

TEST(ByteCover, ViewsOfAnotherDtypeAreMeasuredInBytes) {
  ByteCover c;
  TensorMeta halves = view({8}, {1});  // 8 bf16 elements: 16 bytes
  halves.nbytes = 16;
  c.add(halves);
  EXPECT_TRUE(c.covers(view({4}, {1})));   // 4 floats: the same 16 bytes
  EXPECT_FALSE(c.covers(view({5}, {1})));
}

}  // namespace
}  // namespace tapesac::capture
