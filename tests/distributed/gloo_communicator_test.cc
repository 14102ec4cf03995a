// The Gloo communicator with 2 and 3 ranks as threads of this process (each its own store
// connection and Gloo context): the checks every communicator passes (collective_checks.h:
// every collective and dtype against an expectation computed from every rank's random inputs,
// the size checks), and a peer that dies mid-collective.
#include <gtest/gtest.h>

#include "device/communicator.h"
#include "distributed/collective_checks.h"
#include "distributed/test_ranks.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::client_options;
using testing::kHaveGloo;

// Runs body(communicator) on world_size ranks, each a thread with its own Gloo communicator.
void with_gloo(int world_size, const std::function<void(const Communicator&)>& body) {
  StoreServer server("127.0.0.1", 0, world_size);
  testing::run_ranks(world_size, [&](int rank) {
    Store store(client_options(server.port(), rank, world_size));
    std::unique_ptr<Communicator> comm = make_communicator(Device::kCpu, rank, world_size, store, 10s);
    ASSERT_EQ(comm->rank(), rank);
    ASSERT_EQ(comm->world_size(), world_size);
    ASSERT_EQ(comm->engine(), "gloo");
    body(*comm);
  });
}

class Gloo : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  }
  int world() const { return GetParam(); }
  const testing::DeviceIo io;  // the host's: no copies, no stream
};

TEST_P(Gloo, AllReduceEveryDtypeAndOp) {
  with_gloo(world(), [&](const Communicator& comm) { testing::run_all_reduce_checks(comm, io, 1001, false); });
}

TEST_P(Gloo, AllReduceInPlace) {
  with_gloo(world(), [&](const Communicator& comm) { testing::run_all_reduce_checks(comm, io, 300, true); });
}

TEST_P(Gloo, AllGatherPutsEachShardAtItsRank) {
  with_gloo(world(), [&](const Communicator& comm) { testing::run_all_gather_checks(comm, io, 37); });
}

TEST_P(Gloo, ReduceScatterGivesEachRankItsSlice) {
  with_gloo(world(), [&](const Communicator& comm) { testing::run_reduce_scatter_checks(comm, io, 53); });
}

TEST_P(Gloo, BroadcastCopiesTheRootsTensor) {
  with_gloo(world(), [&](const Communicator& comm) { testing::run_broadcast_checks(comm, io, 129); });
}

TEST_P(Gloo, BadSizesAreRefusedOnEveryRankBeforeCommunicating) {
  with_gloo(world(), [&](const Communicator& comm) { testing::run_refusal_checks(comm, io); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Gloo, ::testing::Values(2, 3),
                         [](const auto& info) { return fmt::format("World{}", info.param); });

TEST(GlooFailure, APeerThatDiesEndsTheCollectiveInAnErrorNamingIt) {
  if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  testing::ChildRank child([](int port, const std::function<void()>& ready) {
    Store store(client_options(port, 1, 2));
    std::unique_ptr<Communicator> comm = make_communicator(Device::kCpu, 1, 2, store, 10s);
    ready();
    ::pause();
  });
  StoreServer server("127.0.0.1", 0, 2);
  child.start(server.port());
  Store store(client_options(server.port(), 0, 2));
  std::unique_ptr<Communicator> comm = make_communicator(Device::kCpu, 0, 2, store, 5s);
  child.wait_ready();
  child.kill();
  Tensor t = testing::collective_input(DType::kF32, 1000, 0);
  EXPECT_KILN_ERROR(comm->all_reduce(t, t, ReduceOp::kSum, nullptr), "gloo all_reduce failed on rank 0 of 2");
  // Later calls say the communicator failed rather than trying again.
  EXPECT_KILN_ERROR(comm->broadcast(t, 0, nullptr), "gloo broadcast on rank 0: the communicator failed earlier");
}

TEST(GlooFailure, WithoutGlooTheFactorySaysSo) {
  if (kHaveGloo) GTEST_SKIP() << "this kiln has Gloo";
  StoreServer server("127.0.0.1", 0, 1);
  Store store(client_options(server.port(), 0, 1));
  EXPECT_KILN_ERROR(make_communicator(Device::kCpu, 0, 1, store, 1s), "this kiln was built without Gloo");
}

}  // namespace
}  // namespace kiln
