// The Gloo communicator with 2 and 3 ranks as threads of this process (each its own store
// connection and Gloo context): every collective and dtype against an expectation computed from
// every rank's random inputs, the size checks, and a peer that dies mid-collective.
#include <gtest/gtest.h>

#include <cmath>

#include "device/communicator.h"
#include "distributed/test_ranks.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::client_options;

#ifdef KILN_HAVE_GLOO
constexpr bool kHaveGloo = true;
#else
constexpr bool kHaveGloo = false;
#endif

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

// Rank r's input: random, never zeros (integers in [-50, 50), floats in [-2, 2)).
Tensor input(DType dtype, int64_t n, int rank, uint64_t salt = 0) {
  bool integer = dtype == DType::kI32 || dtype == DType::kI64;
  return random_tensor(TensorType{dtype, Shape{n}}, 1000 * salt + 17 * rank + 1,
                       integer ? -50.0 : -2.0, integer ? 50.0 : 2.0);
}

// The reduction of every rank's value at `i`, computed in double from the stored inputs.
double expected_at(const std::vector<Tensor>& inputs, int64_t i, ReduceOp op, DType dtype) {
  double sum = 0, max = -INFINITY;
  for (const Tensor& t : inputs) {
    sum += t.get(i);
    max = std::max(max, t.get(i));
  }
  if (op == ReduceOp::kMax) return max;
  if (op == ReduceOp::kSum) return sum;
  double avg = sum / static_cast<double>(inputs.size());
  return is_float(dtype) ? avg : std::trunc(avg);  // integers divide as integers
}

// (atol, rtol) of one collective's result: 16-bit floats are rounded once at the end.
std::pair<double, double> tolerance(DType dtype) {
  switch (dtype) {
    case DType::kF32: return {1e-6, 1e-6};
    case DType::kF64: return {1e-14, 1e-14};
    case DType::kF16: return {1e-3, 1e-3};
    case DType::kBF16: return {1e-2, 8e-3};
    default: return {0, 0};
  }
}

void expect_close(const Tensor& out, const Tensor& expected) {
  auto [atol, rtol] = tolerance(out.dtype());
  EXPECT_LE(max_scaled_error(out, expected, atol, rtol), 1.0)
      << dtype_name(out.dtype()) << " got " << summarize(out) << " expected " << summarize(expected);
}

const std::vector<DType> kDTypes = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                    DType::kI32, DType::kI64};
const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

class Gloo : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  }
  int world() const { return GetParam(); }
};

TEST_P(Gloo, AllReduceEveryDtypeAndOp) {
  const int64_t n = 1001;
  with_gloo(world(), [&](const Communicator& comm) {
    for (DType dtype : kDTypes) {
      for (ReduceOp op : kOps) {
        uint64_t salt = 10 * static_cast<uint64_t>(dtype) + static_cast<uint64_t>(op);
        std::vector<Tensor> inputs;
        for (int r = 0; r < world(); ++r) inputs.push_back(input(dtype, n, r, salt));
        Tensor out(TensorType{dtype, Shape{n}});
        comm.all_reduce(inputs[comm.rank()], out, op, nullptr);
        Tensor expected(out.type());
        for (int64_t i = 0; i < n; ++i) expected.set(i, expected_at(inputs, i, op, dtype));
        SCOPED_TRACE(fmt::format("rank {} {} {}", comm.rank(), dtype_name(dtype), reduce_op_name(op)));
        expect_close(out, expected);
        // The input is left as it was.
        EXPECT_EQ(max_scaled_error(inputs[comm.rank()], input(dtype, n, comm.rank(), salt), 0, 0), 0);
      }
    }
  });
}

TEST_P(Gloo, AllReduceInPlace) {
  const int64_t n = 300;
  with_gloo(world(), [&](const Communicator& comm) {
    std::vector<Tensor> inputs;
    for (int r = 0; r < world(); ++r) inputs.push_back(input(DType::kBF16, n, r));
    Tensor tensor = inputs[comm.rank()].clone();
    comm.all_reduce(tensor, tensor, ReduceOp::kAvg, nullptr);
    Tensor expected(tensor.type());
    for (int64_t i = 0; i < n; ++i) expected.set(i, expected_at(inputs, i, ReduceOp::kAvg, DType::kBF16));
    expect_close(tensor, expected);
  });
}

TEST_P(Gloo, AllGatherPutsEachShardAtItsRank) {
  const int64_t n = 37;
  with_gloo(world(), [&](const Communicator& comm) {
    for (DType dtype : kDTypes) {
      Tensor out(TensorType{dtype, Shape{n * world()}});
      comm.all_gather(input(dtype, n, comm.rank()), out, nullptr);
      for (int r = 0; r < world(); ++r) {
        Tensor shard = input(dtype, n, r);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(out.get(r * n + i), shard.get(i)) << dtype_name(dtype) << " rank " << r << " element " << i;
      }
    }
  });
}

TEST_P(Gloo, ReduceScatterGivesEachRankItsSlice) {
  const int64_t n = 53;
  with_gloo(world(), [&](const Communicator& comm) {
    for (DType dtype : kDTypes) {
      for (ReduceOp op : kOps) {
        uint64_t salt = 10 * static_cast<uint64_t>(dtype) + static_cast<uint64_t>(op);
        std::vector<Tensor> inputs;
        for (int r = 0; r < world(); ++r) inputs.push_back(input(dtype, n * world(), r, salt));
        Tensor out(TensorType{dtype, Shape{n}});
        comm.reduce_scatter(inputs[comm.rank()], out, op, nullptr);
        Tensor expected(out.type());
        for (int64_t i = 0; i < n; ++i)
          expected.set(i, expected_at(inputs, comm.rank() * n + i, op, dtype));
        SCOPED_TRACE(fmt::format("rank {} {} {}", comm.rank(), dtype_name(dtype), reduce_op_name(op)));
        expect_close(out, expected);
      }
    }
  });
}

TEST_P(Gloo, BroadcastCopiesTheRootsTensor) {
  const int64_t n = 129;
  with_gloo(world(), [&](const Communicator& comm) {
    for (int root : {0, world() - 1}) {
      for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64}) {
        Tensor tensor = input(dtype, n, comm.rank(), 7);
        comm.broadcast(tensor, root, nullptr);
        EXPECT_EQ(max_scaled_error(tensor, input(dtype, n, root, 7), 0, 0), 0)
            << "rank " << comm.rank() << " root " << root << " " << dtype_name(dtype);
      }
    }
  });
}

TEST_P(Gloo, BadSizesAreRefusedOnEveryRankBeforeCommunicating) {
  with_gloo(world(), [&](const Communicator& comm) {
    int w = world();
    Tensor out(TensorType{DType::kF32, Shape{3}});
    EXPECT_KILN_ERROR(comm.reduce_scatter(Tensor(TensorType{DType::kF32, Shape{3 * w + 1}}), out, ReduceOp::kSum, nullptr),
                      fmt::format("reduce_scatter: in has {} elements, expected {} ranks x out's 3", 3 * w + 1, w));
    EXPECT_KILN_ERROR(comm.all_gather(Tensor(TensorType{DType::kF32, Shape{2}}), out, nullptr),
                      fmt::format("all_gather: out has 3 elements, expected {} ranks x the shard's 2", w));
    EXPECT_KILN_ERROR(comm.all_reduce(Tensor(TensorType{DType::kF32, Shape{4}}), out, ReduceOp::kSum, nullptr),
                      "all_reduce: in has 4 elements but out has 3");
    EXPECT_KILN_ERROR(comm.all_reduce(Tensor(TensorType{DType::kF64, Shape{3}}), out, ReduceOp::kSum, nullptr),
                      "all_reduce: in is f64 but out is f32");
    EXPECT_KILN_ERROR(comm.broadcast(out, w, nullptr), fmt::format("broadcast: root {} is not a rank of {}", w, w));
    // The communicator still works after refusing.
    Tensor ones = Tensor::from_f64(TensorType{DType::kF32, Shape{3}}, std::vector<double>{1, 2, 3});
    comm.all_reduce(ones, out, ReduceOp::kSum, nullptr);
    EXPECT_EQ(out.get(2), 3.0 * w);
  });
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
  Tensor t = input(DType::kF32, 1000, 0);
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
