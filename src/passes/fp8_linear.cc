#include "passes/fp8_linear.h"

#include <optional>
#include <string>

#include "ops/fp8.h"
#include "passes/uses.h"
#include "support/error.h"

namespace kiln {
namespace {

constexpr int64_t kFp8Multiple = 16;

// `id` with the casts in front of it peeled off.
ValueId through_casts(const Graph& graph, const Uses& uses, ValueId id) {
  for (int p = uses.producer[static_cast<size_t>(id)]; p >= 0 && graph.nodes[p].op == Op::kCast;
       p = uses.producer[static_cast<size_t>(id)])
    id = graph.nodes[p].inputs[0];
  return id;
}

bool is_param(const Graph& graph, ValueId id) {
  for (const GraphInput& in : graph.inputs)
    if (in.value == id) return in.role == Role::kParam;
  return false;
}

// Whether `id` reaches a cross_entropy through casts and reshapes: the classifier's logits.
bool feeds_loss(const Graph& graph, const Uses& uses, ValueId id) {
  for (int r : uses.readers[static_cast<size_t>(id)]) {
    const Node& n = graph.nodes[static_cast<size_t>(r)];
    if (n.op == Op::kCrossEntropy) return true;
    if ((n.op == Op::kCast || n.op == Op::kReshape) && feeds_loss(graph, uses, n.outputs[0]))
      return true;
  }
  return false;
}

struct Layer {
  int64_t rows = 0, in = 0, out = 0;
};

// The layer's sizes when `n` is a linear layer the FP8 rules allow, else nullopt.
std::optional<Layer> linear_layer(const Graph& graph, const Uses& uses, const Node& n) {
  if (n.op != Op::kMatmul || matmul_fp8(n.attrs).on()) return std::nullopt;
  const ValueId w = through_casts(graph, uses, n.inputs[1]);
  const TensorType &xt = graph.type(n.inputs[0]), &wt = graph.type(n.inputs[1]);
  if (!is_param(graph, w) || wt.rank() != 2 || xt.rank() < 2 || !is_float(xt.dtype)) return std::nullopt;
  if (n.attrs.b("transpose_a") && xt.rank() > 2) return std::nullopt;
  const int64_t k = n.attrs.b("transpose_a") ? xt.shape[xt.rank() - 2] : xt.shape.back();
  const int64_t rows = k == 0 ? 0 : numel(xt.shape) / k;
  for (int64_t d : {rows, k, wt.shape[0], wt.shape[1]})
    if (d == 0 || d % kFp8Multiple != 0) return std::nullopt;
  if (feeds_loss(graph, uses, n.outputs[0])) return std::nullopt;
  return Layer{rows, k, wt.shape[0] * wt.shape[1] / k};
}

}  // namespace

Fp8Estimate fp8_estimate(const CostModel& model, int64_t rows, int64_t in, int64_t out) {
  Fp8Estimate e;
  // (m, n, k) of the forward x w, dx = dy w^T and dw = x^T dy.
  const double products[3][3] = {{double(rows), double(out), double(in)},
                                 {double(rows), double(in), double(out)},
                                 {double(in), double(out), double(rows)}};
  for (const auto& p : products) {
    const double m = p[0], n = p[1], k = p[2], flops = 2 * m * n * k;
    e.bf16_s += flops / model.flops_per_s + model.launch_s;
    e.fp8_s += flops / model.fp8_flops_per_s + 5 * k * (m + n) / model.bytes_per_s + 5 * model.launch_s;
  }
  return e;
}

bool Fp8Linear::run(Graph& graph) {
  const Uses uses(graph);
  marked_ = skipped_ = slower_ = 0;
  for (Node& n : graph.nodes) {
    if (n.op != Op::kMatmul) continue;
    const std::optional<Layer> layer = linear_layer(graph, uses, n);
    if (!layer) {
      ++skipped_;
      continue;
    }
    if (!options_.every_linear) {
      const Fp8Estimate e = fp8_estimate(options_.model, layer->rows, layer->in, layer->out);
      if (e.fp8_s >= e.bf16_s) {
        ++slower_;
        continue;
      }
    }
    n.attrs.set("fp8_a", std::string("e4m3"));
    n.attrs.set("fp8_b", std::string("e4m3"));
    n.attrs.set("fp8_grad", std::string(fp8_name(options_.grad)));
    n.attrs.set("fp8_fast_accum", true);  // the forward's only (ops/fp8.h)
    ++marked_;
  }
  return marked_ > 0;
}

std::string fp8_summary(const Graph& step) {
  int fp8 = 0, all = 0;
  auto count = [&](const Graph& g, const auto& self) -> void {
    for (const Node& n : g.nodes) {
      if (n.op == Op::kMatmul) {
        ++all;
        fp8 += matmul_fp8(n.attrs).on();
      }
      if (n.body) self(*n.body, self);
    }
  };
  count(step, count);
  if (fp8 == 0)
    return fmt::format("fp8: none of the {} matmul products: no linear layer is wide enough for fp8 to be faster "
                       "(--fp8-every-linear takes every layer the FP8 rules allow)", all);
  return fmt::format("fp8: {} of the {} matmul products (linear layers and their gradients; the rest in bf16)", fp8, all);
}

std::vector<std::string> Fp8Linear::notes() const {
  return {fmt::format("{} linear product{} in fp8, {} kept in 16 bits where fp8 would be slower, {} other "
                      "matmul{}", marked_, marked_ == 1 ? "" : "s", slower_, skipped_, skipped_ == 1 ? "" : "s")};
}

}  // namespace kiln
