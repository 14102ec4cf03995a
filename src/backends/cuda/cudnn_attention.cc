// The "cudnn" dialect: attention (out, lse) and attention_grad (dq, dk, dv) through cuDNN's
// fused SDPA kernels, described with the cuDNN frontend's graph API. On Hopper these are
// reported well ahead of FlashAttention-2-style kernels (ours: "cuda-attention") for training
// shapes, so the dialect sits above cuda-attention (kCudnnPriority) for what it supports:
// f16 / bf16, d == dv, d % 8 == 0, d <= 128, layouts "bhtd" and "bthd".
//
// How a node maps onto cuDNN: every tensor is described as (B, H, T, D) with the strides of our
// layout, so nothing is copied: "bthd" (..., T, H, D) gives strides (T*H*D, D, H*D, 1), "bhtd"
// (..., H, T, D) is packed; the other leading dims fold into B. cuDNN's softmax statistic
// (Stats, (B, H, Tq, 1) f32, natural log, scale included) is exactly our lse; for "bthd" it is
// described with lse's strides (Tq*H, 1, H, 1), and if this cuDNN refuses that it is kept
// packed in the workspace and transposed by a small kernel (cudnn_attention.cu). (cuDNN 9.19 on
// an H100: the forward takes the strided Stats, the backward refuses it, so a "bthd" backward
// transposes lse first: 1.5 MB at GPT-2 size, next to 0.58 ms of attention.) Causal is
// cuDNN's diagonal band with right bound 0 aligned top-left: key j > query i is masked, our
// convention (PyTorch's is_causal) also for Tq != Tk.
//
// Graphs are built in KernelImpl::prepare (the executor's construction), never in the kernel
// call: the call runs under CUDA-graph capture, where building (which may compile kernels and
// allocate) is not allowed. They are cached per device by problem, so GPT-2's 12 identical
// layers share 2 graphs. A problem cuDNN refuses (this cuDNN, this GPU) is cached as such, and
// its node runs the cuda-attention launchers: the dialect never fails where cuda-attention works.
//
// Non-determinism: cuDNN's backward may accumulate dq with atomics, so dq can differ in the last
// bits from run to run (cuda-attention's backward is deterministic).
#include "backends/cuda/cudnn_attention.h"

#include "backends/cuda/registration.h"

#if KILN_HAVE_CUDNN

#include <cudnn.h>

#include <cmath>
#include <compare>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

#include "backends/cuda/attention.cuh"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cudnn_attention.cuh"

namespace kiln::cuda {
namespace {

namespace fe = cudnn_frontend;

// ---- the problem ----

// One attention problem as cuDNN sees it, and the key of the graph cache.
struct Problem {
  int device = 0;
  bool backward = false;
  DType dtype = DType::kBF16;
  int64_t b = 1, h = 1, tq = 0, tk = 0, d = 0;
  bool bthd = false;
  bool causal = false;
  double scale = 1.0;
  auto operator<=>(const Problem&) const = default;
};

std::string describe(const Problem& p) {
  return fmt::format("{} ({}, B {}, H {}, Tq {}, Tk {}, D {}, {}{}, scale {})",
                     p.backward ? "attention_grad" : "attention", dtype_name(p.dtype), p.b, p.h,
                     p.tq, p.tk, p.d, p.bthd ? "bthd" : "bhtd", p.causal ? ", causal" : "",
                     p.scale);
}

// The problem of a node with query q and key k of these shapes (already supported()).
Problem problem_of(const Shape& q, const Shape& k, DType dtype, const Attributes& attrs,
                   bool backward) {
  Problem p;
  p.backward = backward;
  p.dtype = dtype;
  p.bthd = attrs.s("layout") == "bthd";
  const size_t r = q.size();
  const size_t t_axis = p.bthd ? r - 3 : r - 2;
  // "bthd": (lead..., T, H, D); "bhtd": (lead..., [H,] T, D) with the dim before T as cuDNN's H
  // (any leading dims fold into B either way).
  const size_t lead_end = p.bthd ? t_axis : (t_axis >= 1 ? t_axis - 1 : 0);
  p.h = p.bthd ? q[r - 2] : (t_axis >= 1 ? q[t_axis - 1] : 1);
  for (size_t i = 0; i < lead_end; ++i) p.b *= q[i];
  p.tq = q[t_axis];
  p.tk = k[t_axis];
  p.d = q[r - 1];
  p.causal = attrs.b("causal");
  p.scale = attrs.has("scale") ? attrs.f("scale") : 1.0 / std::sqrt(static_cast<double>(p.d));
  return p;
}

// Strides of a (B, H, T, D) tensor in the problem's layout.
std::vector<int64_t> strides(const Problem& p, int64_t t) {
  if (p.bthd) return {t * p.h * p.d, p.d, p.h * p.d, 1};
  return {p.h * t * p.d, t * p.d, p.d, 1};
}

// Strides of Stats (B, H, Tq, 1): our lse's, or packed.
std::vector<int64_t> stats_strides(const Problem& p, bool packed) {
  if (p.bthd && !packed) return {p.tq * p.h, 1, p.h, 1};
  return {p.h * p.tq, p.tq, 1, 1};
}

// What the fallback launchers take (attention.cuh): B * H problems, heads apart for "bthd".
AttentionShape attention_shape(const Problem& p) {
  AttentionShape s;
  s.batch = p.b * p.h;
  s.heads = p.bthd ? p.h : 1;
  s.tq = p.tq;
  s.tk = p.tk;
  s.d = s.dv = p.d;
  s.causal = p.causal;
  s.scale = p.scale;
  return s;
}

AttentionDType attention_dtype(DType dtype) {
  return dtype == DType::kF16 ? AttentionDType::kF16 : AttentionDType::kBF16;
}

// ---- graphs ----

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

struct Plan {
  std::unique_ptr<fe::graph::Graph> graph;  // null: cuDNN refused, the node falls back
  bool packed_stats = false;                // Stats lives in the workspace, after cuDNN's part
  int64_t workspace = 0;                    // cuDNN's own need, bytes
  std::string note;                         // how it runs, or why it falls back
};

constexpr int64_t kWorkspaceAlignment = 256;

int64_t aligned(int64_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

int64_t stats_bytes(const Problem& p) {
  return p.b * p.h * p.tq * static_cast<int64_t>(sizeof(float));
}

// The graph of the problem, built down to an executable plan; an empty message on success, else
// the step that failed and cuDNN's reason.
std::string build_graph(const Problem& p, bool packed_stats, cudnnHandle_t handle, Plan& plan) {
  auto g = std::make_unique<fe::graph::Graph>();
  g->set_io_data_type(p.dtype == DType::kF16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto attrs = [&](const char* name, Uid uid, int64_t t) {
    return fe::graph::Tensor_attributes()
        .set_name(name)
        .set_uid(uid)
        .set_dim({p.b, p.h, t, p.d})
        .set_stride(strides(p, t));
  };
  auto stats_attrs = [&](fe::graph::Tensor_attributes& t) -> fe::graph::Tensor_attributes& {
    return t.set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({p.b, p.h, p.tq, 1})
        .set_stride(stats_strides(p, packed_stats));
  };
  auto q = g->tensor(attrs("q", kQ, p.tq));
  auto k = g->tensor(attrs("k", kK, p.tk));
  auto v = g->tensor(attrs("v", kV, p.tk));
  const float scale = static_cast<float>(p.scale);
  if (!p.backward) {
    auto options = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true)
                       .set_attn_scale(scale);
    if (p.causal)
      options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
          .set_diagonal_band_right_bound(0);
    auto [o, stats] = g->sdpa(q, k, v, options);
    o->set_output(true).set_uid(kO).set_dim({p.b, p.h, p.tq, p.d}).set_stride(strides(p, p.tq));
    stats->set_output(true);
    stats_attrs(*stats).set_name("stats");
  } else {
    auto o = g->tensor(attrs("out", kO, p.tq));
    auto dout = g->tensor(attrs("dout", kDO, p.tq));
    fe::graph::Tensor_attributes stats_desc;
    stats_desc.set_name("stats");
    auto stats = g->tensor(stats_attrs(stats_desc));
    auto options = fe::graph::SDPA_backward_attributes().set_name("attention_grad")
                       .set_attn_scale(scale);
    if (p.causal)
      options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
          .set_diagonal_band_right_bound(0);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
    dq->set_output(true).set_uid(kDQ).set_dim({p.b, p.h, p.tq, p.d}).set_stride(strides(p, p.tq));
    dk->set_output(true).set_uid(kDK).set_dim({p.b, p.h, p.tk, p.d}).set_stride(strides(p, p.tk));
    dv->set_output(true).set_uid(kDV).set_dim({p.b, p.h, p.tk, p.d}).set_stride(strides(p, p.tk));
  }
  auto step = [](const char* what, fe::error_t status) {
    return status.is_good() ? std::string() : fmt::format("{}: {}", what, status.get_message());
  };
  std::string why;
  if ((why = step("validate", g->validate())).empty() &&
      (why = step("build_operation_graph", g->build_operation_graph(handle))).empty() &&
      (why = step("create_execution_plans",
                  g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK})))
          .empty() &&
      (why = step("check_support", g->check_support())).empty() &&
      (why = step("build_plans", g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE)))
          .empty()) {
    why = step("get_workspace_size", g->get_workspace_size(plan.workspace));
  }
  if (why.empty()) {
    plan.graph = std::move(g);
    plan.packed_stats = packed_stats;
  }
  return why;
}

// ---- per-device state and the cache ----

// One cuDNN handle and one workspace per device. The workspace is shared by every graph of the
// device: kiln enqueues a device's work on one stream, so graphs never run at once. It only
// grows, in prepare; an outgrown one is kept allocated, since a captured CUDA graph of an
// earlier executor may still point at it.
struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::string unavailable;  // set when the handle could not be created (no cuDNN at run time)
  void* workspace = nullptr;
  int64_t capacity = 0;
  std::vector<void*> outgrown;
};

struct Cache {
  std::mutex mutex;
  std::map<int, DeviceState> devices;
  std::map<Problem, Plan> plans;
};

// Never destroyed: at exit the CUDA runtime may be torn down before static destructors run.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

DeviceState& device_state_locked(Cache& c, int device) {
  auto [it, inserted] = c.devices.try_emplace(device);
  DeviceState& s = it->second;
  if (inserted) {
    const cudnnStatus_t status = cudnnCreate(&s.handle);
    if (status != CUDNN_STATUS_SUCCESS) {
      s.handle = nullptr;
      s.unavailable = fmt::format("cudnnCreate failed: {}", cudnnGetErrorString(status));
    }
  }
  return s;
}

// The plan of the problem, built (and the device's workspace grown to fit it) on first use.
Plan& plan_locked(Cache& c, const Problem& p) {
  auto it = c.plans.find(p);
  if (it != c.plans.end()) return it->second;
  Plan& plan = c.plans[p];
  DeviceState& dev = device_state_locked(c, p.device);
  if (!dev.handle) {
    plan.note = "cuda-attention fallback: " + dev.unavailable;
    return plan;
  }
  std::string why = build_graph(p, false, dev.handle, plan);
  if (!why.empty() && p.bthd) {
    // Perhaps only the strided Stats is refused: try it packed (transposed by our kernels).
    const std::string packed_why = build_graph(p, true, dev.handle, plan);
    why = packed_why.empty() ? "" : why + "; with packed stats, " + packed_why;
  }
  if (!why.empty()) {
    plan.note = "cuda-attention fallback: " + why;
    return plan;
  }
  const int64_t need =
      plan.packed_stats ? aligned(plan.workspace) + stats_bytes(p) : plan.workspace;
  if (need > dev.capacity) {
    void* grown = nullptr;
    if (cudaMalloc(&grown, static_cast<size_t>(need)) != cudaSuccess) {
      cudaGetLastError();  // clear the (non-sticky) allocation error
      plan.graph.reset();
      plan.note = fmt::format("cuda-attention fallback: no device memory for cuDNN's {}-byte "
                              "workspace", need);
      return plan;
    }
    if (dev.workspace) dev.outgrown.push_back(dev.workspace);
    dev.workspace = grown;
    dev.capacity = need;
  }
  plan.note = fmt::format("cudnn{}, workspace {} bytes", plan.packed_stats ? ", packed stats" : "",
                          plan.workspace);
  return plan;
}

int current_device() {
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// ---- the KernelImpls ----

// Static checks only (no GPU calls): what cuDNN's SDPA documents for f16/bf16 training, within
// what the cuda-attention launchers take (they run the node when cuDNN refuses it).
bool supported(const NodeView& node, bool backward) {
  // cuda-attention's rules first: its kernels are the fallback where cuDNN refuses a problem.
  if (!attention_supported(node, backward)) return false;
  const auto& in = node.input_types;
  const DType dtype = in[0].dtype;
  if (dtype != DType::kF16 && dtype != DType::kBF16) return false;
  const int r = in[0].rank();
  const int t_axis = node.node.attrs.s("layout") == "bthd" ? r - 3 : r - 2;
  const int64_t d = in[0].shape[r - 1], dv = in[2].shape[r - 1];
  if (d != dv || d % 8 != 0 || d < 8 || d > 128) return false;
  return in[0].shape[t_axis] >= 1 && in[1].shape[t_axis] >= 1;
}

void prepare(const NodeView& node, bool backward) {
  const auto& in = node.input_types;
  Problem p = problem_of(in[0].shape, in[1].shape, in[0].dtype, node.node.attrs, backward);
  p.device = current_device();
  Cache& c = cache();
  std::lock_guard lock(c.mutex);
  plan_locked(c, p);
}

void fallback(const KernelArgs& args, const Problem& p, cudaStream_t stream) {
  const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2];
  if (!p.backward) {
    attention_forward(attention_dtype(p.dtype), q.raw(), k.raw(), v.raw(), args.outputs[0].raw(),
                      args.outputs[1].data<float>(), attention_shape(p), stream);
  } else {
    attention_backward(attention_dtype(p.dtype), q.raw(), k.raw(), v.raw(), args.inputs[3].raw(),
                       args.inputs[4].raw(), args.inputs[5].data<float>(), args.outputs[0].raw(),
                       args.outputs[1].raw(), args.outputs[2].raw(), attention_shape(p), stream);
  }
}

void run(const KernelArgs& args, bool backward) {
  const auto stream = static_cast<cudaStream_t>(args.stream);
  Problem p = problem_of(args.inputs[0].shape(), args.inputs[1].shape(), args.inputs[0].dtype(),
                         args.attrs, backward);
  p.device = current_device();
  Cache& c = cache();
  std::unique_lock lock(c.mutex);
  const Plan* plan = nullptr;
  if (auto it = c.plans.find(p); it != c.plans.end()) {
    plan = &it->second;
  } else {
    // Not prepared (a kernel called outside an executor): build now, unless the stream is being
    // captured, where building is not allowed; then this call falls back.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    KILN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) plan = &plan_locked(c, p);
  }
  if (!plan || !plan->graph) {
    lock.unlock();
    fallback(args, p, stream);
    return;
  }
  DeviceState& dev = c.devices.at(p.device);
  const cudnnStatus_t set = cudnnSetStream(dev.handle, stream);
  KILN_CHECK(set == CUDNN_STATUS_SUCCESS, "cudnn: cudnnSetStream failed for {}: {}", describe(p),
             cudnnGetErrorString(set));
  auto ptr = [](const Tensor& t) { return static_cast<void*>(t.raw()); };
  float* lse = (backward ? args.inputs[5] : args.outputs[1]).data<float>();
  float* stats = plan->packed_stats
                     ? reinterpret_cast<float*>(static_cast<std::byte*>(dev.workspace) +
                                                aligned(plan->workspace))
                     : lse;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, ptr(args.inputs[0])}, {kK, ptr(args.inputs[1])}, {kV, ptr(args.inputs[2])},
      {kStats, stats}};
  if (!backward) {
    pack[kO] = ptr(args.outputs[0]);
  } else {
    pack[kO] = ptr(args.inputs[3]);
    pack[kDO] = ptr(args.inputs[4]);
    pack[kDQ] = ptr(args.outputs[0]);
    pack[kDK] = ptr(args.outputs[1]);
    pack[kDV] = ptr(args.outputs[2]);
    if (plan->packed_stats) cudnn_lse_to_stats(lse, stats, p.b, p.h, p.tq, stream);
  }
  fe::error_t status = plan->graph->execute(dev.handle, pack, dev.workspace);
  KILN_CHECK(status.is_good(), "cudnn: executing {} failed: {}", describe(p),
             status.get_message());
  if (!backward && plan->packed_stats) cudnn_stats_to_lse(stats, lse, p.b, p.h, p.tq, stream);
}

}  // namespace

bool built_with_cudnn() { return true; }

std::vector<std::string> cudnn_attention_plans() {
  Cache& c = cache();
  std::lock_guard lock(c.mutex);
  std::vector<std::string> out;
  for (const auto& [p, plan] : c.plans)
    out.push_back(fmt::format("device {} {}: {}", p.device, describe(p), plan.note));
  return out;
}

void register_cudnn_attention_kernels(KernelRegistry& registry) {
  for (bool backward : {false, true}) {
    KernelImpl impl{"cudnn", Device::kCuda, kCudnnPriority,
                    [backward](const NodeView& node) { return supported(node, backward); },
                    [backward](const KernelArgs& args) { run(args, backward); }};
    impl.prepare = [backward](const NodeView& node) { prepare(node, backward); };
    registry.add(backward ? Op::kAttentionGrad : Op::kAttention, std::move(impl));
  }
}

}  // namespace kiln::cuda

#else  // !KILN_HAVE_CUDNN: no cuDNN or no frontend headers at configure time

namespace kiln::cuda {

bool built_with_cudnn() { return false; }
std::vector<std::string> cudnn_attention_plans() { return {}; }
void register_cudnn_attention_kernels(KernelRegistry&) {}

}  // namespace kiln::cuda

#endif
