#include "device/communicator.h"

#include "support/error.h"

namespace kiln {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

ReduceOp parse_reduce_op(std::string_view name) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax})
    if (reduce_op_name(op) == name) return op;
  fail("unknown reduction '{}' (expected sum, avg or max)", name);
}

namespace {

void check_buffer(const Communicator& comm, std::string_view collective, std::string_view name,
                  const Tensor& t) {
  KILN_CHECK(t.defined(), "{}: {} is not allocated", collective, name);
  KILN_CHECK(t.device() == comm.device(), "{}: {} is a {} tensor but the {} communicator is on {}",
             collective, name, device_name(t.device()), comm.engine(), device_name(comm.device()));
}

void check_pair(const Communicator& comm, std::string_view collective, std::string_view in_name,
                const Tensor& in, const Tensor& out, bool reduces) {
  check_buffer(comm, collective, in_name, in);
  check_buffer(comm, collective, "out", out);
  KILN_CHECK(in.dtype() == out.dtype(), "{}: {} is {} but out is {}", collective, in_name,
             dtype_name(in.dtype()), dtype_name(out.dtype()));
  KILN_CHECK(!reduces || in.dtype() != DType::kBool, "{}: bool tensors cannot be reduced",
             collective);
}

}  // namespace

void check_all_reduce(const Communicator& comm, const Tensor& in, const Tensor& out) {
  check_pair(comm, "all_reduce", "in", in, out, true);
  KILN_CHECK(in.numel() == out.numel(), "all_reduce: in has {} elements but out has {}",
             in.numel(), out.numel());
}

void check_all_gather(const Communicator& comm, const Tensor& shard, const Tensor& out) {
  check_pair(comm, "all_gather", "shard", shard, out, false);
  KILN_CHECK(out.numel() == comm.world_size() * shard.numel(),
             "all_gather: out has {} elements, expected {} ranks x the shard's {}", out.numel(),
             comm.world_size(), shard.numel());
}

void check_reduce_scatter(const Communicator& comm, const Tensor& in, const Tensor& out) {
  check_pair(comm, "reduce_scatter", "in", in, out, true);
  KILN_CHECK(in.numel() == comm.world_size() * out.numel(),
             "reduce_scatter: in has {} elements, expected {} ranks x out's {}", in.numel(),
             comm.world_size(), out.numel());
}

void check_broadcast(const Communicator& comm, const Tensor& tensor, int root) {
  check_buffer(comm, "broadcast", "the tensor", tensor);
  KILN_CHECK(root >= 0 && root < comm.world_size(), "broadcast: root {} is not a rank of {}",
             root, comm.world_size());
}

}  // namespace kiln
