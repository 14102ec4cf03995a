// The collective cost fits (distributed/comm_profile.h): the least-squares fit itself, and the
// sweep on a Gloo group of two threads: every rank gets rank 0's numbers, and the next group on
// the same machine reads them from the cache instead of sweeping.
#include "distributed/comm_profile.h"

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "device/device_runtime.h"
#include "distributed/test_ranks.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::env_of;
using testing::kHaveGloo;
using testing::thread_options;

TEST(CommProfile, FitRecoversLatencyAndBandwidth) {
  // t = 30 us + bytes / 80 GB/s, sampled at four sizes.
  std::vector<std::pair<double, double>> samples;
  for (double bytes : {1e5, 1e6, 1e7, 1e8}) samples.push_back({bytes, 30e-6 + bytes / 80e9});
  const CollectiveFit fit = fit_collective(samples);
  EXPECT_NEAR(fit.latency_s, 30e-6, 1e-9);
  EXPECT_NEAR(fit.bytes_per_s, 80e9, 80e9 * 1e-6);
  // Noise that would make the latency negative: refit through the origin.
  const CollectiveFit origin = fit_collective({{1e6, 1e-5}, {2e6, 2.5e-5}});
  EXPECT_EQ(origin.latency_s, 0.0);
  EXPECT_GT(origin.bytes_per_s, 0.0);
  EXPECT_THROW(fit_collective({{1e6, 1e-5}}), Error);
  EXPECT_THROW(fit_collective({{1e6, 2e-5}, {2e6, 1e-5}}), Error);  // faster when bigger
}

TEST(CommProfile, RanksShareRankZerosFitsAndTheCacheServesTheNextGroup) {
  if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("kiln_comm_{}", ::getpid());
  std::filesystem::remove_all(dir);
  ::setenv("KILN_CACHE_DIR", dir.c_str(), 1);
  auto run_group = [&] {
    StoreServer server("127.0.0.1", 0, 2);
    std::vector<CostModel> models(2);
    testing::run_ranks(2, [&](int rank) {
      std::unique_ptr<ProcessGroup> pg = init_process_group(env_of(rank, 2, server.port()), Device::kCpu, thread_options());
      models[static_cast<size_t>(rank)] = comm_cost_model(*pg, *device_runtime(Device::kCpu));
      pg->barrier();
    });
    return models;
  };
  const std::vector<CostModel> swept = run_group();
  const std::vector<CostModel> cached = run_group();
  ::unsetenv("KILN_CACHE_DIR");
  std::filesystem::remove_all(dir);
  for (const std::vector<CostModel>* models : {&swept, &cached})
    for (const CostModel& m : *models) {
      // The same numbers on both ranks and in both groups (the cache holds rank 0's fit).
      for (const CollectiveFit* f : {&m.all_gather, &m.reduce_scatter, &m.all_reduce}) EXPECT_GT(f->bytes_per_s, 0);
      EXPECT_EQ(m.all_gather.bytes_per_s, swept[0].all_gather.bytes_per_s);
      EXPECT_EQ(m.reduce_scatter.latency_s, swept[0].reduce_scatter.latency_s);
      EXPECT_EQ(m.all_reduce.bytes_per_s, swept[0].all_reduce.bytes_per_s);
    }
  // (A busy machine may leave a kind at its default: the source then says which.)
  EXPECT_EQ(swept[1].source.rfind("gloo measured on 2 ranks", 0), 0u) << swept[1].source;
  EXPECT_EQ(cached[1].source, "gloo measured on 2 ranks, cached");
}

}  // namespace
}  // namespace kiln
