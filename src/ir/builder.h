// The C++ builder API for forward graphs: readable model code whose shapes are checked as the
// graph is built.
//
//   Builder b("mlp");
//   Expr x = b.data("x", {B, 784});
//   Expr w1 = b.param("w1", {784, 128}), b1 = b.param("b1", {128});
//   Expr h = gelu(matmul(x, w1) + b1, "tanh");
//   Graph g = b.finish({h});   // verified
//
// Every function appends a node through Graph::add_node, so a bad shape throws kiln::Error at
// the line that built it, naming the op and the shapes.
#pragma once

#include <string>
#include <vector>

#include "ir/graph.h"

namespace kiln {

class Builder;

// A handle to a value being built: the builder plus the value id. Cheap to copy.
class Expr {
 public:
  Expr() = default;
  Expr(Builder* builder, ValueId id) : builder_(builder), id_(id) {}

  Builder& builder() const;
  ValueId id() const { return id_; }
  // By value: a reference into the graph's values would dangle as soon as another node is
  // added (the values vector grows), a bug that is easy to write in gradient rules.
  TensorType type() const;
  Shape shape() const { return type().shape; }
  DType dtype() const { return type().dtype; }
  int rank() const { return type().rank(); }
  int64_t dim(int axis) const;  // negative axes count from the end
  // Gives the value a name in the text form (must be unique in the graph).
  Expr named(const std::string& name) const;

 private:
  Builder* builder_ = nullptr;
  ValueId id_ = -1;
};

class Builder {
 public:
  explicit Builder(std::string graph_name = "main");
  // Continues building on an existing graph (passes such as autodiff append to a graph).
  explicit Builder(Graph graph) : graph_(std::move(graph)) {}
  // A handle to an existing value of the graph.
  Expr wrap(ValueId id);
  // Hands the graph over without verifying or touching its outputs (the builder is left empty).
  Graph take();

  Expr param(const std::string& name, Shape shape, DType dtype = DType::kF32);
  Expr state(const std::string& name, Shape shape, DType dtype = DType::kF32);
  Expr data(const std::string& name, Shape shape, DType dtype = DType::kF32);

  // Appends `op` on `inputs`; throws kiln::Error (the graph is left unchanged) on bad input.
  std::vector<Expr> apply(Op op, const std::vector<Expr>& inputs, Attributes attrs = {});
  Expr apply1(Op op, const std::vector<Expr>& inputs, Attributes attrs = {});

  // Sources.
  Expr full(Shape shape, double value, DType dtype = DType::kF32);
  Expr scalar(double value, DType dtype = DType::kF32) { return full({}, value, dtype); }
  Expr constant(Shape shape, std::vector<double> values, DType dtype = DType::kF32);
  // Integer (or bool) constant, exact for every int64 (a double list is not above 2^53).
  Expr constant_ints(Shape shape, std::vector<int64_t> values, DType dtype = DType::kI64);
  Expr iota(Shape shape, int64_t axis = 0, DType dtype = DType::kI64);

  // Sets the outputs, verifies and returns the graph (the builder is left empty).
  Graph finish(const std::vector<Expr>& outputs);
  const Graph& graph() const { return graph_; }
  Graph& graph() { return graph_; }

 private:
  Expr input(const std::string& name, Shape shape, DType dtype, Role role);
  Graph graph_;
};

// Elementwise arithmetic with numpy broadcasting; a double operand becomes a scalar of the other
// operand's dtype.
Expr operator+(Expr a, Expr b);
Expr operator-(Expr a, Expr b);
Expr operator*(Expr a, Expr b);
Expr operator/(Expr a, Expr b);
Expr operator+(Expr a, double b);
Expr operator-(Expr a, double b);
Expr operator*(Expr a, double b);
Expr operator/(Expr a, double b);
Expr operator+(double a, Expr b);
Expr operator-(double a, Expr b);
Expr operator*(double a, Expr b);
Expr operator/(double a, Expr b);
Expr operator-(Expr a);
Expr pow(Expr a, Expr b);
Expr pow(Expr a, double b);
Expr maximum(Expr a, Expr b);
Expr minimum(Expr a, Expr b);
Expr eq(Expr a, Expr b);
Expr ne(Expr a, Expr b);
Expr lt(Expr a, Expr b);
Expr le(Expr a, Expr b);
Expr gt(Expr a, Expr b);
Expr ge(Expr a, Expr b);
Expr where(Expr condition, Expr a, Expr b);

Expr abs(Expr x);
Expr erf(Expr x);
Expr sin(Expr x);
Expr cos(Expr x);
Expr exp(Expr x);
Expr log(Expr x);
Expr sqrt(Expr x);
Expr rsqrt(Expr x);
Expr tanh(Expr x);
Expr sigmoid(Expr x);
Expr relu(Expr x);
Expr silu(Expr x);
Expr reciprocal(Expr x);
Expr square(Expr x);
// approximate: "none" (exact, erf) or "tanh" (GPT-2's).
Expr gelu(Expr x, const std::string& approximate = "none");
Expr cast(Expr x, DType dtype);
// Drops elements with probability p (counter-based RNG: same seed and offset, same mask on
// every backend). `offset` (optional, i64 scalar) is usually the step counter.
Expr dropout(Expr x, double p, int64_t seed = 0, Expr offset = {});

// Reductions; empty axes means all axes.
Expr sum(Expr x, std::vector<int64_t> axes = {}, bool keepdims = false);
Expr mean(Expr x, std::vector<int64_t> axes = {}, bool keepdims = false);
Expr max(Expr x, std::vector<int64_t> axes = {}, bool keepdims = false);
Expr argmax(Expr x, int64_t axis = -1, bool keepdims = false);

// Data movement.
Expr reshape(Expr x, Shape shape);  // one dimension may be -1
Expr transpose(Expr x, std::vector<int64_t> perm = {});  // empty: reverse the axes
Expr broadcast_to(Expr x, Shape shape);
Expr slice(Expr x, std::vector<int64_t> starts, std::vector<int64_t> ends,
           std::vector<int64_t> steps = {});
// Slice along one axis only: x[..., start:end, ...].
Expr slice_axis(Expr x, int64_t axis, int64_t start, int64_t end);
Expr concat(const std::vector<Expr>& xs, int64_t axis = 0);
std::vector<Expr> split(Expr x, std::vector<int64_t> sizes, int64_t axis = 0);
Expr gather(Expr table, Expr indices, int64_t axis = 0);
Expr scatter_add(Expr base, Expr indices, Expr updates, int64_t axis = 0);
Expr one_hot(Expr indices, int64_t depth, DType dtype = DType::kF32);

// Neural-network ops.
Expr matmul(Expr a, Expr b, bool transpose_a = false, bool transpose_b = false);
Expr softmax(Expr x, int64_t axis = -1);
Expr log_softmax(Expr x, int64_t axis = -1);
Expr layer_norm(Expr x, Expr gamma, Expr beta, double epsilon = 1e-5);
Expr rms_norm(Expr x, Expr gamma, double epsilon = 1e-6);
// reduction: "mean" (over non-ignored rows), "sum" or "none".
Expr cross_entropy(Expr logits, Expr labels, int64_t ignore_index = -100,
                   const std::string& reduction = "mean");
// q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv). scale <= 0 means 1/sqrt(D). Returns out
// (..., Tq, Dv); the node's second output, the log-sum-exp (..., Tq), is there for the backward
// (attention_with_lse returns both). layout "bthd": q (..., Tq, H, D), k and v (..., Tk, Hkv,
// D) with Hkv dividing H (grouped-query attention; also "bhtd"'s heads, the dim before T).
Expr attention(Expr q, Expr k, Expr v, bool causal = false, double scale = 0.0,
               const std::string& layout = "bhtd");
// {out, lse}: lse = log(sum_j exp(scale * q_i . k_j)) over the unmasked keys (ops/nn.cc).
std::vector<Expr> attention_with_lse(Expr q, Expr k, Expr v, bool causal = false,
                                     double scale = 0.0, const std::string& layout = "bhtd");
// Rotary position embeddings ("rotate half") of x (..., T, D) ("bhtd") or (..., T, H, D)
// ("bthd") at positions 0 .. T-1 (ops/nn.cc).
Expr rotary_embedding(Expr x, double base = 10000.0, const std::string& layout = "bhtd",
                      bool inverse = false);
// Self-attention over a packed projection qkv (..., T, 3, H, D): {out (..., T, H, D), lse
// (..., T, H)}, the "bthd" attention of qkv's three parts read in place.
std::vector<Expr> attention_qkv(Expr qkv, bool causal = false, double scale = 0.0);

// Backward ops: what the gradient rules of softmax, the norms, cross_entropy and attention emit
// (kernel libraries serve them whole). Each takes the forward op's attributes.
// y = softmax(x) or log_softmax(x); returns dx.
Expr softmax_grad(Expr y, Expr dy, int64_t axis = -1);
Expr log_softmax_grad(Expr y, Expr dy, int64_t axis = -1);
// Returns {dx, dgamma, dbeta}; dgamma and dbeta are (C,), summed over the leading dims.
std::vector<Expr> layer_norm_grad(Expr x, Expr gamma, Expr dy, double epsilon = 1e-5);
// Returns {dx, dgamma}.
std::vector<Expr> rms_norm_grad(Expr x, Expr gamma, Expr dy, double epsilon = 1e-6);
// dloss: a scalar for "mean" and "sum", labels' shape for "none". Returns dlogits.
Expr cross_entropy_grad(Expr logits, Expr labels, Expr dloss, int64_t ignore_index = -100,
                        const std::string& reduction = "mean");
// out and lse: attention's outputs for q, k, v. Returns {dq, dk, dv}. scale <= 0 means
// 1/sqrt(D), as for attention.
std::vector<Expr> attention_grad(Expr q, Expr k, Expr v, Expr out, Expr dout, Expr lse,
                                 bool causal = false, double scale = 0.0);
// out and lse: attention_qkv's outputs for qkv. Returns dqkv, packed like qkv.
Expr attention_qkv_grad(Expr qkv, Expr out, Expr dout, Expr lse, bool causal = false,
                        double scale = 0.0);
// dy * d gelu(x) / dx; dy has x's type. approximate as for gelu.
Expr gelu_grad(Expr x, Expr dy, const std::string& approximate = "none");

// Convolution and pooling (NCHW; spatial pairs are (height, width)). x (N, C, H, W), w (O, C,
// KH, KW). Pools: an empty stride means stride = kernel. See src/ops/conv.cc.
Expr conv2d(Expr x, Expr w, std::vector<int64_t> stride = {1, 1},
            std::vector<int64_t> padding = {0, 0});
Expr max_pool2d(Expr x, std::vector<int64_t> kernel, std::vector<int64_t> stride = {},
                std::vector<int64_t> padding = {0, 0});
Expr avg_pool2d(Expr x, std::vector<int64_t> kernel, std::vector<int64_t> stride = {},
                std::vector<int64_t> padding = {0, 0});
// Their backward ops; each takes the forward op's attributes (and the shape it cannot infer).
Expr conv2d_grad_input(Expr dy, Expr w, Shape input_shape, std::vector<int64_t> stride = {1, 1},
                       std::vector<int64_t> padding = {0, 0});
Expr conv2d_grad_weight(Expr x, Expr dy, Shape weight_shape, std::vector<int64_t> stride = {1, 1},
                        std::vector<int64_t> padding = {0, 0});
Expr max_pool2d_grad(Expr x, Expr dy, std::vector<int64_t> kernel, std::vector<int64_t> stride = {},
                     std::vector<int64_t> padding = {0, 0});
Expr avg_pool2d_grad(Expr dy, Shape input_shape, std::vector<int64_t> kernel,
                     std::vector<int64_t> stride = {}, std::vector<int64_t> padding = {0, 0});

}  // namespace kiln
