// The one interface to a collective engine: NCCL on CUDA GPUs
// (backends/cuda/nccl/nccl_communicator.cc), Gloo on CPUs (backends/cpu/gloo_communicator.cc).
// kiln never writes its own collectives.
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

#include <chrono>
#include <memory>
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

  // For the process group's watchdog, from its own thread while collectives may be blocked:
  // an error the engine found by itself (NCCL's asynchronous errors: a peer's connection
  // failed), "" while there is none; and ending the work in flight so that a rank blocked in a
  // collective returns (ncclCommAbort; the communicator is unusable afterwards). Gloo needs
  // neither: its collectives time out by themselves.
  virtual std::string async_error() const { return ""; }
  virtual void abort() noexcept {}
};

// The buffer contracts above, which every engine checks before calling its library: throw
// kiln::Error naming the collective ("all_gather: out has 10 elements, expected 3 ranks x the
// shard's 4").
void check_all_reduce(const Communicator& comm, const Tensor& in, const Tensor& out);
void check_all_gather(const Communicator& comm, const Tensor& shard, const Tensor& out);
void check_reduce_scatter(const Communicator& comm, const Tensor& in, const Tensor& out);
void check_broadcast(const Communicator& comm, const Tensor& tensor, int root);

// Where the ranks of a job exchange what their engine needs to connect (Gloo's addresses,
// NCCL's unique id): the rendezvous store (distributed/store.h) implements it, and the
// backends see only this.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set; throws kiln::Error after `timeout` or when a rank is lost.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // This host's address on the way to the store's server: where the other ranks can reach this
  // one (Gloo listens there).
  virtual std::string local_address() const = 0;
};

// The communicator of `device`'s engine for rank `rank` of `world_size`, connected to the other
// ranks through `store` (every rank calls this at the same point; one communicator per store,
// its keys are fixed): Gloo for kCpu, NCCL for kCuda on the calling thread's current GPU.
// `timeout` bounds connecting and, on Gloo, each collective. Throws kiln::Error when the engine
// is not built in ("this kiln was built without Gloo (install libgloo-dev and reconfigure)").
// Defined in backends/communicator.cc.
std::unique_ptr<Communicator> make_communicator(Device device, int rank, int world_size,
                                                KeyValueStore& store,
                                                std::chrono::milliseconds timeout);

}  // namespace kiln
