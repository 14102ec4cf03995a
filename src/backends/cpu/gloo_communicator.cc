// The Communicator over Gloo (backends/cpu/gloo_communicator.h), and Gloo's rendezvous store
// over kiln's (KeyValueStore), so that Gloo's pairs find each other through the job's one store.
//
// Gloo adds f32, f64, i32, i64 and u8 natively. It cannot add bfloat16 (and its float16 sums
// round at every step of the ring), so 16-bit floats are reduced as f32 in a scratch buffer and
// rounded once at the end. Debian's Gloo (a 2022 snapshot) has no usable reduce-scatter: the
// full buffer is all-reduced into scratch and each rank keeps its slice, as PyTorch's Gloo
// backend does. Every collective has the context's timeout, so a dead or stuck peer ends in a
// kiln::Error naming the collective rather than a hang.
#ifdef KILN_HAVE_GLOO
#include "backends/cpu/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <csignal>
#include <cstring>
#include <exception>
#include <mutex>

#include "support/error.h"

namespace kiln {
namespace {

// Gloo's store interface over kiln's, under a prefix of its own.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(KeyValueStore& store, std::chrono::milliseconds timeout)
      : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(kPrefix + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string value = store_.get(kPrefix + key, timeout_);
    return {value.begin(), value.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) store_.get(kPrefix + key, timeout);
  }

 private:
  static inline const std::string kPrefix = "gloo/";
  KeyValueStore& store_;
  std::chrono::milliseconds timeout_;
};

template <typename T>
void sum_into(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(x[i] + y[i]);
}

template <typename T>
void max_into(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] < y[i] ? y[i] : x[i];
}

bool is_16_bit_float(DType dtype) { return dtype == DType::kF16 || dtype == DType::kBF16; }

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(int rank, int world_size, KeyValueStore& store, std::chrono::milliseconds timeout)
      : rank_(rank), world_size_(world_size) {
    KILN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
               "gloo: rank {} is not a rank of a world of {}", rank, world_size);
    run("connecting", [&] {
      gloo::transport::tcp::attr attr;
      // The address this host reaches the store's server from: an interface the other ranks
      // can reach too.
      attr.hostname = store.local_address().empty() ? "127.0.0.1" : store.local_address();
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
      context->setTimeout(timeout);
      GlooStore gloo_store(store, timeout);
      context->connectFullMesh(gloo_store, device);
      context_ = std::move(context);
    });
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device device() const override { return Device::kCpu; }
  std::string engine() const override { return "gloo"; }

  void all_reduce(const Tensor& in, const Tensor& out, ReduceOp op, void*) const override {
    check_all_reduce(*this, in, out);
    std::lock_guard lock(mutex_);
    run("all_reduce", [&] { store_slice(reduced(in, op), 0, out, op); });
  }

  void all_gather(const Tensor& shard, const Tensor& out, void*) const override {
    check_all_gather(*this, shard, out);
    std::lock_guard lock(mutex_);
    if (shard.numel() == 0) return;
    run("all_gather", [&] {
      gloo::AllgatherOptions options(context_);
      options.setInput(reinterpret_cast<char*>(shard.raw()), shard.bytes());
      options.setOutput(reinterpret_cast<char*>(out.raw()), out.bytes());
      options.setTag(next_tag());
      gloo::allgather(options);
    });
  }

  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op, void*) const override {
    check_reduce_scatter(*this, in, out);
    std::lock_guard lock(mutex_);
    run("reduce_scatter", [&] { store_slice(reduced(in, op), rank_ * out.numel(), out, op); });
  }

  void broadcast(const Tensor& tensor, int root, void*) const override {
    check_broadcast(*this, tensor, root);
    std::lock_guard lock(mutex_);
    if (tensor.numel() == 0) return;
    run("broadcast", [&] {
      gloo::BroadcastOptions options(context_);
      options.setOutput(reinterpret_cast<char*>(tensor.raw()), tensor.bytes());
      options.setRoot(root);
      options.setTag(next_tag());
      gloo::broadcast(options);
    });
  }

 private:
  // Runs a Gloo call; its exceptions (a closed connection, a timeout) become kiln::Error naming
  // the collective, and the communicator refuses further work: the ranks are out of step.
  template <typename Fn>
  void run(const char* collective, Fn&& fn) const {
    KILN_CHECK(failed_.empty(), "gloo {} on rank {}: the communicator failed earlier ({})",
               collective, rank_, failed_);
    try {
      fn();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      failed_ = fmt::format("{}: {}", collective, e.what());
      fail("gloo {} failed on rank {} of {} (a peer died, or did not join within the timeout): {}",
           collective, rank_, world_size_, e.what());
    }
  }

  // Tags keep one collective's messages apart from the next's; every rank counts the same.
  uint32_t next_tag() const { return tag_++; }

  // Every rank's `in` reduced elementwise, as a flat tensor in the type Gloo adds: in's own, or
  // f32 for the 16-bit floats.
  Tensor reduced(const Tensor& in, ReduceOp op) const {
    DType compute = is_16_bit_float(in.dtype()) ? DType::kF32 : in.dtype();
    Tensor work(TensorType{compute, Shape{in.numel()}});
    if (compute == in.dtype()) {
      std::memcpy(work.raw(), in.raw(), in.bytes());
    } else {
      float* w = work.data<float>();
      for (int64_t i = 0; i < in.numel(); ++i) w[i] = static_cast<float>(in.get(i));
    }
    if (in.numel() == 0) return work;
    visit_dtype(compute, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16> || std::is_same_v<T, bool>) {
        fail("gloo: cannot reduce {}", dtype_name(compute));  // excluded above
      } else {
        gloo::AllreduceOptions options(context_);
        options.setOutput(work.data<T>(), static_cast<size_t>(in.numel()));
        options.setReduceFunction(op == ReduceOp::kMax ? &max_into<T> : &sum_into<T>);
        options.setTag(next_tag());
        gloo::allreduce(options);
      }
    });
    return work;
  }

  // out = work[offset, offset + out.numel()), divided by the world size for kAvg (integers
  // divide as integers do, as NCCL's average), in out's dtype.
  void store_slice(const Tensor& work, int64_t offset, const Tensor& out, ReduceOp op) const {
    visit_dtype(out.dtype(), [&](auto tag) {
      using T = decltype(tag);
      T* dst = out.data<T>();
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
        const float* src = work.data<float>() + offset;
        for (int64_t i = 0; i < out.numel(); ++i) {
          float value = op == ReduceOp::kAvg ? src[i] / static_cast<float>(world_size_) : src[i];
          dst[i] = from_double<T>(value);
        }
      } else if constexpr (!std::is_same_v<T, bool>) {
        const T* src = work.data<T>() + offset;
        for (int64_t i = 0; i < out.numel(); ++i)
          dst[i] = op == ReduceOp::kAvg ? static_cast<T>(src[i] / static_cast<T>(world_size_)) : src[i];
      }
    });
  }

  int rank_;
  int world_size_;
  std::shared_ptr<gloo::Context> context_;
  mutable std::mutex mutex_;  // one collective at a time: Gloo's tags must follow the same order on every rank
  mutable uint32_t tag_ = 0;
  mutable std::string failed_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(int rank, int world_size,
                                                     KeyValueStore& store,
                                                     std::chrono::milliseconds timeout) {
  // Gloo writes to its sockets with writev(2), which raises SIGPIPE once a peer has died; its
  // default action would end this process silently instead of letting Gloo report the broken
  // connection (Python, and so PyTorch, ignores SIGPIPE for the same reason). A program that
  // installed a handler of its own keeps it.
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL)
    std::signal(SIGPIPE, SIG_IGN);
  return std::make_unique<GlooCommunicator>(rank, world_size, store, timeout);
}

}  // namespace kiln
#endif  // KILN_HAVE_GLOO
