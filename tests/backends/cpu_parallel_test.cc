// support/parallel.h: parallel_for covers its range exactly once, splits only when the work is
// worth it, and carries exceptions out of the parallel region.
#include <atomic>
#include <vector>

#include "support/error.h"
#include "support/parallel.h"
#include "test_util.h"

namespace kiln {
namespace {

TEST(CpuParallel, ParallelForCoversTheRangeOnce) {
  for (int64_t n : {0, 1, 7, 129, 100000}) {
    for (int64_t grain : {1, 64, 1 << 20}) {
      std::vector<int> hits(static_cast<size_t>(n), 0);
      parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) ++hits[static_cast<size_t>(i)];
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << n << " " << grain;
    }
  }
}

TEST(CpuParallel, NumChunksFollowsTheGrain) {
  EXPECT_EQ(num_chunks(0, 10), 0);
  EXPECT_EQ(num_chunks(5, 10), 1);      // less than a grain: the calling thread
  EXPECT_EQ(num_chunks(1 << 30, 1), max_threads());
  EXPECT_LE(num_chunks(25, 10), 2);
}

TEST(CpuParallel, ChunksAreContiguousAndOrdered) {
  const int64_t chunks = 3;
  std::vector<std::pair<int64_t, int64_t>> ranges(chunks);
  parallel_chunks(10, 110, chunks, [&](int64_t c, int64_t lo, int64_t hi) { ranges[c] = {lo, hi}; });
  EXPECT_EQ(ranges[0].first, 10);
  EXPECT_EQ(ranges[0].second, ranges[1].first);
  EXPECT_EQ(ranges[1].second, ranges[2].first);
  EXPECT_EQ(ranges[2].second, 110);
}

TEST(CpuParallel, ExceptionsReachTheCaller) {
  std::atomic<int> ran{0};
  EXPECT_THROW(parallel_chunks(0, 1000, 4,
                               [&](int64_t c, int64_t, int64_t) {
                                 ++ran;
                                 if (c == 3) fail("chunk {} failed", c);
                               }),
               Error);
  EXPECT_EQ(ran.load(), 4);
}

}  // namespace
}  // namespace kiln
