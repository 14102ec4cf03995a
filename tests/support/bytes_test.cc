#include "support/bytes.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

// One unit per size, the largest that keeps the number >= 1: bytes as they are, then two decimals.
TEST(FormatBytes, PicksTheLargestUnitThatKeepsTheNumberAtLeastOne) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(96), "96 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(double(size_t{5} << 20)), "5.00 MiB");
  EXPECT_EQ(format_bytes(double(size_t{3} << 29)), "1.50 GiB");
  EXPECT_EQ(format_bytes(double(size_t{4096} << 30)), "4096.00 GiB");  // GiB is the largest unit
}

}  // namespace
}  // namespace kiln
