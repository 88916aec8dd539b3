// Tests of the header-only common library: byte formatting, FNV-1a, the clock.
#include <string>

#include <gtest/gtest.h>

#include "tapesac/common/bytes.h"
#include "tapesac/common/clock.h"
#include "tapesac/common/errors.h"
#include "tapesac/common/fnv.h"

namespace tapesac::common {
namespace {

TEST(FormatBytes, Units) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(3 * 1024 * 1024), "3.00 MiB");
  EXPECT_EQ(format_bytes(int64_t{5} << 30), "5.00 GiB");
  EXPECT_EQ(format_bytes(-2048), "-2.0 KiB");
  EXPECT_EQ(format_bytes_exact(3 * 1024 * 1024), "3.00 MiB (3145728 bytes)");
}

TEST(Fnv64, MatchesTheReferenceVectors) {
  // FNV-1a 64 of "" and "a" (the published test vectors).
  Fnv64 empty;
  EXPECT_EQ(empty.value(), 0xcbf29ce484222325ull);
  Fnv64 a;
  a.mix_raw("a", 1);
  EXPECT_EQ(a.value(), 0xaf63dc4c8601ec8cull);
  // mix() is the 8 little-endian bytes of its argument.
  Fnv64 x, y;
  x.mix(0x0102030405060708ull);
  const unsigned char le[8] = {8, 7, 6, 5, 4, 3, 2, 1};
  y.mix_raw(le, 8);
  EXPECT_EQ(x.value(), y.value());
  // mix_bytes() prefixes the length, so "ab"+"c" and "a"+"bc" differ.
  Fnv64 p, q;
  p.mix_bytes("ab");
  p.mix_bytes("c");
  q.mix_bytes("a");
  q.mix_bytes("bc");
  EXPECT_NE(p.value(), q.value());
}

TEST(Clock, IsMonotonic) {
  const int64_t a = now_ns();
  Stopwatch w;
  volatile int64_t sink = 0;
  for (int i = 0; i < 100000; ++i) sink = sink + i;
  EXPECT_GE(now_ns(), a);
  EXPECT_GE(w.elapsed_ns(), 0);
}

TEST(Errors, CheckThrowsTheKindWithTheMessage) {
  try {
    TAPESAC_CHECK(1 + 1 == 3, kConfig, "expected ", 3, ", got ", 2);
    FAIL() << "TAPESAC_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_EQ(std::string(e.what()), "expected 3, got 2");
  }
}

}  // namespace
}  // namespace tapesac::common
