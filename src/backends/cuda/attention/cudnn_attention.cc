// The "cudnn" dialect: attention (out, lse) and attention_grad (dq, dk, dv), and their packed
// forms attention_qkv and attention_qkv_grad, through cuDNN's fused SDPA kernels, described with
// the cuDNN frontend's graph API. On Hopper these are
// reported well ahead of FlashAttention-2-style kernels (ours: "cuda-attention") for training
// shapes, so the dialect sits above cuda-attention (kCudnnPriority) for what it supports:
// f16 / bf16, d == dv, d % 8 == 0, d <= 128, layouts "bhtd" and "bthd".
//
// How a node maps onto cuDNN: every tensor is described as (B, H, T, D) with the strides of our
// layout, so nothing is copied: "bthd" (..., T, H, D) gives strides (T*H*D, D, H*D, 1), "bhtd"
// (..., H, T, D) is packed; the other leading dims fold into B. attention_qkv's packed
// (..., T, 3, H, D) gives q, k, v (and dq, dk, dv of its gradient) strides (T*3*H*D, D, 3*H*D, 1)
// at element offsets 0, H*D, 2*H*D of the one tensor: the projection is read, and its gradient
// written, in place. cuDNN's softmax statistic
// (Stats, (B, H, Tq, 1) f32, natural log, scale included) is exactly our lse; for "bthd" it is
// described with lse's strides (Tq*H, 1, H, 1), and if this cuDNN refuses that it is kept
// packed in the workspace and transposed by a small kernel (cudnn_attention.cu). (cuDNN 9.19 on
// an H100: the forward takes the strided Stats, the backward refuses it, so a "bthd" backward
// transposes lse first: 1.5 MB at GPT-2 size, next to 0.58 ms of attention.) Causal is
// cuDNN's diagonal band with right bound 0 aligned top-left: key j > query i is masked, our
// convention (PyTorch's is_causal) also for Tq != Tk. Grouped-query attention (k and v with
// fewer heads, dividing q's) is cuDNN's own: k, v, dk and dv are described with their head count
// and cuDNN's backward sums dk, dv over each group's query heads.
//
// Graphs are built in KernelImpl::prepare (the executor's construction), never in the kernel
// call: the call runs under CUDA-graph capture, where building (which may compile kernels and
// allocate) is not allowed. They are cached per device by problem, so GPT-2's 12 identical
// layers share 2 graphs. A problem cuDNN refuses (this cuDNN, this GPU) is cached as such, and
// its node runs the cuda-attention launchers: the dialect never fails where cuda-attention works.
//
// Non-determinism: cuDNN's backward may accumulate dq with atomics, so dq can differ in the last
// bits from run to run (cuda-attention's backward is deterministic); KILN_CUDNN_DETERMINISTIC=1
// asks cuDNN for a deterministic backward.
#include "backends/cuda/attention/cudnn_attention.h"

#include "backends/cuda/registration.h"

#if KILN_HAVE_CUDNN

#include <cudnn.h>

#include <cmath>
#include <compare>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

#include "backends/cuda/attention/attention.cuh"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/attention/cudnn_attention.cuh"
#include "backends/cuda/runtime/device.h"

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
  int64_t hk = 1;  // heads of k and v (grouped-query attention: fewer than h, dividing it)
  bool bthd = false;
  bool packed = false;  // attention_qkv: q, k, v (dq, dk, dv) parts of one (..., T, 3, H, D)
  bool causal = false;
  double scale = 1.0;
  auto operator<=>(const Problem&) const = default;
};

std::string describe(const Problem& p) {
  return fmt::format("{}{} ({}, B {}, H {}, Hkv {}, Tq {}, Tk {}, D {}, {}{}, scale {})",
                     p.packed ? "attention_qkv" : "attention", p.backward ? "_grad" : "",
                     dtype_name(p.dtype), p.b, p.h, p.hk, p.tq, p.tk, p.d,
                     p.packed ? "packed" : p.bthd ? "bthd" : "bhtd", p.causal ? ", causal" : "",
                     p.scale);
}

double scale_of(const Attributes& attrs, int64_t d) {
  return attrs.has("scale") ? attrs.f("scale") : 1.0 / std::sqrt(static_cast<double>(d));
}

// The problem of an attention_qkv(_grad) node with packed input qkv (..., T, 3, H, D).
Problem packed_problem_of(const Shape& qkv, DType dtype, const Attributes& attrs,
                          bool backward) {
  Problem p;
  p.backward = backward;
  p.dtype = dtype;
  p.bthd = p.packed = true;
  const size_t r = qkv.size();
  p.h = p.hk = qkv[r - 2];
  p.d = qkv[r - 1];
  p.tq = p.tk = qkv[r - 4];
  for (size_t i = 0; i + 4 < r; ++i) p.b *= qkv[i];
  p.causal = attrs.b("causal");
  p.scale = scale_of(attrs, p.d);
  return p;
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
  p.hk = p.bthd ? k[r - 2] : (t_axis >= 1 ? k[t_axis - 1] : 1);
  for (size_t i = 0; i < lead_end; ++i) p.b *= q[i];
  p.tq = q[t_axis];
  p.tk = k[t_axis];
  p.d = q[r - 1];
  p.causal = attrs.b("causal");
  p.scale = scale_of(attrs, p.d);
  return p;
}

// Strides of a (B, heads, T, D) tensor in the problem's layout (heads: p.h for q, out and their
// gradients, p.hk for k, v and theirs); `part`: one of the packed q, k, v (dq, dk, dv) of
// attention_qkv, three heads' rows to a token.
std::vector<int64_t> strides(const Problem& p, int64_t t, int64_t heads, bool part = false) {
  if (p.packed && part) return {t * 3 * p.h * p.d, p.d, 3 * p.h * p.d, 1};
  if (p.bthd) return {t * heads * p.d, p.d, heads * p.d, 1};
  return {heads * t * p.d, t * p.d, p.d, 1};
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
  s.group = p.h / p.hk;
  if (p.packed) s.qkv_row_stride = 3 * p.h * p.d;
  s.tq = p.tq;
  s.tk = p.tk;
  s.d = s.dv = p.d;
  s.causal = p.causal;
  s.scale = p.scale;
  return s;
}

// ---- graphs ----

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

struct Plan {
  // Its own handle (built with it, run with it): the forward and backward plans of a fresh
  // process build at once on two prepare threads (cuDNN allows one thread per handle at a
  // time). Never destroyed, like the cache.
  cudnnHandle_t handle = nullptr;
  std::unique_ptr<fe::graph::Graph> graph;  // null: cuDNN refused, the node falls back
  int64_t index = -1;                       // the execution plan built (-1: the heuristic's)
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
  // part: q, k, v (dq, dk, dv), which attention_qkv packs.
  auto attrs = [&](const char* name, Uid uid, int64_t t, int64_t heads, bool part) {
    return fe::graph::Tensor_attributes()
        .set_name(name)
        .set_uid(uid)
        .set_dim({p.b, heads, t, p.d})
        .set_stride(strides(p, t, heads, part));
  };
  auto stats_attrs = [&](fe::graph::Tensor_attributes& t) -> fe::graph::Tensor_attributes& {
    return t.set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({p.b, p.h, p.tq, 1})
        .set_stride(stats_strides(p, packed_stats));
  };
  auto q = g->tensor(attrs("q", kQ, p.tq, p.h, true));
  auto k = g->tensor(attrs("k", kK, p.tk, p.hk, true));
  auto v = g->tensor(attrs("v", kV, p.tk, p.hk, true));
  const float scale = static_cast<float>(p.scale);
  // Measurement knobs (bench/log/sessions-1-12.md): KILN_CUDNN_SDPA_IMPL=unified|composite picks the
  // forward's implementation (default: cuDNN's choice); KILN_CUDNN_PLAN_FORWARD=i and
  // KILN_CUDNN_PLAN_BACKWARD=i build execution plan i of the heuristic's list instead of the
  // first it can build.
  const char* impl = std::getenv("KILN_CUDNN_SDPA_IMPL");
  const char* plan_env =
      std::getenv(p.backward ? "KILN_CUDNN_PLAN_BACKWARD" : "KILN_CUDNN_PLAN_FORWARD");
  if (!p.backward) {
    auto options = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true)
                       .set_attn_scale(scale);
    if (impl && std::string(impl) == "unified")
      options.set_implementation(fe::AttentionImplementation_t::UNIFIED);
    if (impl && std::string(impl) == "composite")
      options.set_implementation(fe::AttentionImplementation_t::COMPOSITE);
    if (p.causal)
      options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
          .set_diagonal_band_right_bound(0);
    auto [o, stats] = g->sdpa(q, k, v, options);
    o->set_output(true).set_uid(kO).set_dim({p.b, p.h, p.tq, p.d})
        .set_stride(strides(p, p.tq, p.h));
    stats->set_output(true);
    stats_attrs(*stats).set_name("stats");
  } else {
    auto o = g->tensor(attrs("out", kO, p.tq, p.h, false));
    auto dout = g->tensor(attrs("dout", kDO, p.tq, p.h, false));
    fe::graph::Tensor_attributes stats_desc;
    stats_desc.set_name("stats");
    auto stats = g->tensor(stats_attrs(stats_desc));
    auto options = fe::graph::SDPA_backward_attributes().set_name("attention_grad")
                       .set_attn_scale(scale);
    // KILN_CUDNN_DETERMINISTIC=1: a backward without dq atomics, for runs compared bit for bit
    // (a cuDNN without such a plan refuses the problem: cuda-attention's backward, also
    // deterministic, runs it).
    const char* deterministic = std::getenv("KILN_CUDNN_DETERMINISTIC");
    if (deterministic && std::string(deterministic) == "1") options.set_deterministic_algorithm(true);
    if (p.causal)
      options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
          .set_diagonal_band_right_bound(0);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
    for (auto [t, uid, len, heads] :
         {std::tuple{dq, kDQ, p.tq, p.h}, {dk, kDK, p.tk, p.hk}, {dv, kDV, p.tk, p.hk}})
      t->set_output(true).set_uid(uid).set_dim({p.b, heads, len, p.d})
          .set_stride(strides(p, len, heads, true));
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
      (why = step("check_support", g->check_support())).empty()) {
    if (plan_env) {
      plan.index = std::atoi(plan_env);
      std::fprintf(stderr, "kiln: cudnn %s: %lld execution plans, building %lld\n",
                   describe(p).c_str(), static_cast<long long>(g->get_execution_plan_count()),
                   static_cast<long long>(plan.index));
      if ((why = step("build_plan_at_index", g->build_plan_at_index(plan.index))).empty())
        why = step("get_workspace_size",
                   g->get_workspace_size_plan_at_index(plan.index, plan.workspace));
    } else if ((why = step("build_plans", g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE)))
                   .empty()) {
      why = step("get_workspace_size", g->get_workspace_size(plan.workspace));
    }
  }
  if (why.empty()) {
    plan.graph = std::move(g);
    plan.packed_stats = packed_stats;
  }
  return why;
}

// ---- per-device state and the cache ----

// One workspace per device and stream, shared by the graphs run on that stream, which never run
// at once; two streams' may (two trainers in one process), and one workspace for both would
// let one graph overwrite the other's. It grows when a run on its stream needs more (the
// executor's first run of a step is uncaptured, so a captured run finds it grown); an outgrown
// one is kept allocated, since a captured CUDA graph of an earlier executor may still point at
// it.
struct DeviceState {
  void* workspace = nullptr;
  int64_t capacity = 0;
  std::vector<void*> outgrown;
};

struct Cache {
  std::mutex mutex;  // devices, plans, installing and running
  std::map<std::pair<int, cudaStream_t>, DeviceState> devices;  // by device and stream
  std::map<Problem, Plan> plans;
  // Problems a prepare has taken on: the other prepares of the same problem return at once
  // instead of waiting (11 more nodes of each of GPT-2's two problems share the plan).
  std::mutex claims_mutex;
  std::set<Problem> claimed;
};

// Never destroyed: at exit the CUDA runtime may be torn down before static destructors run.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

// The problem's plan, built on the calling thread with a handle of its own: no shared state,
// so two problems build at once (on a fresh machine each build JIT-compiles cuDNN's kernels,
// ~0.7 s for GPT-2's forward and its backward).
Plan build_plan(const Problem& p) {
  Plan plan;
  if (const cudnnStatus_t status = cudnnCreate(&plan.handle); status != CUDNN_STATUS_SUCCESS) {
    plan.handle = nullptr;
    plan.note = fmt::format("cuda-attention fallback: cudnnCreate failed: {}",
                            cudnnGetErrorString(status));
    return plan;
  }
  std::string why = build_graph(p, false, plan.handle, plan);
  if (!why.empty() && p.bthd) {
    // Perhaps only the strided Stats is refused: try it packed (transposed by our kernels).
    const std::string packed_why = build_graph(p, true, plan.handle, plan);
    why = packed_why.empty() ? "" : why + "; with packed stats, " + packed_why;
  }
  if (!why.empty()) plan.note = "cuda-attention fallback: " + why;
  return plan;
}

// The bytes of workspace a plan's runs use.
int64_t workspace_need(const Plan& plan, const Problem& p) {
  return plan.packed_stats ? aligned(plan.workspace) + stats_bytes(p) : plan.workspace;
}

// The workspace of (the problem's device, `stream`), grown to `need` bytes; null where it must
// grow and cannot (under capture, or out of memory): the caller falls back.
void* workspace_locked(Cache& c, const Problem& p, int64_t need, cudaStream_t stream) {
  DeviceState& dev = c.devices[{p.device, stream}];
  if (need <= dev.capacity) return dev.workspace;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KILN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  void* grown = nullptr;
  if (cudaMalloc(&grown, static_cast<size_t>(need)) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) allocation error
    return nullptr;
  }
  if (dev.workspace) dev.outgrown.push_back(dev.workspace);
  dev.workspace = grown;
  dev.capacity = need;
  return grown;
}

// Stores a built plan (the first one stored for a problem wins) and checks that the device has
// room for its workspace (each stream's is made on its first run).
Plan& install_locked(Cache& c, const Problem& p, Plan built) {
  auto [it, inserted] = c.plans.try_emplace(p, std::move(built));
  Plan& plan = it->second;
  if (!inserted) {
    // Another thread's plan was stored first (try_emplace left `built` intact): drop this one's.
    if (built.handle) cudnnDestroy(built.handle);
    return plan;
  }
  if (!plan.graph) return plan;
  const int64_t need = workspace_need(plan, p);
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess || static_cast<int64_t>(free) < need) {
    cudaGetLastError();
    plan.graph.reset();
    plan.note = fmt::format("cuda-attention fallback: no device memory for cuDNN's {}-byte workspace", need);
    return plan;
  }
  plan.note = fmt::format("cudnn{}, workspace {} bytes", plan.packed_stats ? ", packed stats" : "",
                          plan.workspace);
  return plan;
}

// ---- the KernelImpls ----

// Static checks only (no GPU calls): what cuDNN's SDPA documents for f16/bf16 training, within
// what the cuda-attention launchers take (they run the node when cuDNN refuses it).
bool supported(const NodeView& node, bool backward, bool packed) {
  // cuda-attention's rules first: its kernels are the fallback where cuDNN refuses a problem.
  if (!(packed ? attention_qkv_supported(node, backward) : attention_supported(node, backward)))
    return false;
  const auto& in = node.input_types;
  // A key_bias (padding mask) is cuda-attention's: this dialect's graphs take no bias.
  if (in.size() != (packed ? (backward ? 4u : 1u) : (backward ? 6u : 3u))) return false;
  const DType dtype = in[0].dtype;
  if (dtype != DType::kF16 && dtype != DType::kBF16) return false;
  const int r = in[0].rank();
  const int64_t d = in[0].shape[r - 1];
  if (packed) return d % 8 == 0 && d >= 8 && d <= 128 && in[0].shape[r - 4] >= 1;
  const int t_axis = node.node.attrs.s("layout") == "bthd" ? r - 3 : r - 2;
  const int64_t dv = in[2].shape[r - 1];
  if (d != dv || d % 8 != 0 || d < 8 || d > 128) return false;
  return in[0].shape[t_axis] >= 1 && in[1].shape[t_axis] >= 1;
}

Problem node_problem(std::span<const TensorType> in, const Attributes& attrs, bool backward,
                     bool packed) {
  Problem p = packed ? packed_problem_of(in[0].shape, in[0].dtype, attrs, backward)
                     : problem_of(in[0].shape, in[1].shape, in[0].dtype, attrs, backward);
  p.device = current_device();
  return p;
}

void prepare(const NodeView& node, bool backward, bool packed) {
  const Problem p = node_problem(node.input_types, node.node.attrs, backward, packed);
  Cache& c = cache();
  {
    std::lock_guard claim(c.claims_mutex);
    if (!c.claimed.insert(p).second) return;  // built, or being built by another prepare
  }
  Plan built = build_plan(p);
  std::lock_guard lock(c.mutex);
  install_locked(c, p, std::move(built));  // a run that built it meanwhile keeps its own
}

// Where a node's tensors are: attention(q, k, v) -> (out, lse), attention_grad(q, k, v, out,
// dout, lse) -> (dq, dk, dv); the packed forms take q, k, v (dq, dk, dv) at offsets of one
// tensor, attention_qkv_grad(qkv, out, dout, lse) -> dqkv.
struct Pointers {
  const void *q, *k, *v, *out, *dout = nullptr;
  float* lse;
  void *o = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
};

Pointers pointers_of(const KernelArgs& args, const Problem& p) {
  Pointers t{};
  const int in = p.packed ? 0 : 2;  // inputs before out (dout, lse) beyond q
  auto part = [&](const Tensor& x, int which) {
    const int64_t offset = p.packed ? which * p.h * p.d * static_cast<int64_t>(dtype_size(p.dtype))
                                    : 0;
    return static_cast<std::byte*>(x.raw()) + offset;
  };
  const Tensor& q = args.inputs[0];
  t.q = part(q, 0);
  t.k = p.packed ? part(q, 1) : args.inputs[1].raw();
  t.v = p.packed ? part(q, 2) : args.inputs[2].raw();
  if (!p.backward) {
    t.o = args.outputs[0].raw();
    t.out = t.o;
    t.lse = args.outputs[1].data<float>();
    return t;
  }
  t.out = args.inputs[in + 1].raw();
  t.dout = args.inputs[in + 2].raw();
  t.lse = args.inputs[in + 3].data<float>();
  t.dq = part(args.outputs[0], 0);
  t.dk = p.packed ? part(args.outputs[0], 1) : args.outputs[1].raw();
  t.dv = p.packed ? part(args.outputs[0], 2) : args.outputs[2].raw();
  return t;
}

void fallback(const Pointers& t, const Problem& p, cudaStream_t stream) {
  if (!p.backward) {
    attention_forward(p.dtype, t.q, t.k, t.v, nullptr, t.o, t.lse, attention_shape(p),
                      stream);
  } else {
    attention_backward(p.dtype, t.q, t.k, t.v, nullptr, t.out, t.dout, t.lse, t.dq, t.dk,
                       t.dv, attention_shape(p), stream);
  }
}

void run(const KernelArgs& args, bool backward, bool packed) {
  const auto stream = static_cast<cudaStream_t>(args.stream);
  std::vector<TensorType> types;
  for (const Tensor& t : args.inputs) types.push_back(t.type());
  const Problem p = node_problem(types, args.attrs, backward, packed);
  const Pointers t = pointers_of(args, p);
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
    if (capture == cudaStreamCaptureStatusNone) plan = &install_locked(c, p, build_plan(p));
  }
  const int64_t need = plan && plan->graph ? workspace_need(*plan, p) : 0;
  void* workspace = need > 0 ? workspace_locked(c, p, need, stream) : nullptr;
  if (!plan || !plan->graph || (need > 0 && !workspace)) {
    lock.unlock();
    fallback(t, p, stream);
    return;
  }
  const cudnnStatus_t set = cudnnSetStream(plan->handle, stream);
  KILN_CHECK(set == CUDNN_STATUS_SUCCESS, "cudnn: cudnnSetStream failed for {}: {}", describe(p),
             cudnnGetErrorString(set));
  // cuDNN's variant pack takes non-const pointers; it only reads the inputs.
  auto ptr = [](const void* x) { return const_cast<void*>(x); };
  float* stats = plan->packed_stats
                     ? reinterpret_cast<float*>(static_cast<std::byte*>(workspace) +
                                                aligned(plan->workspace))
                     : t.lse;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, ptr(t.q)}, {kK, ptr(t.k)}, {kV, ptr(t.v)}, {kStats, stats}};
  if (!backward) {
    pack[kO] = t.o;
  } else {
    pack[kO] = ptr(t.out);
    pack[kDO] = ptr(t.dout);
    pack[kDQ] = t.dq;
    pack[kDK] = t.dk;
    pack[kDV] = t.dv;
    if (plan->packed_stats) cudnn_lse_to_stats(t.lse, stats, p.b, p.h, p.tq, stream);
  }
  fe::error_t status =
      plan->index >= 0
          ? plan->graph->execute_plan_at_index(plan->handle, pack, workspace, plan->index)
          : plan->graph->execute(plan->handle, pack, workspace);
  KILN_CHECK(status.is_good(), "cudnn: executing {} failed: {}", describe(p),
             status.get_message());
  if (!backward && plan->packed_stats) cudnn_stats_to_lse(stats, t.lse, p.b, p.h, p.tq, stream);
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
  for (bool packed : {false, true}) {
    for (bool backward : {false, true}) {
      KernelImpl impl{
          "cudnn", Device::kCuda, kCudnnPriority,
          [=](const NodeView& node) { return supported(node, backward, packed); },
          [=](const KernelArgs& args) { run(args, backward, packed); }};
      impl.prepare = [=](const NodeView& node) { prepare(node, backward, packed); };
      const Op op = packed ? (backward ? Op::kAttentionQkvGrad : Op::kAttentionQkv)
                           : (backward ? Op::kAttentionGrad : Op::kAttention);
      registry.add(op, std::move(impl));
    }
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
