#include "ir/builder.h"

#include "ir/verifier.h"
#include "support/error.h"

namespace kiln {

Builder& Expr::builder() const {
  KILN_CHECK(builder_ != nullptr, "use of an empty Expr (not built by a Builder)");
  return *builder_;
}

TensorType Expr::type() const { return builder().graph().type(id_); }

int64_t Expr::dim(int axis) const { return shape()[normalize_axis(axis, rank())]; }

Expr Expr::named(const std::string& name) const {
  Graph& g = builder().graph();
  for (const Value& v : g.values)
    KILN_CHECK(v.name != name, "value name '{}' is already used in graph '{}'", name, g.name);
  g.values[id_].name = name;
  return *this;
}

Builder::Builder(std::string graph_name) { graph_.name = std::move(graph_name); }

Expr Builder::wrap(ValueId id) {
  KILN_CHECK(graph_.is_valid(id), "value id {} does not exist in graph '{}'", id, graph_.name);
  return Expr(this, id);
}

Graph Builder::take() {
  Graph done = std::move(graph_);
  graph_ = Graph{};
  graph_.name = done.name;
  return done;
}

Expr Builder::input(const std::string& name, Shape shape, DType dtype, Role role) {
  return Expr(this, graph_.add_input(name, TensorType{dtype, std::move(shape)}, role));
}
Expr Builder::param(const std::string& name, Shape shape, DType dtype) {
  return input(name, std::move(shape), dtype, Role::kParam);
}
Expr Builder::state(const std::string& name, Shape shape, DType dtype) {
  return input(name, std::move(shape), dtype, Role::kState);
}
Expr Builder::data(const std::string& name, Shape shape, DType dtype) {
  return input(name, std::move(shape), dtype, Role::kData);
}

std::vector<Expr> Builder::apply(Op op, const std::vector<Expr>& inputs, Attributes attrs) {
  std::vector<ValueId> ids;
  for (const Expr& e : inputs) {
    KILN_CHECK(&e.builder() == this, "{}: an input was built by another Builder", op_name(op));
    ids.push_back(e.id());
  }
  std::vector<Expr> out;
  for (ValueId id : graph_.add_node(op, std::move(ids), std::move(attrs))) out.emplace_back(this, id);
  return out;
}

Expr Builder::apply1(Op op, const std::vector<Expr>& inputs, Attributes attrs) {
  std::vector<Expr> out = apply(op, inputs, std::move(attrs));
  KILN_CHECK(out.size() == 1, "{} has {} outputs, expected 1", op_name(op), out.size());
  return out[0];
}

Expr Builder::full(Shape shape, double value, DType dtype) {
  return apply1(Op::kFull, {}, {{"dtype", dtype}, {"shape", shape}, {"value", value}});
}

Expr Builder::constant(Shape shape, std::vector<double> values, DType dtype) {
  return apply1(Op::kConstant, {}, {{"dtype", dtype}, {"shape", shape}, {"values", values}});
}

Expr Builder::constant_ints(Shape shape, std::vector<int64_t> values, DType dtype) {
  return apply1(Op::kConstant, {}, {{"dtype", dtype}, {"shape", shape}, {"values", values}});
}

Expr Builder::iota(Shape shape, int64_t axis, DType dtype) {
  return apply1(Op::kIota, {}, {{"dtype", dtype}, {"shape", shape}, {"axis", axis}});
}

Graph Builder::finish(const std::vector<Expr>& outputs) {
  KILN_CHECK(!outputs.empty(), "graph '{}' needs at least one output", graph_.name);
  graph_.outputs.clear();
  for (const Expr& e : outputs) {
    KILN_CHECK(&e.builder() == this, "an output of graph '{}' was built by another Builder", graph_.name);
    graph_.outputs.push_back(e.id());
  }
  verify(graph_);
  return take();
}

namespace {
Expr unary(Op op, Expr x, Attributes attrs = {}) { return x.builder().apply1(op, {x}, std::move(attrs)); }
Expr binary(Op op, Expr a, Expr b) { return a.builder().apply1(op, {a, b}); }
Expr scalar_like(const Expr& x, double v) { return x.builder().scalar(v, x.dtype()); }
}  // namespace

Expr operator+(Expr a, Expr b) { return binary(Op::kAdd, a, b); }
Expr operator-(Expr a, Expr b) { return binary(Op::kSub, a, b); }
Expr operator*(Expr a, Expr b) { return binary(Op::kMul, a, b); }
Expr operator/(Expr a, Expr b) { return binary(Op::kDiv, a, b); }
Expr operator+(Expr a, double b) { return a + scalar_like(a, b); }
Expr operator-(Expr a, double b) { return a - scalar_like(a, b); }
Expr operator*(Expr a, double b) { return a * scalar_like(a, b); }
Expr operator/(Expr a, double b) { return a / scalar_like(a, b); }
Expr operator+(double a, Expr b) { return scalar_like(b, a) + b; }
Expr operator-(double a, Expr b) { return scalar_like(b, a) - b; }
Expr operator*(double a, Expr b) { return scalar_like(b, a) * b; }
Expr operator/(double a, Expr b) { return scalar_like(b, a) / b; }
Expr operator-(Expr a) { return unary(Op::kNeg, a); }
Expr pow(Expr a, Expr b) { return binary(Op::kPow, a, b); }
Expr pow(Expr a, double b) { return pow(a, scalar_like(a, b)); }
Expr maximum(Expr a, Expr b) { return binary(Op::kMaximum, a, b); }
Expr minimum(Expr a, Expr b) { return binary(Op::kMinimum, a, b); }
Expr eq(Expr a, Expr b) { return binary(Op::kEq, a, b); }
Expr ne(Expr a, Expr b) { return binary(Op::kNe, a, b); }
Expr lt(Expr a, Expr b) { return binary(Op::kLt, a, b); }
Expr le(Expr a, Expr b) { return binary(Op::kLe, a, b); }
Expr gt(Expr a, Expr b) { return binary(Op::kGt, a, b); }
Expr ge(Expr a, Expr b) { return binary(Op::kGe, a, b); }
Expr where(Expr c, Expr a, Expr b) { return c.builder().apply1(Op::kWhere, {c, a, b}); }

Expr abs(Expr x) { return unary(Op::kAbs, x); }
Expr erf(Expr x) { return unary(Op::kErf, x); }
Expr sin(Expr x) { return unary(Op::kSin, x); }
Expr cos(Expr x) { return unary(Op::kCos, x); }
Expr exp(Expr x) { return unary(Op::kExp, x); }
Expr log(Expr x) { return unary(Op::kLog, x); }
Expr sqrt(Expr x) { return unary(Op::kSqrt, x); }
Expr rsqrt(Expr x) { return unary(Op::kRsqrt, x); }
Expr tanh(Expr x) { return unary(Op::kTanh, x); }
Expr sigmoid(Expr x) { return unary(Op::kSigmoid, x); }
Expr relu(Expr x) { return unary(Op::kRelu, x); }
Expr silu(Expr x) { return unary(Op::kSilu, x); }
Expr reciprocal(Expr x) { return unary(Op::kReciprocal, x); }
Expr square(Expr x) { return unary(Op::kSquare, x); }
Expr gelu(Expr x, const std::string& approximate) {
  return unary(Op::kGelu, x, {{"approximate", approximate}});
}
Expr cast(Expr x, DType dtype) { return unary(Op::kCast, x, {{"dtype", dtype}}); }
Expr dropout(Expr x, double p, int64_t seed, Expr offset) {
  std::vector<Expr> inputs{x};
  if (offset.id() >= 0) inputs.push_back(offset);
  return x.builder().apply1(Op::kDropout, inputs, {{"p", p}, {"seed", seed}});
}

Expr sum(Expr x, std::vector<int64_t> axes, bool keepdims) {
  return unary(Op::kSum, x, {{"axes", axes}, {"keepdims", keepdims}});
}
Expr mean(Expr x, std::vector<int64_t> axes, bool keepdims) {
  return unary(Op::kMean, x, {{"axes", axes}, {"keepdims", keepdims}});
}
Expr max(Expr x, std::vector<int64_t> axes, bool keepdims) {
  return unary(Op::kMax, x, {{"axes", axes}, {"keepdims", keepdims}});
}
Expr argmax(Expr x, int64_t axis, bool keepdims) {
  return unary(Op::kArgmax, x, {{"axis", axis}, {"keepdims", keepdims}});
}

Expr reshape(Expr x, Shape shape) { return unary(Op::kReshape, x, {{"shape", shape}}); }
Expr transpose(Expr x, std::vector<int64_t> perm) { return unary(Op::kTranspose, x, {{"perm", perm}}); }
Expr broadcast_to(Expr x, Shape shape) { return unary(Op::kBroadcastTo, x, {{"shape", shape}}); }
Expr slice(Expr x, std::vector<int64_t> starts, std::vector<int64_t> ends, std::vector<int64_t> steps) {
  return unary(Op::kSlice, x, {{"starts", starts}, {"ends", ends}, {"steps", steps}});
}
Expr slice_axis(Expr x, int64_t axis, int64_t start, int64_t end) {
  int a = normalize_axis(axis, x.rank());
  std::vector<int64_t> starts(x.rank(), 0);
  const Shape shape = x.shape();  // by value: begin() and end() of two temporaries would not pair
  std::vector<int64_t> ends(shape.begin(), shape.end());
  starts[a] = start;
  ends[a] = end;
  return slice(x, starts, ends);
}
Expr concat(const std::vector<Expr>& xs, int64_t axis) {
  KILN_CHECK(!xs.empty(), "concat: needs at least one input");
  return xs[0].builder().apply1(Op::kConcat, xs, {{"axis", axis}});
}
std::vector<Expr> split(Expr x, std::vector<int64_t> sizes, int64_t axis) {
  return x.builder().apply(Op::kSplit, {x}, {{"axis", axis}, {"sizes", sizes}});
}
Expr gather(Expr table, Expr indices, int64_t axis) {
  return table.builder().apply1(Op::kGather, {table, indices}, {{"axis", axis}});
}
Expr scatter_add(Expr base, Expr indices, Expr updates, int64_t axis) {
  return base.builder().apply1(Op::kScatterAdd, {base, indices, updates}, {{"axis", axis}});
}
Expr one_hot(Expr indices, int64_t depth, DType dtype) {
  return unary(Op::kOneHot, indices, {{"depth", depth}, {"dtype", dtype}});
}

Expr matmul(Expr a, Expr b, bool transpose_a, bool transpose_b) {
  return a.builder().apply1(Op::kMatmul, {a, b},
                            {{"transpose_a", transpose_a}, {"transpose_b", transpose_b}});
}
Expr softmax(Expr x, int64_t axis) { return unary(Op::kSoftmax, x, {{"axis", axis}}); }
Expr log_softmax(Expr x, int64_t axis) { return unary(Op::kLogSoftmax, x, {{"axis", axis}}); }
Expr layer_norm(Expr x, Expr gamma, Expr beta, double epsilon) {
  return x.builder().apply1(Op::kLayerNorm, {x, gamma, beta}, {{"epsilon", epsilon}});
}
Expr rms_norm(Expr x, Expr gamma, double epsilon) {
  return x.builder().apply1(Op::kRmsNorm, {x, gamma}, {{"epsilon", epsilon}});
}
Expr cross_entropy(Expr logits, Expr labels, int64_t ignore_index, const std::string& reduction) {
  return logits.builder().apply1(Op::kCrossEntropy, {logits, labels},
                                 {{"ignore_index", ignore_index}, {"reduction", reduction}});
}
std::vector<Expr> attention_with_lse(Expr q, Expr k, Expr v, bool causal, double scale,
                                     const std::string& layout) {
  Attributes attrs{{"causal", causal}, {"layout", layout}};
  if (scale > 0) attrs.set("scale", scale);
  return q.builder().apply(Op::kAttention, {q, k, v}, std::move(attrs));
}
Expr attention(Expr q, Expr k, Expr v, bool causal, double scale, const std::string& layout) {
  return attention_with_lse(q, k, v, causal, scale, layout)[0];
}
Expr rotary_embedding(Expr x, double base, const std::string& layout, bool inverse) {
  return unary(Op::kRotaryEmbedding, x,
               {{"base", base}, {"layout", layout}, {"inverse", inverse}});
}
std::vector<Expr> attention_qkv(Expr qkv, bool causal, double scale) {
  Attributes attrs{{"causal", causal}};
  if (scale > 0) attrs.set("scale", scale);
  return qkv.builder().apply(Op::kAttentionQkv, {qkv}, std::move(attrs));
}

// Backward ops
Expr softmax_grad(Expr y, Expr dy, int64_t axis) {
  return y.builder().apply1(Op::kSoftmaxGrad, {y, dy}, {{"axis", axis}});
}
Expr log_softmax_grad(Expr y, Expr dy, int64_t axis) {
  return y.builder().apply1(Op::kLogSoftmaxGrad, {y, dy}, {{"axis", axis}});
}
std::vector<Expr> layer_norm_grad(Expr x, Expr gamma, Expr dy, double epsilon) {
  return x.builder().apply(Op::kLayerNormGrad, {x, gamma, dy}, {{"epsilon", epsilon}});
}
std::vector<Expr> rms_norm_grad(Expr x, Expr gamma, Expr dy, double epsilon) {
  return x.builder().apply(Op::kRmsNormGrad, {x, gamma, dy}, {{"epsilon", epsilon}});
}
Expr cross_entropy_grad(Expr logits, Expr labels, Expr dloss, int64_t ignore_index,
                        const std::string& reduction) {
  return logits.builder().apply1(Op::kCrossEntropyGrad, {logits, labels, dloss},
                                 {{"ignore_index", ignore_index}, {"reduction", reduction}});
}
std::vector<Expr> attention_grad(Expr q, Expr k, Expr v, Expr out, Expr dout, Expr lse,
                                 bool causal, double scale) {
  Attributes attrs{{"causal", causal}};
  if (scale > 0) attrs.set("scale", scale);
  return q.builder().apply(Op::kAttentionGrad, {q, k, v, out, dout, lse}, std::move(attrs));
}
Expr attention_qkv_grad(Expr qkv, Expr out, Expr dout, Expr lse, bool causal, double scale) {
  Attributes attrs{{"causal", causal}};
  if (scale > 0) attrs.set("scale", scale);
  return qkv.builder().apply1(Op::kAttentionQkvGrad, {qkv, out, dout, lse}, std::move(attrs));
}
Expr gelu_grad(Expr x, Expr dy, const std::string& approximate) {
  return x.builder().apply1(Op::kGeluGrad, {x, dy}, {{"approximate", approximate}});
}

// Convolution and pooling
Expr conv2d(Expr x, Expr w, std::vector<int64_t> stride, std::vector<int64_t> padding) {
  return x.builder().apply1(Op::kConv2d, {x, w}, {{"stride", stride}, {"padding", padding}});
}
Expr max_pool2d(Expr x, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                std::vector<int64_t> padding) {
  return x.builder().apply1(Op::kMaxPool2d, {x},
                            {{"kernel", kernel}, {"stride", stride}, {"padding", padding}});
}
Expr avg_pool2d(Expr x, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                std::vector<int64_t> padding) {
  return x.builder().apply1(Op::kAvgPool2d, {x},
                            {{"kernel", kernel}, {"stride", stride}, {"padding", padding}});
}
Expr conv2d_grad_input(Expr dy, Expr w, Shape input_shape, std::vector<int64_t> stride,
                       std::vector<int64_t> padding) {
  return dy.builder().apply1(
      Op::kConv2dGradInput, {dy, w},
      {{"input_shape", input_shape}, {"stride", stride}, {"padding", padding}});
}
Expr conv2d_grad_weight(Expr x, Expr dy, Shape weight_shape, std::vector<int64_t> stride,
                        std::vector<int64_t> padding) {
  return x.builder().apply1(
      Op::kConv2dGradWeight, {x, dy},
      {{"weight_shape", weight_shape}, {"stride", stride}, {"padding", padding}});
}
Expr max_pool2d_grad(Expr x, Expr dy, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                     std::vector<int64_t> padding) {
  return x.builder().apply1(Op::kMaxPool2dGrad, {x, dy},
                            {{"kernel", kernel}, {"stride", stride}, {"padding", padding}});
}
Expr avg_pool2d_grad(Expr dy, Shape input_shape, std::vector<int64_t> kernel,
                     std::vector<int64_t> stride, std::vector<int64_t> padding) {
  return dy.builder().apply1(Op::kAvgPool2dGrad, {dy},
                             {{"input_shape", input_shape}, {"kernel", kernel}, {"stride", stride},
                              {"padding", padding}});
}

}  // namespace kiln
