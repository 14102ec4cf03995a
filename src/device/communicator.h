// The one interface to a collective engine: NCCL on CUDA GPUs (backends/cuda/nccl_communicator.cc),
// Gloo on CPUs (backends/cpu/gloo_communicator.cc). kiln never writes its own collectives.
//
// A Communicator joins the `world_size` processes of one training job (one per device, rank r
// of them this one); the distributed layer (distributed/process_group.h) creates it after the
// rendezvous. The collective ops of the graph (ops/collective.cc: all_reduce, all_gather,
// reduce_scatter, and their collective_wait) call it from their kernels with the
// communication stream the executor gives them, so the graph, not the trainer, says what is
// communicated and when.
//
// Streams: `stream` is the device stream to enqueue on (a cudaStream_t for NCCL); the call
// returns once the work is enqueued. On the CPU (Gloo), `stream` is nullptr and the call returns
// when the collective is done. Every rank must issue the same collectives in the same order with
// the same sizes (the graph is the same on every rank: distributed/process_group.h checks it).
//
// Buffers: flat, contiguous, of the communicator's device; `in` and `out` may be the same
// tensor for all_reduce. all_gather: out.numel() == world_size * shard.numel(), rank r's shard
// lands at [r * shard.numel(), (r + 1) * shard.numel()). reduce_scatter: in.numel() ==
// world_size * out.numel(), rank r gets the reduction of every rank's [r * n, (r + 1) * n).
// Errors (a lost peer, a timeout, a bad size) throw kiln::Error naming the collective.
#pragma once

#include <string>

#include "tensor/tensor.h"

namespace kiln {

enum class ReduceOp { kSum, kAvg, kMax };

// "sum", "avg", "max"; parse_reduce_op throws kiln::Error on anything else.
std::string_view reduce_op_name(ReduceOp op);
ReduceOp parse_reduce_op(std::string_view name);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Device device() const = 0;
  // "nccl" or "gloo" (for logs and errors).
  virtual std::string engine() const = 0;

  virtual void all_reduce(const Tensor& in, const Tensor& out, ReduceOp op, void* stream) const = 0;
  virtual void all_gather(const Tensor& shard, const Tensor& out, void* stream) const = 0;
  virtual void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op, void* stream) const = 0;
  // Rank `root`'s tensor to every rank, in place.
  virtual void broadcast(const Tensor& tensor, int root, void* stream) const = 0;
};

}  // namespace kiln
