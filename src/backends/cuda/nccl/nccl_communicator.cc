// The Communicator over NCCL (backends/cuda/nccl/nccl_communicator.h).
//
// Rank 0 creates NCCL's unique id and puts it in the rendezvous store; the others read it there
// and every rank joins with ncclCommInitRank on its current GPU. Each collective is enqueued on
// the stream the caller gives (the executor's communication stream, possibly under CUDA-graph
// capture) and returns at once; all_reduce's avg is NCCL's own ncclAvg.
//
// A lost peer: the communicator is created blocking (NCCL's default), and a rank whose peer died
// is stuck in device kernels waiting for data that never comes; the host learns it only when it
// next waits for the stream. NCCL's non-blocking mode (config.blocking = 0) would not help with
// that and would make every enqueue a poll for ncclInProgress, inside graph capture too. So the
// process group's watchdog thread (distributed/process_group.h) polls async_error()
// (ncclCommGetAsyncError) and the store's liveness, and on a failure calls abort()
// (ncclCommAbort, which NCCL allows from another thread to end the operations in flight) before
// the process ends.
//
// NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is forced in the environment before
// the first NCCL call, whatever it was (the machines kiln runs on must not use it; DESIGN.md).
#if KILN_HAVE_NCCL
#include "backends/cuda/nccl/nccl_communicator.h"

#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "backends/cuda/common/cuda_check.h"
#include "support/error.h"

// A failed NCCL call throws kiln::Error with file:line, NCCL's description of the result and
// its last error message (which names the peer or the network failure).
#define KILN_NCCL_CHECK(call)                                                                \
  do {                                                                                       \
    ncclResult_t kiln_nccl_status_ = (call);                                                 \
    if (kiln_nccl_status_ != ncclSuccess)                                                    \
      ::kiln::fail("{}:{}: {} failed: {} ({})", __FILE__, __LINE__, #call,                   \
                   ncclGetErrorString(kiln_nccl_status_), ncclGetLastError(nullptr));        \
  } while (0)

namespace kiln {
namespace {

const std::string kUniqueIdKey = "nccl/id";

// Bool travels as bytes (gathers and broadcasts only: check_* refuse to reduce it).
ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8:
    case DType::kBool: return ncclUint8;
  }
  fail("nccl: no NCCL type for {}", dtype_name(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  fail("nccl: unknown reduction");
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world_size, KeyValueStore& store, std::chrono::milliseconds timeout)
      : rank_(rank), world_size_(world_size) {
    KILN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
               "nccl: rank {} is not a rank of a world of {}", rank, world_size);
    KILN_CUDA_CHECK(cudaGetDevice(&gpu_));
    ncclUniqueId id;
    if (rank == 0) {
      KILN_NCCL_CHECK(ncclGetUniqueId(&id));
      store.set(kUniqueIdKey, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    } else {
      std::string bytes = store.get(kUniqueIdKey, timeout);
      KILN_CHECK(bytes.size() == sizeof(id),
                 "nccl: the store's unique id has {} bytes, this NCCL's has {} (do the ranks run "
                 "different NCCL versions?)", bytes.size(), sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    KILN_NCCL_CHECK(ncclCommInitRank(&comm_, world_size, id, rank));
  }

  ~NcclCommunicator() override {
    // After an abort NCCL has freed the communicator already.
    if (!aborted_) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device device() const override { return Device::kCuda; }
  std::string engine() const override { return "nccl"; }

  void all_reduce(const Tensor& in, const Tensor& out, ReduceOp op, void* stream) const override {
    check_all_reduce(*this, in, out);
    check_usable("all_reduce");
    if (in.numel() == 0) return;
    KILN_NCCL_CHECK(ncclAllReduce(in.raw(), out.raw(), static_cast<size_t>(in.numel()),
                                  nccl_type(in.dtype()), nccl_op(op), comm_,
                                  static_cast<cudaStream_t>(stream)));
  }

  void all_gather(const Tensor& shard, const Tensor& out, void* stream) const override {
    check_all_gather(*this, shard, out);
    check_usable("all_gather");
    if (shard.numel() == 0) return;
    KILN_NCCL_CHECK(ncclAllGather(shard.raw(), out.raw(), static_cast<size_t>(shard.numel()),
                                  nccl_type(shard.dtype()), comm_,
                                  static_cast<cudaStream_t>(stream)));
  }

  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op, void* stream) const override {
    check_reduce_scatter(*this, in, out);
    check_usable("reduce_scatter");
    if (out.numel() == 0) return;
    KILN_NCCL_CHECK(ncclReduceScatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()),
                                      nccl_type(in.dtype()), nccl_op(op), comm_,
                                      static_cast<cudaStream_t>(stream)));
  }

  void broadcast(const Tensor& tensor, int root, void* stream) const override {
    check_broadcast(*this, tensor, root);
    check_usable("broadcast");
    if (tensor.numel() == 0) return;
    KILN_NCCL_CHECK(ncclBroadcast(tensor.raw(), tensor.raw(), static_cast<size_t>(tensor.numel()),
                                  nccl_type(tensor.dtype()), root, comm_,
                                  static_cast<cudaStream_t>(stream)));
  }

  std::string async_error() const override {
    if (aborted_) return "";
    ncclResult_t result = ncclSuccess;
    ncclResult_t status = ncclCommGetAsyncError(comm_, &result);
    if (status != ncclSuccess) return fmt::format("ncclCommGetAsyncError failed: {}", ncclGetErrorString(status));
    if (result == ncclSuccess || result == ncclInProgress) return "";
    return fmt::format("NCCL: {} ({})", ncclGetErrorString(result), ncclGetLastError(comm_));
  }

  void abort() noexcept override {
    if (aborted_.exchange(true)) return;
    // The watchdog's thread may have another GPU current.
    cudaSetDevice(gpu_);
    ncclCommAbort(comm_);
  }

 private:
  void check_usable(const char* collective) const {
    KILN_CHECK(!aborted_, "nccl {} on rank {}: the communicator was aborted (a rank was lost)",
               collective, rank_);
  }

  int rank_;
  int world_size_;
  int gpu_ = 0;
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world_size,
                                                     KeyValueStore& store,
                                                     std::chrono::milliseconds timeout) {
  // Once per process, before its first NCCL call: setenv is not safe while another thread reads
  // the environment (an NCCL call in progress does), and ranks may be threads of one process.
  static std::once_flag nvls_off;
  std::call_once(nvls_off, [] { ::setenv("NCCL_NVLS_ENABLE", "0", 1); });
  return std::make_unique<NcclCommunicator>(rank, world_size, store, timeout);
}

}  // namespace kiln
#endif  // KILN_HAVE_NCCL
