// PtrIndexMap: the recorder's allocation-free identity map (address -> index).
#include <gtest/gtest.h>

#include <random>
#include <unordered_map>
#include <vector>

#include "tapesac/capture/ptr_index_map.h"

using tapesac::capture::PtrIndexMap;

TEST(PtrIndexMap, FindOnEmptyIsMissing) {
  PtrIndexMap m;
  int x = 0;
  EXPECT_EQ(m.find(&x), PtrIndexMap::kMissing);
  EXPECT_EQ(m.size(), 0u);
}

TEST(PtrIndexMap, AssignInsertsThenReplaces) {
  PtrIndexMap m;
  int a = 0, b = 0;
  EXPECT_TRUE(m.assign(&a, 3));
  EXPECT_TRUE(m.assign(&b, 4));
  EXPECT_FALSE(m.assign(&a, 7));  // replaced, not inserted
  EXPECT_EQ(m.find(&a), 7);
  EXPECT_EQ(m.find(&b), 4);
  EXPECT_EQ(m.size(), 2u);
  m.clear();
  EXPECT_EQ(m.find(&a), PtrIndexMap::kMissing);
  EXPECT_EQ(m.size(), 0u);
}

TEST(PtrIndexMap, MatchesStdUnorderedMapUnderGrowth) {
  // Addresses from one array (aligned, close together: the pattern heap objects have) and random assignments,
  // through many rehashes; every lookup must agree with a reference map.
  std::vector<double> objects(5000);
  std::mt19937 rng(7);
  std::uniform_int_distribution<size_t> pick(0, objects.size() - 1);
  PtrIndexMap m;
  m.reserve(8);
  std::unordered_map<const void*, int32_t> ref;
  for (int32_t i = 0; i < 20000; ++i) {
    const void* key = &objects[pick(rng)];
    EXPECT_EQ(m.assign(key, i), ref.find(key) == ref.end());
    ref[key] = i;
  }
  EXPECT_EQ(m.size(), ref.size());
  for (const double& o : objects) {
    auto it = ref.find(&o);
    EXPECT_EQ(m.find(&o), it == ref.end() ? PtrIndexMap::kMissing : it->second);
  }
}

TEST(PtrIndexMap, ResetEmptiesAndTheTableServesAgain) {
  // Note [Recorder scratch reused]: a reset map is handed to the next recording; nothing of the last one may remain.
  std::vector<int> objects(300);
  PtrIndexMap m;
  for (int32_t i = 0; i < 300; ++i) m.assign(&objects[static_cast<size_t>(i)], i);
  m.reset();
  EXPECT_EQ(m.size(), 0u);
  for (const int& o : objects) EXPECT_EQ(m.find(&o), PtrIndexMap::kMissing);
  for (int32_t i = 0; i < 300; i += 2) EXPECT_TRUE(m.assign(&objects[static_cast<size_t>(i)], 1000 + i));
  for (int32_t i = 0; i < 300; ++i) {
    EXPECT_EQ(m.find(&objects[static_cast<size_t>(i)]), i % 2 == 0 ? 1000 + i : PtrIndexMap::kMissing);
  }
}

TEST(PtrIndexMap, SwapExchangesContents) {
  int a = 0, b = 0;
  PtrIndexMap m, n;
  m.assign(&a, 1);
  n.assign(&b, 2);
  n.assign(&a, 3);
  m.swap(n);
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m.find(&a), 3);
  EXPECT_EQ(m.find(&b), 2);
  EXPECT_EQ(n.size(), 1u);
  EXPECT_EQ(n.find(&a), 1);
  EXPECT_EQ(n.find(&b), PtrIndexMap::kMissing);
}
