// Tests of the replay limit arithmetic and the arena accounting (allocator/limit.h): CPU-only, device-free.
#include <gtest/gtest.h>

#include "tapesac/allocator/limit.h"

namespace tapesac::allocator {
namespace {

TEST(LimitDecide, NoLimitAlwaysWhole) {
  const LimitDecision d = decide(0, 1 << 30, 1 << 30, 1);
  EXPECT_EQ(d.verdict, LimitVerdict::kWhole);
  EXPECT_EQ(d.need, 1 << 30);
}

TEST(LimitDecide, WholeWhenItFitsExactly) {
  const LimitDecision d = decide(1000, 600, 400, 100);
  EXPECT_EQ(d.verdict, LimitVerdict::kWhole);
  EXPECT_EQ(d.headroom, 400);
  EXPECT_EQ(d.need, 400);
}

TEST(LimitDecide, PiecesWhenOnlyAPieceFits) {
  const LimitDecision d = decide(1000, 600, 401, 400);
  EXPECT_EQ(d.verdict, LimitVerdict::kPieces);
  EXPECT_EQ(d.need, 400);
}

TEST(LimitDecide, RejectNamesTheSmallestNeed) {
  const LimitDecision d = decide(1000, 900, 500, 200);
  EXPECT_EQ(d.verdict, LimitVerdict::kReject);
  EXPECT_EQ(d.need, 200);
  EXPECT_EQ(d.headroom, 100);
  const std::string msg = rejection_message(d, "model.layers.3", "the backward (replay)");
  EXPECT_NE(msg.find("model.layers.3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1100"), std::string::npos) << msg;  // in use + need: a lower bound on a limit that works
  EXPECT_NE(msg.find("a lower bound"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1000 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("backward"), std::string::npos) << msg;
}

TEST(LimitDecide, OverLimitAlreadyRejectsEvenAnEmptyReplayOnlyIfItNeedsBytes) {
  EXPECT_EQ(decide(1000, 1200, 0, 0).verdict, LimitVerdict::kReject);  // headroom -200 < 0
  EXPECT_EQ(decide(1000, 1000, 0, 0).verdict, LimitVerdict::kWhole);
}

TEST(LimitDecide, PieceNeverExceedsWhole) {
  const LimitDecision d = decide(1000, 0, 300, 900);
  EXPECT_EQ(d.verdict, LimitVerdict::kWhole);
  EXPECT_EQ(decide(1000, 800, 300, 900).need, 300);
}

TEST(ArenaAccounting, SharedIsTheLargestSeparateIsTheSumOfPerBlockMaxima) {
  ArenaAccounting a;
  a.on_replay("b0", 100);
  a.on_replay("b1", 300);
  a.on_replay("b0", 150);
  a.on_replay("b2", 50);
  EXPECT_EQ(a.shared_bytes(), 300);
  EXPECT_EQ(a.separate_bytes(), 150 + 300 + 50);
  EXPECT_EQ(a.replays(), 4);
  a.reset();
  EXPECT_EQ(a.shared_bytes(), 0);
  EXPECT_EQ(a.separate_bytes(), 0);
}

}  // namespace
}  // namespace tapesac::allocator
