// Memory-bound CUDA kernels at GPT-2's sizes: time and GB/s (the bytes each call must move at
// least, over its time), with a device-to-device copy for scale.
//   nn           the "cuda-nn" kernels: layer norm, cross entropy, softmax, gelu_grad, AdamW,
//                scatter_add, gather (f32 and bf16);
//   movement     transposes, casts, sums, reshape, split, concat, slice, broadcast_to, generic
//                "cuda" against "cuda-movement";
//   classifier   the fused classifier (bf16 logits in place, row in shared memory or re-read;
//                f32 logits) against the four unfused kernels it replaces;
//   multi-tensor AdamW over GPT-2's 148 params in one multi-tensor call against per-param
//                launches; the global sum of squares; the casts of the weights to bf16.
// Prints numbers (moved from tests/cuda/{nn,movement,classifier,multi_tensor}_test.cc); runs on
// the GPU machine.
//
// Usage: gpu_memory_bench [nn | movement | classifier | multi-tensor]...   (none: all)
#include "backends/cuda/classifier/classifier.cuh"
#include "backends/cuda/runtime/device_errors.h"
#include "gpu_bench_util.h"

namespace kiln {
namespace {

using bench::choose_kernel;
using bench::ChosenKernel;
using bench::random_device;
using bench::time_ms;

constexpr int kReps = 20;

void print_bandwidth(const std::string& what, double bytes, double ms) {
  fmt::print("{:<56} {:8.3f} ms {:7.0f} GB/s\n", what, ms, bytes / (ms * 1e-3) / 1e9);
}

void copy_for_scale(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  auto a = cuda::allocate(bytes), b = cuda::allocate(bytes);
  const double ms = time_ms(stream, kReps, [&] {
    KILN_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream));
  });
  print_bandwidth("copy 1 GiB (read + write)", 2.0 * bytes, ms);
}

// Device inputs for a kernel: floats random, integers (labels, indices) in [0, 700).
std::vector<Tensor> device_inputs(const std::vector<TensorType>& types) {
  std::vector<Tensor> in;
  uint64_t seed = 200;
  for (const TensorType& t : types)
    in.push_back(is_float(t.dtype) ? random_device(t, seed++)
                                   : random_device(t, seed++, 0.0, 700.0));
  return in;
}

std::vector<Tensor> device_outputs(const std::vector<TensorType>& types) {
  std::vector<Tensor> out;
  for (const TensorType& t : types) out.push_back(cuda::device_tensor(t, false));
  return out;
}

void nn() {
  cuda::Stream stream_owner;
  const auto stream = static_cast<cudaStream_t>(stream_owner.handle());
  copy_for_scale(stream);
  auto run = [&](Op op, const std::vector<TensorType>& in_types, Attributes attrs,
                 const std::string& what, double bytes) {
    const ChosenKernel k = choose_kernel(op, in_types, std::move(attrs), {"cuda-nn"});
    const std::vector<Tensor> in = device_inputs(k.inputs);
    std::vector<Tensor> out = device_outputs(k.outputs);
    print_bandwidth(what, bytes, time_ms(stream, kReps, [&] { k(in, out, stream); }));
  };
  for (DType d : {DType::kF32, DType::kBF16}) {
    const double e = static_cast<double>(dtype_size(d));
    const int64_t rows = 32768, c = 768, v = 50257, ce_rows = 8192;
    const std::string t(dtype_name(d));
    run(Op::kLayerNorm, {{d, {rows, c}}, {d, {c}}, {d, {c}}}, {}, "layer_norm 32768x768 " + t,
        2.0 * rows * c * e);
    run(Op::kLayerNormGrad, {{d, {rows, c}}, {d, {c}}, {d, {rows, c}}}, {},
        "layer_norm_grad 32768x768 " + t, 3.0 * rows * c * e);
    run(Op::kCrossEntropy, {{d, {ce_rows, v}}, {DType::kI64, {ce_rows}}}, {},
        "cross_entropy 8192x50257 " + t, 1.0 * ce_rows * v * e);
    run(Op::kCrossEntropyGrad, {{d, {ce_rows, v}}, {DType::kI64, {ce_rows}}, {d, {}}}, {},
        "cross_entropy_grad 8192x50257 " + t, 2.0 * ce_rows * v * e);
    run(Op::kSoftmax, {{d, {ce_rows, v}}}, {}, "softmax 8192x50257 " + t, 2.0 * ce_rows * v * e);
    run(Op::kGeluGrad, {{d, {rows, 4 * c}}, {d, {rows, 4 * c}}},
        {{"approximate", std::string("tanh")}}, "gelu_grad 32768x3072 " + t,
        3.0 * rows * 4 * c * e);
  }
  const int64_t params = 124'000'000;
  const TensorType p{DType::kF32, {params}}, scalar{DType::kF32, {}};
  run(Op::kOptimizerUpdate, {p, p, p, p, scalar, scalar}, {{"optimizer", "adamw"}}, "adamw update 124M f32",
      7.0 * params * 4);
  run(Op::kScatterAdd,
      {{DType::kF32, {50257, 768}}, {DType::kI64, {32768}}, {DType::kF32, {32768, 768}}}, {},
      "scatter_add 32768 rows into 50257x768 f32", (2.0 * 50257 + 32768) * 768 * 4);
  run(Op::kGather, {{DType::kF32, {50257, 768}}, {DType::kI64, {32768}}}, {},
      "gather 32768 rows of 50257x768 f32", 2.0 * 32768 * 768 * 4);
  cuda::check_device_errors();
}

void movement() {
  cuda::Stream stream_owner;
  const auto stream = static_cast<cudaStream_t>(stream_owner.handle());
  copy_for_scale(stream);
  auto run = [&](Op op, const std::vector<TensorType>& in_types, Attributes attrs,
                 const std::string& what) {
    const ChosenKernel generic = choose_kernel(op, in_types, attrs, {"cuda"});
    const ChosenKernel fast = choose_kernel(op, in_types, attrs, {"cuda-movement"});
    double bytes = 0;
    for (const TensorType& t : generic.inputs) bytes += static_cast<double>(t.bytes());
    for (const TensorType& t : generic.outputs) bytes += static_cast<double>(t.bytes());
    std::vector<Tensor> in, out = device_outputs(generic.outputs);
    for (const TensorType& t : generic.inputs) in.push_back(cuda::device_tensor(t, true));
    const double generic_ms = time_ms(stream, kReps, [&] { generic(in, out, stream); });
    const double fast_ms = time_ms(stream, kReps, [&] { fast(in, out, stream); });
    fmt::print("{:<52} generic {:8.3f} ms {:6.0f} GB/s | movement {:8.3f} ms {:6.0f} GB/s\n", what,
               generic_ms, bytes / (generic_ms * 1e-3) / 1e9, fast_ms,
               bytes / (fast_ms * 1e-3) / 1e9);
  };
  using Ints = std::vector<int64_t>;
  const DType bf16 = DType::kBF16, f32 = DType::kF32;
  run(Op::kTranspose, {{bf16, {32, 1024, 12, 64}}}, {{"perm", Ints{0, 2, 1, 3}}},
      "transpose bf16 (32,1024,12,64) perm 0213");
  run(Op::kTranspose, {{bf16, {32, 12, 1024, 64}}}, {{"perm", Ints{0, 2, 1, 3}}},
      "transpose bf16 (32,12,1024,64) perm 0213");
  run(Op::kTranspose, {{f32, {32, 1024, 12, 64}}}, {{"perm", Ints{0, 2, 1, 3}}},
      "transpose f32 (32,1024,12,64) perm 0213");
  run(Op::kTranspose, {{bf16, {32768, 768}}}, {{"perm", Ints{1, 0}}},
      "transpose bf16 (32768,768) perm 10 (tiled)");
  run(Op::kTranspose, {{f32, {32768, 768}}}, {{"perm", Ints{1, 0}}},
      "transpose f32 (32768,768) perm 10 (tiled)");
  run(Op::kCast, {{f32, {32, 1024, 768}}}, {{"dtype", bf16}}, "cast f32->bf16 (32,1024,768)");
  run(Op::kCast, {{bf16, {32, 1024, 768}}}, {{"dtype", f32}}, "cast bf16->f32 (32,1024,768)");
  run(Op::kCast, {{f32, {32, 1024, 50304}}}, {{"dtype", bf16}}, "cast f32->bf16 (32,1024,50304)");
  run(Op::kCast, {{f32, {768, 2304}}}, {{"dtype", bf16}}, "cast f32->bf16 (768,2304) weight");
  run(Op::kSum, {{f32, {32768, 2304}}}, {{"axes", Ints{0}}}, "sum f32 (32768,2304) axes [0]");
  run(Op::kSum, {{f32, {32768, 768}}}, {{"axes", Ints{0}}}, "sum f32 (32768,768) axes [0]");
  run(Op::kSum, {{bf16, {32, 1024, 3072}}}, {{"axes", Ints{0, 1}}},
      "sum bf16 (32,1024,3072) axes [0,1]");
  run(Op::kSum, {{bf16, {32768, 2304}}}, {{"axes", Ints{0}}}, "sum bf16 (32768,2304) axes [0]");
  run(Op::kSum, {{f32, {32768, 768}}}, {{"axes", Ints{1}}}, "sum f32 (32768,768) axes [1]");
  run(Op::kReshape, {{bf16, {32, 1024, 768}}}, {{"shape", Ints{32768, 768}}},
      "reshape bf16 (32,1024,768)");
  run(Op::kSplit, {{bf16, {32, 1024, 2304}}},
      {{"axis", int64_t{-1}}, {"sizes", Ints{768, 768, 768}}},
      "split bf16 (32,1024,2304) -> 3x768");
  run(Op::kConcat, {{bf16, {32, 1024, 768}}, {bf16, {32, 1024, 768}}, {bf16, {32, 1024, 768}}},
      {{"axis", int64_t{-1}}}, "concat bf16 3x(32,1024,768) -> 2304");
  run(Op::kSlice, {{bf16, {32, 1024, 2304}}},
      {{"starts", Ints{0, 0, 768}}, {"ends", Ints{32, 1024, 1536}}},
      "slice bf16 (32,1024,2304)[..., 768:1536]");
  run(Op::kBroadcastTo, {{bf16, {768}}}, {{"shape", Ints{32, 1024, 768}}},
      "broadcast_to bf16 (768) -> (32,1024,768)");
  run(Op::kBroadcastTo, {{f32, {32768, 1}}}, {{"shape", Ints{32768, 768}}},
      "broadcast_to f32 (32768,1) -> (32768,768)");
}

void classifier() {
  namespace cls = cuda::classifier;
  const int64_t rows = 32768, vocab = 50304;
  cuda::Stream stream_owner;
  const auto stream = static_cast<cudaStream_t>(stream_owner.handle());
  const Shape logits_shape = {rows, vocab};
  const Tensor labels = random_device({DType::kI64, {rows}}, 1, 0, vocab);
  const Tensor dloss =
      cuda::to_device(Tensor::from_f64({DType::kF32, {}}, std::vector<double>{1.0}));
  Tensor loss = cuda::device_tensor({DType::kF32, {}});
  for (int variant = 0; variant < 3; ++variant) {
    // bf16 logits, gradient in place (the form with both casts absorbed), the row kept in
    // shared memory or read twice; f32 logits with a bf16 gradient (the form when the step also
    // returns the f32 logits).
    const DType logits_t = variant < 2 ? DType::kBF16 : DType::kF32;
    cls::set_row_path(variant == 0 ? cls::RowPath::kShared : cls::RowPath::kReread);
    const Tensor logits = random_device({logits_t, logits_shape}, 2, -6.0, 6.0);
    const Tensor grad = logits_t == DType::kBF16
                            ? logits
                            : cuda::device_tensor({DType::kBF16, logits_shape}, false);
    cls::Problem p;
    p.logits_t = logits_t;
    p.logits = logits.raw();
    p.grad_t = DType::kBF16;
    p.dlogits = grad.raw();
    p.labels = labels.raw();
    p.dloss = dloss.data<float>();
    p.loss = loss.data<float>();
    p.rows = rows;
    p.vocab = vocab;
    const double ms = time_ms(stream, 10, [&] { cls::fused_classifier(p, stream); });
    const double logits_bytes = static_cast<double>(logits.bytes());
    const double grad_bytes = static_cast<double>(rows * vocab * 2);
    const cls::LaunchInfo info = cls::launch_info(p.logits_t, vocab);
    fmt::print(
        "fused classifier, {} logits -> bf16 grad{}, {} x {}: {:.3f} ms; bytes (logits "
        "read twice + grad written once) {:.2f} GB -> {:.0f} GB/s; DRAM bytes if the row "
        "is read once {:.2f} GB -> {:.0f} GB/s (threads {}, row in shared memory: {})\n",
        dtype_name(logits_t), logits_t == DType::kBF16 ? " in place" : "", rows, vocab, ms,
        (2 * logits_bytes + grad_bytes) / 1e9, (2 * logits_bytes + grad_bytes) / ms / 1e6,
        (logits_bytes + grad_bytes) / 1e9, (logits_bytes + grad_bytes) / ms / 1e6, info.threads,
        info.row_in_shared_memory ? "yes" : "no");
  }
  cls::set_row_path(cls::RowPath::kShared);  // the default
  cuda::check_device_errors();
  // The unfused ops it replaces, as the bf16 step runs them: cast bf16 -> f32, cross_entropy,
  // cross_entropy_grad (f32), cast f32 -> bf16.
  const TensorType bf{DType::kBF16, logits_shape}, f32{DType::kF32, logits_shape};
  const ChosenKernel cast_up = choose_kernel(Op::kCast, {bf}, {{"dtype", DType::kF32}});
  const ChosenKernel loss_k = choose_kernel(Op::kCrossEntropy, {f32, labels.type()}, {});
  const ChosenKernel grad_k =
      choose_kernel(Op::kCrossEntropyGrad, {f32, labels.type(), dloss.type()}, {});
  const ChosenKernel cast_down = choose_kernel(Op::kCast, {f32}, {{"dtype", DType::kBF16}});
  const Tensor bf_logits = random_device(bf, 3, -6.0, 6.0);
  Tensor f32_logits = cuda::device_tensor(f32, false), g32 = cuda::device_tensor(f32, false);
  Tensor gbf = cuda::device_tensor(bf, false);
  auto call = [&](const ChosenKernel& k, std::vector<Tensor> in, std::vector<Tensor> out) {
    k(in, out, stream);
  };
  const double ms = time_ms(stream, 10, [&] {
    call(cast_up, {bf_logits}, {f32_logits});
    call(loss_k, {f32_logits, labels}, {loss});
    call(grad_k, {f32_logits, labels, dloss}, {g32});
    call(cast_down, {g32}, {gbf});
  });
  fmt::print(
      "unfused: cast ({}) + cross_entropy ({}) + cross_entropy_grad ({}) + cast ({}): "
      "{:.3f} ms\n",
      cast_up.impl->dialect, loss_k.impl->dialect, grad_k.impl->dialect, cast_down.impl->dialect,
      ms);
  cuda::check_device_errors();
}

// GPT-2 (124M)'s 148 parameter shapes, in the model's order.
std::vector<Shape> gpt2_shapes() {
  const int64_t C = 768, V = 50304, T = 1024;
  std::vector<Shape> s = {{V, C}, {T, C}};
  for (int layer = 0; layer < 12; ++layer) {
    const std::vector<Shape> block = {{C}, {C}, {C, 3 * C}, {3 * C}, {C, C},     {C},
                                      {C}, {C}, {C, 4 * C}, {4 * C}, {4 * C, C}, {C}};
    s.insert(s.end(), block.begin(), block.end());
  }
  s.push_back({C});
  s.push_back({C});
  return s;
}

std::vector<TensorType> input_types(const Graph& body) {
  std::vector<TensorType> out;
  for (const GraphInput& in : body.inputs) out.push_back(body.type(in.value));
  return out;
}

// The fused node of `body` (kind `kind`, as the multi-tensor pass makes it) on `dialect`.
ChosenKernel fused_kernel(std::shared_ptr<const Graph> body, const char* kind,
                          const char* dialect) {
  return choose_kernel(Op::kFused, input_types(*body), {{"kind", std::string(kind)}}, {dialect},
                       std::move(body));
}

void multi_tensor() {
  const std::vector<Shape> shapes = gpt2_shapes();
  cuda::Stream stream_owner;
  const auto s = static_cast<cudaStream_t>(stream_owner.handle());
  // The update body: (param, grad, m, v) per member, then lr and step once.
  auto body = std::make_shared<Graph>();
  std::vector<Tensor> inputs;
  std::vector<std::vector<ValueId>> operands;
  int64_t params = 0;
  uint64_t seed = 1;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const TensorType t{DType::kF32, shapes[k]};
    params += t.numel();
    std::vector<ValueId> ids;
    for (const char* part : {"p", "g", "m", "v"}) {
      ids.push_back(body->add_input(fmt::format("{}{}", part, k), t, Role::kData));
      inputs.push_back(random_device(t, seed++, part[0] == 'v' ? 0.01 : -1.0, 1.0));
    }
    operands.push_back(ids);
  }
  const std::vector<ValueId> scalars = {body->add_input("lr", {DType::kF32, {}}, Role::kData),
                                        body->add_input("step", {DType::kF32, {}}, Role::kData)};
  inputs.push_back(cuda::to_device(Tensor::from_f64({DType::kF32, {}}, std::vector<double>{0.01})));
  inputs.push_back(cuda::to_device(Tensor::from_f64({DType::kF32, {}}, std::vector<double>{3})));
  for (std::vector<ValueId>& ids : operands) {
    ids.insert(ids.end(), scalars.begin(), scalars.end());
    for (ValueId out : body->add_node(Op::kOptimizerUpdate, ids, {{"optimizer", "adamw"}, {"weight_decay", 0.1}}))
      body->outputs.push_back(out);
  }
  const ChosenKernel grouped = fused_kernel(body, "multi-tensor-update", "cuda-nn");
  // In place, as in a training step: results over the params and moments.
  std::vector<Tensor> in_place;
  for (size_t k = 0; k < shapes.size(); ++k)
    for (int r : {0, 2, 3}) in_place.push_back(inputs[4 * k + r]);
  const double grouped_ms = time_ms(s, kReps, [&] { grouped(inputs, in_place, s); });
  std::vector<ChosenKernel> alone;
  std::vector<std::vector<Tensor>> member_in, member_out;
  for (size_t k = 0; k < body->nodes.size(); ++k) {
    const Node& member = body->nodes[k];
    std::vector<TensorType> types;
    member_in.emplace_back();
    for (ValueId id : member.inputs) {
      member_in.back().push_back(inputs[static_cast<size_t>(body->input_index(id))]);
      types.push_back(body->type(id));
    }
    alone.push_back(choose_kernel(Op::kOptimizerUpdate, types, member.attrs, {"cuda-nn"}));
    member_out.push_back({in_place[3 * k], in_place[3 * k + 1], in_place[3 * k + 2]});
  }
  const double per_param_ms = time_ms(s, kReps, [&] {
    for (size_t k = 0; k < alone.size(); ++k) alone[k](member_in[k], member_out[k], s);
  });
  const double bytes = 7.0 * 4.0 * static_cast<double>(params);
  fmt::print(
      "adamw over GPT-2's {} f32 params ({} elements): one multi-tensor call {:.3f} ms "
      "({:.0f} GB/s), {} per-param launches {:.3f} ms ({:.0f} GB/s)\n",
      shapes.size(), params, grouped_ms, bytes / grouped_ms / 1e6, shapes.size(), per_param_ms,
      bytes / per_param_ms / 1e6);

  // The global sum of squares over the same tensors (as grads) against square + sum per tensor
  // and the chain of adds, each through the kernels the ungrouped step would use (cuda-body).
  auto norm_body = std::make_shared<Graph>();
  ValueId total = -1;
  std::vector<Tensor> grads;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const ValueId x =
        norm_body->add_input(fmt::format("g{}", k), {DType::kF32, shapes[k]}, Role::kData);
    const ValueId term = norm_body->add(Op::kSum, {norm_body->add(Op::kSquare, {x})});
    total = total < 0 ? term : norm_body->add(Op::kAdd, {total, term});
    grads.push_back(inputs[4 * k + 1]);
  }
  norm_body->outputs.push_back(total);
  const ChosenKernel norm = fused_kernel(norm_body, "global-norm", "cuda-nn");
  const ChosenKernel node_by_node = fused_kernel(norm_body, "global-norm", "cuda-body");
  std::vector<Tensor> norm_out = device_outputs(norm.outputs);
  const double norm_ms = time_ms(s, kReps, [&] { norm(grads, norm_out, s); });
  const double unfused_ms = time_ms(s, kReps, [&] { node_by_node(grads, norm_out, s); });
  fmt::print(
      "global sum of squares over the same {} tensors: multi-tensor {:.3f} ms ({:.0f} GB/s), "
      "node by node (cuda-body: {} squares, sums and {} adds) {:.3f} ms\n",
      shapes.size(), norm_ms, 4.0 * static_cast<double>(params) / norm_ms / 1e6, shapes.size(),
      shapes.size() - 1, unfused_ms);

  // The casts mixed precision makes: every weight and bias but the LayerNorms' and wpe to bf16.
  auto cast_body = std::make_shared<Graph>();
  std::vector<Tensor> cast_in;
  int64_t cast_elements = 0;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const bool layer_norm =
        k >= 2 && k < 2 + 12 * 12 &&
        ((k - 2) % 12 == 0 || (k - 2) % 12 == 1 || (k - 2) % 12 == 6 || (k - 2) % 12 == 7);
    if (k == 1 || k >= 2 + 12 * 12 || layer_norm) continue;  // wpe is gathered in f32
    const ValueId x =
        cast_body->add_input(fmt::format("w{}", k), {DType::kF32, shapes[k]}, Role::kData);
    cast_body->outputs.push_back(cast_body->add(Op::kCast, {x}, {{"dtype", DType::kBF16}}));
    cast_in.push_back(inputs[4 * k]);
    cast_elements += numel(shapes[k]);
  }
  const ChosenKernel casts = fused_kernel(cast_body, "multi-tensor-cast", "cuda-nn");
  std::vector<Tensor> cast_out = device_outputs(casts.outputs);
  const double cast_ms = time_ms(s, kReps, [&] { casts(cast_in, cast_out, s); });
  std::vector<ChosenKernel> single;
  for (const Tensor& w : cast_in)
    single.push_back(choose_kernel(Op::kCast, {w.type()}, {{"dtype", DType::kBF16}}));
  const double single_ms = time_ms(s, kReps, [&] {
    for (size_t k = 0; k < single.size(); ++k)
      single[k](std::span<const Tensor>(&cast_in[k], 1), std::span<Tensor>(&cast_out[k], 1), s);
  });
  fmt::print(
      "cast of GPT-2's {} weights and biases to bf16 ({} elements): one multi-tensor call "
      "{:.3f} ms ({:.0f} GB/s), {} single casts ({}) {:.3f} ms\n",
      cast_in.size(), cast_elements, cast_ms,
      6.0 * static_cast<double>(cast_elements) / cast_ms / 1e6, cast_in.size(),
      single.empty() ? "" : single[0].impl->dialect, single_ms);
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  return kiln::bench::run_sections("gpu_memory_bench", argc, argv,
                                   {{"nn", kiln::nn},
                                    {"movement", kiln::movement},
                                    {"classifier", kiln::classifier},
                                    {"multi-tensor", kiln::multi_tensor}});
}
