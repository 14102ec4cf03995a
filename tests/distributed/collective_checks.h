// The checks every communicator passes, whatever its engine and device: each collective on
// every dtype (and reduction) against an expectation computed on the host, in double, from
// every rank's random inputs (never zeros). Gloo runs them with ranks as threads
// (tests/distributed/gloo_communicator_test.cc), NCCL with a thread per GPU
// (tests/cuda/nccl_communicator_test.cc). Each rank calls the same check with its own
// communicator; the inputs are a function of (rank, dtype, salt), so each rank can compute what
// every other rank gave.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "device/communicator.h"
#include "support/error.h"
#include "tensor/tensor.h"

namespace kiln::testing {

// Moves tensors between the host and the communicator's device, and the stream its collectives
// are enqueued on. The CPU's is the identity with no stream.
struct DeviceIo {
  std::function<Tensor(const Tensor&)> to_device = [](const Tensor& t) { return t.clone(); };
  std::function<Tensor(const Tensor&)> to_host = [](const Tensor& t) { return t; };
  // A device tensor of `type`, contents unspecified.
  std::function<Tensor(const TensorType&)> allocate = [](const TensorType& type) { return Tensor(type); };
  void* stream = nullptr;
  // Waits for what was enqueued on `stream`.
  std::function<void()> synchronize = [] {};
};

inline const std::vector<DType> kCollectiveDTypes = {DType::kF32, DType::kF64, DType::kF16,
                                                     DType::kBF16, DType::kI32, DType::kI64};
inline const std::vector<ReduceOp> kReduceOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

// Rank r's input: random, never zeros (integers in [-50, 50), floats in [-2, 2)).
inline Tensor collective_input(DType dtype, int64_t n, int rank, uint64_t salt = 0) {
  bool integer = dtype == DType::kI32 || dtype == DType::kI64;
  return random_tensor(TensorType{dtype, Shape{n}}, 1000 * salt + 17 * uint64_t(rank) + 1,
                       integer ? -50.0 : -2.0, integer ? 50.0 : 2.0);
}

inline uint64_t salt_of(DType dtype, ReduceOp op) {
  return 10 * static_cast<uint64_t>(dtype) + static_cast<uint64_t>(op);
}

// The reduction of every rank's value at `i`, in double from the stored inputs.
inline double reduced_at(const std::vector<Tensor>& inputs, int64_t i, ReduceOp op, DType dtype) {
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

// Expects `out` (host) within tolerance of `expected`. Gloo rounds 16-bit floats once (it adds
// them in f32); NCCL adds in the type at every step of its ring, so its error grows with the
// number of ranks.
inline void expect_reduced(const Communicator& comm, const Tensor& out, const Tensor& expected) {
  double atol = 0, rtol = 0;
  switch (out.dtype()) {
    case DType::kF32: atol = rtol = 1e-6; break;
    case DType::kF64: atol = rtol = 1e-14; break;
    case DType::kF16: atol = rtol = 1e-3; break;
    case DType::kBF16: atol = 1e-2, rtol = 8e-3; break;
    default: break;
  }
  if (comm.engine() == "nccl") {
    atol *= 4 * comm.world_size();
    rtol *= 4 * comm.world_size();
  }
  EXPECT_LE(max_scaled_error(out, expected, atol, rtol), 1.0)
      << dtype_name(out.dtype()) << " got " << summarize(out) << " expected " << summarize(expected);
}

inline std::vector<Tensor> every_rank_input(const Communicator& comm, DType dtype, int64_t n, uint64_t salt) {
  std::vector<Tensor> inputs;
  for (int r = 0; r < comm.world_size(); ++r) inputs.push_back(collective_input(dtype, n, r, salt));
  return inputs;
}

// all_reduce of `n` elements, every dtype and reduction; `in_place` reduces into the input.
inline void run_all_reduce_checks(const Communicator& comm, const DeviceIo& io, int64_t n, bool in_place) {
  for (DType dtype : kCollectiveDTypes) {
    for (ReduceOp op : kReduceOps) {
      SCOPED_TRACE(fmt::format("all_reduce rank {} {} {}{}", comm.rank(), dtype_name(dtype),
                               reduce_op_name(op), in_place ? " in place" : ""));
      std::vector<Tensor> inputs = every_rank_input(comm, dtype, n, salt_of(dtype, op));
      Tensor in = io.to_device(inputs[comm.rank()]);
      Tensor out = in_place ? in : io.allocate(in.type());
      comm.all_reduce(in, out, op, io.stream);
      io.synchronize();
      Tensor expected(in.type());
      for (int64_t i = 0; i < n; ++i) expected.set(i, reduced_at(inputs, i, op, dtype));
      expect_reduced(comm, io.to_host(out), expected);
      if (!in_place) {  // the input is left as it was
        EXPECT_EQ(max_scaled_error(io.to_host(in), inputs[comm.rank()], 0, 0), 0);
      }
    }
  }
}

// all_gather of shards of `n` elements: rank r's shard lands at [r * n, (r + 1) * n).
inline void run_all_gather_checks(const Communicator& comm, const DeviceIo& io, int64_t n) {
  for (DType dtype : kCollectiveDTypes) {
    SCOPED_TRACE(fmt::format("all_gather rank {} {}", comm.rank(), dtype_name(dtype)));
    std::vector<Tensor> inputs = every_rank_input(comm, dtype, n, 1);
    Tensor out = io.allocate(TensorType{dtype, Shape{n * comm.world_size()}});
    comm.all_gather(io.to_device(inputs[comm.rank()]), out, io.stream);
    io.synchronize();
    Tensor host = io.to_host(out);
    for (int r = 0; r < comm.world_size(); ++r)
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(host.get(r * n + i), inputs[r].get(i)) << "rank " << r << "'s element " << i;
  }
}

// reduce_scatter into `n` elements per rank, every dtype and reduction.
inline void run_reduce_scatter_checks(const Communicator& comm, const DeviceIo& io, int64_t n) {
  int world = comm.world_size();
  for (DType dtype : kCollectiveDTypes) {
    for (ReduceOp op : kReduceOps) {
      SCOPED_TRACE(fmt::format("reduce_scatter rank {} {} {}", comm.rank(), dtype_name(dtype), reduce_op_name(op)));
      std::vector<Tensor> inputs = every_rank_input(comm, dtype, n * world, salt_of(dtype, op));
      Tensor out = io.allocate(TensorType{dtype, Shape{n}});
      comm.reduce_scatter(io.to_device(inputs[comm.rank()]), out, op, io.stream);
      io.synchronize();
      Tensor expected(out.type());
      for (int64_t i = 0; i < n; ++i) expected.set(i, reduced_at(inputs, comm.rank() * n + i, op, dtype));
      expect_reduced(comm, io.to_host(out), expected);
    }
  }
}

// broadcast from the first and the last rank.
inline void run_broadcast_checks(const Communicator& comm, const DeviceIo& io, int64_t n) {
  for (int root : {0, comm.world_size() - 1}) {
    for (DType dtype : kCollectiveDTypes) {
      SCOPED_TRACE(fmt::format("broadcast rank {} root {} {}", comm.rank(), root, dtype_name(dtype)));
      Tensor tensor = io.to_device(collective_input(dtype, n, comm.rank(), 7));
      comm.broadcast(tensor, root, io.stream);
      io.synchronize();
      EXPECT_EQ(max_scaled_error(io.to_host(tensor), collective_input(dtype, n, root, 7), 0, 0), 0);
    }
  }
}

// The size and type contracts, refused on every rank before any communication; the
// communicator works afterwards.
inline void run_refusal_checks(const Communicator& comm, const DeviceIo& io) {
  int w = comm.world_size();
  auto device = [&](DType dtype, int64_t n) { return io.allocate(TensorType{dtype, Shape{n}}); };
  Tensor out = device(DType::kF32, 3);
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { comm.reduce_scatter(device(DType::kF32, 3 * w + 1), out, ReduceOp::kSum, io.stream); }),
            fmt::format("reduce_scatter: in has {} elements, expected {} ranks x out's 3", 3 * w + 1, w));
  EXPECT_EQ(message([&] { comm.all_gather(device(DType::kF32, 2), out, io.stream); }),
            fmt::format("all_gather: out has 3 elements, expected {} ranks x the shard's 2", w));
  EXPECT_EQ(message([&] { comm.all_reduce(device(DType::kF32, 4), out, ReduceOp::kSum, io.stream); }),
            "all_reduce: in has 4 elements but out has 3");
  EXPECT_EQ(message([&] { comm.all_reduce(device(DType::kF64, 3), out, ReduceOp::kSum, io.stream); }),
            "all_reduce: in is f64 but out is f32");
  EXPECT_EQ(message([&] { comm.all_reduce(device(DType::kBool, 3), device(DType::kBool, 3), ReduceOp::kMax, io.stream); }),
            "all_reduce: bool tensors cannot be reduced");
  EXPECT_EQ(message([&] { comm.broadcast(out, w, io.stream); }),
            fmt::format("broadcast: root {} is not a rank of {}", w, w));
  Tensor host_tensor(TensorType{DType::kF32, Shape{3}});
  if (comm.device() != Device::kCpu) {
    EXPECT_EQ(message([&] { comm.all_reduce(host_tensor, host_tensor, ReduceOp::kSum, io.stream); }),
              fmt::format("all_reduce: in is a cpu tensor but the {} communicator is on {}", comm.engine(),
                          device_name(comm.device())));
  }
  Tensor values = io.to_device(Tensor::from_f64(TensorType{DType::kF32, Shape{3}}, std::vector<double>{1, 2, 3}));
  comm.all_reduce(values, out, ReduceOp::kSum, io.stream);
  io.synchronize();
  EXPECT_EQ(io.to_host(out).get(2), 3.0 * w);
}

}  // namespace kiln::testing
