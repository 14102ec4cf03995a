// The NCCL communicator held to the checks every communicator passes
// (tests/distributed/collective_checks.h), with a thread per GPU as its rank (up to 4; a
// one-GPU world everywhere there is a GPU), and the process group on CUDA: LOCAL_RANK picks the
// GPU, the ranks agree and meet.
#include <algorithm>

#include "device/communicator.h"
#include "device/device_runtime.h"
#include "distributed/collective_checks.h"
#include "distributed/process_group.h"
#include "distributed/test_ranks.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

#ifdef KILN_HAVE_NCCL
constexpr bool kHaveNccl = true;
#else
constexpr bool kHaveNccl = false;
#endif

#define KILN_REQUIRE_NCCL(gpus)                                                          \
  do {                                                                                   \
    KILN_REQUIRE_GPU();                                                                  \
    if (!kHaveNccl) GTEST_SKIP() << "built without NCCL";                                \
    if (cuda::device_count() < (gpus)) GTEST_SKIP() << "fewer than " << (gpus) << " GPUs"; \
  } while (0)

// Runs body on `world_size` ranks, rank r a thread on GPU r with its own NCCL communicator and
// stream.
void with_nccl(int world_size, const std::function<void(const Communicator&, const testing::DeviceIo&)>& body) {
  StoreServer server("127.0.0.1", 0, world_size);
  testing::run_ranks(world_size, [&](int rank) {
    cuda::set_current_device(rank);
    std::unique_ptr<DeviceRuntime> runtime = device_runtime(Device::kCuda);
    std::unique_ptr<DeviceStream> stream = runtime->create_stream();
    Store store(testing::client_options(server.port(), rank, world_size));
    std::unique_ptr<Communicator> comm = make_communicator(Device::kCuda, rank, world_size, store, 60s);
    ASSERT_EQ(comm->engine(), "nccl");
    ASSERT_EQ(comm->device(), Device::kCuda);
    testing::DeviceIo io;
    io.to_device = [&](const Tensor& t) { return runtime->to_device(t); };
    io.to_host = [&](const Tensor& t) { return runtime->to_host(t); };
    io.allocate = [&](const TensorType& type) { return runtime->device_tensor(type, false); };
    io.stream = stream->handle();
    io.synchronize = [&] { stream->synchronize(); };
    body(*comm, io);
  });
}

int ranks() { return std::min(cuda::device_count(), 4); }

void every_check(const Communicator& comm, const testing::DeviceIo& io) {
  testing::run_all_reduce_checks(comm, io, 1001, false);
  testing::run_all_reduce_checks(comm, io, 300, true);
  testing::run_all_gather_checks(comm, io, 37);
  testing::run_reduce_scatter_checks(comm, io, 53);
  testing::run_broadcast_checks(comm, io, 129);
  testing::run_refusal_checks(comm, io);
}

TEST(Nccl, OneGpuWorld) {
  KILN_REQUIRE_NCCL(1);
  with_nccl(1, every_check);
}

TEST(Nccl, AllReduce) {
  KILN_REQUIRE_NCCL(2);
  with_nccl(ranks(), [](const Communicator& comm, const testing::DeviceIo& io) {
    testing::run_all_reduce_checks(comm, io, 1001, false);
    testing::run_all_reduce_checks(comm, io, 300, true);
  });
}

TEST(Nccl, AllGather) {
  KILN_REQUIRE_NCCL(2);
  with_nccl(ranks(), [](const Communicator& comm, const testing::DeviceIo& io) {
    testing::run_all_gather_checks(comm, io, 37);
  });
}

TEST(Nccl, ReduceScatter) {
  KILN_REQUIRE_NCCL(2);
  with_nccl(ranks(), [](const Communicator& comm, const testing::DeviceIo& io) {
    testing::run_reduce_scatter_checks(comm, io, 53);
  });
}

TEST(Nccl, Broadcast) {
  KILN_REQUIRE_NCCL(2);
  with_nccl(ranks(), [](const Communicator& comm, const testing::DeviceIo& io) {
    testing::run_broadcast_checks(comm, io, 129);
  });
}

TEST(Nccl, Refusals) {
  KILN_REQUIRE_NCCL(2);
  with_nccl(ranks(), testing::run_refusal_checks);
}

TEST(Nccl, NvlinkMulticastIsOff) {
  KILN_REQUIRE_NCCL(1);
  with_nccl(1, [](const Communicator&, const testing::DeviceIo&) {});
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  ASSERT_NE(nvls, nullptr);
  EXPECT_STREQ(nvls, "0");
}

TEST(NcclProcessGroup, LocalRankPicksTheGpu) {
  KILN_REQUIRE_NCCL(2);
  int world = ranks();
  StoreServer server("127.0.0.1", 0, world);
  testing::run_ranks(world, [&](int rank) {
    DistEnv env;
    env.rank = env.local_rank = rank;
    env.world_size = env.local_world_size = world;
    env.master_port = server.port();
    ProcessGroupOptions options;
    options.serve_store = false;
    options.on_lost = [](int lost, const std::string& reason) {
      ADD_FAILURE() << "rank " << lost << " lost: " << reason;
    };
    auto group = init_process_group(env, Device::kCuda, options);
    EXPECT_EQ(cuda::current_device(), rank);
    group->check_agreement("the compiled step", "same");
    std::unique_ptr<DeviceRuntime> runtime = device_runtime(Device::kCuda);
    std::unique_ptr<DeviceStream> stream = runtime->create_stream();
    Tensor t = runtime->to_device(Tensor::from_f64(TensorType{DType::kF32, Shape{2}}, std::vector<double>{1.0 + rank, 2.0}));
    group->communicator()->all_reduce(t, t, ReduceOp::kAvg, stream->handle());
    stream->synchronize();
    Tensor host = runtime->to_host(t);
    // NCCL's average multiplies each input by 1 / world before adding (floats).
    EXPECT_NEAR(host.get(0), 1.0 + (world - 1) / 2.0, 1e-5);
    EXPECT_NEAR(host.get(1), 2.0, 1e-5);
    group->barrier();
  });
}

}  // namespace
}  // namespace kiln
