// The process group on CPUs (Gloo): joining, barriers, the agreement check, the join timeout,
// a killed rank reaching every other rank's watchdog, and the default handler's exit.
#include "distributed/process_group.h"

#include <gtest/gtest.h>

#include <future>

#include "device/device_runtime.h"
#include "distributed/test_ranks.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::env_of;
using testing::kHaveGloo;
using testing::thread_options;

class ProcessGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  }
};

TEST_F(ProcessGroupTest, RanksJoinMeetAgreeAndCommunicate) {
  StoreServer server("127.0.0.1", 0, 3);
  testing::run_ranks(3, [&](int rank) {
    auto group = init_process_group(env_of(rank, 3, server.port()), Device::kCpu, thread_options());
    EXPECT_EQ(group->rank(), rank);
    EXPECT_EQ(group->world_size(), 3);
    EXPECT_EQ(group->communicator()->engine(), "gloo");
    group->barrier();
    group->check_agreement("the compiled step", "hash-1234");
    group->barrier();
    group->check_agreement("the flags", "lr=0.1");
    Tensor t = Tensor::from_f64(TensorType{DType::kF32, Shape{2}}, std::vector<double>{1.0 + rank, 2.0});
    group->communicator()->all_reduce(t, t, ReduceOp::kSum, nullptr);
    EXPECT_EQ(t.get(0), 1.0 + 2.0 + 3.0);
    EXPECT_EQ(t.get(1), 6.0);
  });
}

TEST_F(ProcessGroupTest, RankZeroServesTheStore) {
  // MASTER_PORT 0: any free port (a single rank needs no one to find it).
  auto group = init_process_group(env_of(0, 1, 0), Device::kCpu, ProcessGroupOptions{});
  EXPECT_GT(group->store().options().port, 0);
  group->barrier();
  group->check_agreement("step", "x");
}

TEST_F(ProcessGroupTest, DisagreementFailsOnEveryRankWithOneMessage) {
  StoreServer server("127.0.0.1", 0, 3);
  std::vector<std::string> messages(3);
  testing::run_ranks(3, [&](int rank) {
    auto group = init_process_group(env_of(rank, 3, server.port()), Device::kCpu, thread_options());
    group->check_agreement("the compiled step", "hash-1234");
    messages[rank] = testing::error_of([&] {
      group->check_agreement("the compiled step", rank == 2 ? "hash-9999" : "hash-1234");
    });
  });
  for (const std::string& message : messages)
    EXPECT_EQ(message, "rank 2 disagrees with rank 0 on the compiled step: hash-9999 vs hash-1234 "
                       "(different model, batch, flags or build?)");
}

TEST_F(ProcessGroupTest, AMissingRankEndsTheJoinAfterTheTimeout) {
  StoreServer server("127.0.0.1", 0, 3);
  ProcessGroupOptions options = thread_options();
  options.timeout = 500ms;
  std::vector<std::string> messages(2);
  testing::run_ranks(2, [&](int rank) {
    messages[rank] = testing::error_of(
        [&] { init_process_group(env_of(rank, 3, server.port()), Device::kCpu, options); });
  });
  for (const std::string& message : messages) {
    EXPECT_NE(message.find(fmt::format("joining the rendezvous at 127.0.0.1:{}: only 2 of 3 ranks "
                                       "arrived within 0.5 s", server.port())),
              std::string::npos) << message;
  }
}

TEST_F(ProcessGroupTest, AKilledRankReachesEveryWatchdog) {
  testing::ChildRank child([](int port, const std::function<void()>& ready) {
    ProcessGroupOptions options = thread_options([](int, const std::string&) {});
    auto group = init_process_group(env_of(2, 3, port), Device::kCpu, options);
    group->barrier();  // every rank's Gloo pairs are connected
    ready();
    ::pause();
  });
  StoreServer server("127.0.0.1", 0, 3);
  child.start(server.port());
  std::promise<std::string> lost[2];
  testing::run_ranks(2, [&](int rank) {
    auto group = init_process_group(
        env_of(rank, 3, server.port()), Device::kCpu,
        thread_options([&, rank](int lost_rank, const std::string& reason) {
          lost[rank].set_value(fmt::format("rank {} was lost ({})", lost_rank, reason));
        }));
    group->barrier();
    if (rank == 0) {
      child.wait_ready();
      child.kill();
    }
    std::future<std::string> seen = lost[rank].get_future();
    ASSERT_EQ(seen.wait_for(5s), std::future_status::ready) << "rank " << rank << "'s watchdog";
    EXPECT_EQ(seen.get(), "rank 2 was lost (its connection to the store closed without a goodbye)");
    // A collective with the lost rank fails rather than hangs (Gloo's connection to it closed).
    Tensor t(TensorType{DType::kF32, Shape{1000}});
    EXPECT_KILN_ERROR(group->communicator()->all_reduce(t, t, ReduceOp::kSum, nullptr),
                      "gloo all_reduce failed");
    // Leaving: the last barrier fails fast on the lost rank, so this rank leaves as lost too.
  });
}

TEST_F(ProcessGroupTest, TheDefaultHandlerPrintsAndExits) {
  EXPECT_EXIT(
      {
        StoreServer server("127.0.0.1", 0, 1);
        ProcessGroupOptions options;
        options.serve_store = false;
        options.watchdog = false;
        auto group = init_process_group(env_of(0, 1, server.port()), Device::kCpu, options);
        group->exit_on_lost_rank(2, "its connection to the store closed without a goodbye");
      },
      ::testing::ExitedWithCode(1),
      "kiln: rank 2 was lost \\(its connection to the store closed without a goodbye\\); exiting");
}

TEST(ProcessGroup, NoGpuForTheLocalRankIsOneClearLine) {
  if (device_availability(Device::kCuda).count > 3) GTEST_SKIP() << "this machine has 4 GPUs";
  StoreServer server("127.0.0.1", 0, 4);
  DistEnv env = env_of(3, 4, server.port());
  EXPECT_KILN_ERROR(init_process_group(env, Device::kCuda, thread_options()),
                    device_availability(Device::kCuda).built
                        ? "WORLD_SIZE=4 with LOCAL_RANK=3 (LOCAL_WORLD_SIZE=4) needs a GPU per local rank, but this machine has"
                        : "this build has no CUDA backend");
}

}  // namespace
}  // namespace kiln
