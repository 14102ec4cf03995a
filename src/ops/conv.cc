// Convolution and pooling ops, NCHW, float dtypes (f32, f64, f16, bf16), inputs of one dtype.
// No dilation. Spatial attributes are pairs (height, width).
//   conv2d(x (N, C, H, W), w (O, C / groups, KH, KW)) {stride = [1, 1], padding = [0, 0],
//     groups = 1} -> y (N, O, OH, OW), OH = (H + 2 * pad_h - KH) / stride_h + 1 (and OW alike),
//     >= 1. A cross-correlation, as in every framework; zero padding. Bias is a separate
//     broadcast add. groups divides C and O: output channel o belongs to group
//     g = o / (O / groups) and sums over the input channels [g * C / groups, (g + 1) * C / groups)
//     only (groups = C: a depthwise convolution, O / C filters per input channel).
//   max_pool2d(x (N, C, H, W)) {kernel, stride = [] (= kernel), padding = [0, 0]}: padding counts
//     as -inf; padding <= kernel / 2 (PyTorch's rule), so every window holds a real element.
//   avg_pool2d(x) {kernel, stride = [] (= kernel), padding = [0, 0]}: the divisor is always
//     KH * KW (padding counts as zeros in it, PyTorch's count_include_pad).
// Backward ops, emitted by the gradient rules:
//   conv2d_grad_input(dy, w) {stride, padding, groups, input_shape (N, C, H, W)} -> dx.
//     input_shape is needed because with a stride > 1 several input sizes give the same output
//     size. It is also the transposed convolution (ONNX's ConvTranspose, PyTorch's
//     conv_transpose2d: dy is its input, w (O, C / groups, KH, KW) its weight), so it is
//     differentiable: linear in dy and in w, its gradients are conv2d and conv2d_grad_weight.
//   conv2d_grad_weight(x, dy) {stride, padding, groups, weight_shape (O, C / groups, KH, KW)}
//     -> dw. Not differentiable.
//   max_pool2d_grad(x, dy) {kernel, stride, padding} -> dx: each output's gradient goes to the
//     first position (row-major in its window) holding the window's max. Not differentiable.
//   avg_pool2d_grad(dy) {kernel, stride, padding, input_shape} -> dx. Not differentiable.
// Reference kernels are plain loops in double through Tensor::get/set: the test oracle.
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ir/builder.h"
#include "ops/common.h"
#include "ops/gradient.h"

namespace kiln::ops {
namespace {

using Ints = std::vector<int64_t>;

// ---- geometry ----

// A sliding window over the two spatial dims.
struct Window {
  int64_t kh, kw;  // kernel
  int64_t sh, sw;  // stride
  int64_t ph, pw;  // padding
};

// Spatial output size along one dim; throws when the padded input is smaller than the kernel.
int64_t output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad) {
  return (in + 2 * pad - kernel) / stride + 1;
}

// An ints attribute of exactly two values, each >= `least`.
std::pair<int64_t, int64_t> pair_attr(const Attributes& attrs, const std::string& name,
                                      int64_t least) {
  const Ints& v = attrs.ints(name);
  KILN_CHECK(v.size() == 2, "attribute '{}' is {}, expected two values (height, width)", name,
             to_string(AttrValue(v)));
  KILN_CHECK(v[0] >= least && v[1] >= least, "attribute '{}' is {}, expected values >= {}", name,
             to_string(AttrValue(v)), least);
  return {v[0], v[1]};
}

Window conv_window(const Attributes& attrs, int64_t kh, int64_t kw) {
  auto [sh, sw] = pair_attr(attrs, "stride", 1);
  auto [ph, pw] = pair_attr(attrs, "padding", 0);
  return {kh, kw, sh, sw, ph, pw};
}

// The pools' window: stride [] means stride = kernel.
Window pool_window(const Attributes& attrs) {
  auto [kh, kw] = pair_attr(attrs, "kernel", 1);
  int64_t sh = kh, sw = kw;
  if (!attrs.ints("stride").empty()) std::tie(sh, sw) = pair_attr(attrs, "stride", 1);
  auto [ph, pw] = pair_attr(attrs, "padding", 0);
  KILN_CHECK(2 * ph <= kh && 2 * pw <= kw,
             "padding is [{}, {}] for kernel [{}, {}], expected padding <= kernel / 2 (so that "
             "every window holds an input element)",
             ph, pw, kh, kw);
  return {kh, kw, sh, sw, ph, pw};
}

void check_float(const TensorType& t, const char* what) {
  KILN_CHECK(is_float(t.dtype), "{} is {}, expected a float dtype (f32, f64, f16, bf16)", what,
             dtype_name(t.dtype));
}

void check_same_dtype(const TensorType& t, const char* what, const TensorType& first,
                      const char* first_name) {
  KILN_CHECK(t.dtype == first.dtype, "{} is {}, expected {} like {}", what, dtype_name(t.dtype),
             dtype_name(first.dtype), first_name);
}

void check_nchw(const Shape& shape, const char* what, const char* layout) {
  KILN_CHECK(shape.size() == 4, "{} has shape {} (rank {}), expected rank 4 {}", what,
             to_string(shape), shape.size(), layout);
}

// The output shape of a window sliding over an (N, C, H, W) input producing `channels`
// channels; `what` names the input and the kernel for the error message.
Shape windowed_shape(const Shape& input, int64_t channels, const Window& win,
                     const std::string& what) {
  const int64_t h = input[2], w = input[3];
  KILN_CHECK(h + 2 * win.ph >= win.kh && w + 2 * win.pw >= win.kw,
             "{}: the padded input is {}x{} (padding [{}, {}]), smaller than the kernel {}x{}",
             what, h + 2 * win.ph, w + 2 * win.pw, win.ph, win.pw, win.kh, win.kw);
  return {input[0], channels, output_size(h, win.kh, win.sh, win.ph),
          output_size(w, win.kw, win.sw, win.pw)};
}

// The groups attribute, >= 1.
int64_t groups_attr(const Attributes& attrs) {
  const int64_t groups = attrs.i("groups");
  KILN_CHECK(groups >= 1, "attribute 'groups' is {}, expected at least 1", groups);
  return groups;
}

Shape conv_output_shape(const Shape& x, const Shape& w, const Window& win, int64_t groups) {
  KILN_CHECK(x[1] % groups == 0 && w[0] % groups == 0,
             "groups = {} does not divide the channels: x is {} (C = {}), w is {} (O = {}), "
             "expected both divisible by groups",
             groups, to_string(x), x[1], to_string(w), w[0]);
  KILN_CHECK(w[1] * groups == x[1],
             "channels differ: x is {} (C = {}), w is {} (C / groups = {}), expected w (O, "
             "C / groups, KH, KW) with x's C = {} and groups = {}",
             to_string(x), x[1], to_string(w), w[1], x[1], groups);
  return windowed_shape(x, w[0], win,
                        fmt::format("x is {}, w is {}", to_string(x), to_string(w)));
}

// A gradient input dy must have the forward output's shape and the given dtype.
void check_dy(const TensorType& dy, const Shape& expected, const TensorType& like,
              const char* like_name, const std::string& from) {
  check_same_dtype(dy, "dy", like, like_name);
  KILN_CHECK(dy.shape == expected, "dy has shape {}, expected {} (the forward output for {})",
             to_string(dy.shape), to_string(expected), from);
}

// A shape attribute of rank 4 (input_shape, weight_shape).
Shape nchw_attr(const Attributes& attrs, const char* name, const char* layout) {
  Shape shape = shape_attr(attrs, name);
  KILN_CHECK(shape.size() == 4, "attribute '{}' is {}, expected 4 dims {}", name,
             to_string(shape), layout);
  return shape;
}

// ---- inference ----

std::vector<TensorType> infer_conv2d(std::span<const TensorType> in, const Attributes& attrs) {
  const TensorType &x = in[0], &w = in[1];
  check_float(x, "x");
  check_same_dtype(w, "w", x, "x");
  check_nchw(x.shape, "x", "(N, C, H, W)");
  check_nchw(w.shape, "w", "(O, C / groups, KH, KW)");
  KILN_CHECK(w.shape[2] >= 1 && w.shape[3] >= 1,
             "w has shape {}, expected a kernel of at least 1x1", to_string(w.shape));
  const Window win = conv_window(attrs, w.shape[2], w.shape[3]);
  return {{x.dtype, conv_output_shape(x.shape, w.shape, win, groups_attr(attrs))}};
}

std::vector<TensorType> infer_conv2d_grad_input(std::span<const TensorType> in,
                                                const Attributes& attrs) {
  const TensorType &dy = in[0], &w = in[1];
  check_float(w, "w");
  check_nchw(w.shape, "w", "(O, C / groups, KH, KW)");
  const Shape x = nchw_attr(attrs, "input_shape", "(N, C, H, W)");
  const Window win = conv_window(attrs, w.shape[2], w.shape[3]);
  const Shape y = conv_output_shape(x, w.shape, win, groups_attr(attrs));
  check_dy(dy, y, w, "w", fmt::format("input_shape {} and w {}", to_string(x), to_string(w.shape)));
  return {{w.dtype, x}};
}

std::vector<TensorType> infer_conv2d_grad_weight(std::span<const TensorType> in,
                                                 const Attributes& attrs) {
  const TensorType &x = in[0], &dy = in[1];
  check_float(x, "x");
  check_nchw(x.shape, "x", "(N, C, H, W)");
  const Shape w = nchw_attr(attrs, "weight_shape", "(O, C / groups, KH, KW)");
  const Window win = conv_window(attrs, w[2], w[3]);
  const Shape y = conv_output_shape(x.shape, w, win, groups_attr(attrs));
  check_dy(dy, y, x, "x",
           fmt::format("x {} and weight_shape {}", to_string(x.shape), to_string(w)));
  return {{x.dtype, w}};
}

// Pools also need real rows and columns: a window of padding alone would have no max.
Shape pool_output_shape(const Shape& x, const Window& win) {
  KILN_CHECK(x[2] >= 1 && x[3] >= 1, "x is {}, expected H >= 1 and W >= 1", to_string(x));
  return windowed_shape(x, x[1], win, fmt::format("x is {}", to_string(x)));
}

std::vector<TensorType> infer_pool(std::span<const TensorType> in, const Attributes& attrs) {
  check_float(in[0], "x");
  check_nchw(in[0].shape, "x", "(N, C, H, W)");
  return {{in[0].dtype, pool_output_shape(in[0].shape, pool_window(attrs))}};
}

std::vector<TensorType> infer_max_pool2d_grad(std::span<const TensorType> in,
                                              const Attributes& attrs) {
  const TensorType &x = in[0], &dy = in[1];
  check_float(x, "x");
  check_nchw(x.shape, "x", "(N, C, H, W)");
  check_dy(dy, pool_output_shape(x.shape, pool_window(attrs)), x, "x",
           fmt::format("x {}", to_string(x.shape)));
  return {x};
}

std::vector<TensorType> infer_avg_pool2d_grad(std::span<const TensorType> in,
                                              const Attributes& attrs) {
  const TensorType& dy = in[0];
  check_float(dy, "dy");
  const Shape x = nchw_attr(attrs, "input_shape", "(N, C, H, W)");
  const Shape y = pool_output_shape(x, pool_window(attrs));
  KILN_CHECK(dy.shape == y, "dy has shape {}, expected {} (the forward output for input_shape {})",
             to_string(dy.shape), to_string(y), to_string(x));
  return {{dy.dtype, x}};
}

// ---- reference kernels ----

// Flat index of (n, c, h, w) in a row-major (N, C, H, W) tensor.
int64_t at4(const Shape& s, int64_t n, int64_t c, int64_t h, int64_t w) {
  return ((n * s[1] + c) * s[2] + h) * s[3] + w;
}

// An output position (n, c, i, j) of a window op, and the top-left input position (h0, w0) of
// its window (negative inside the padding).
struct At {
  int64_t n, c, i, j, h0, w0;
};

// Calls fn(At) for every output position of a window op with output shape `out`.
template <typename Fn>
void for_each_window(const Shape& out, const Window& win, Fn&& fn) {
  for (int64_t n = 0; n < out[0]; ++n)
    for (int64_t c = 0; c < out[1]; ++c)
      for (int64_t i = 0; i < out[2]; ++i)
        for (int64_t j = 0; j < out[3]; ++j)
          fn(At{n, c, i, j, i * win.sh - win.ph, j * win.sw - win.pw});
}

// Flat index of input element (n, c) at kernel tap (p, q) of window `a`, or -1 in the padding.
int64_t tap(const Shape& xs, int64_t n, int64_t c, const At& a, int64_t p, int64_t q) {
  const int64_t h = a.h0 + p, w = a.w0 + q;
  if (h < 0 || h >= xs[2] || w < 0 || w >= xs[3]) return -1;
  return at4(xs, n, c, h, w);
}

// Writes an accumulator of doubles into a tensor.
void store(Tensor& t, const std::vector<double>& values) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, values[i]);
}

// The input channels [first, first + count) that output channel o of a grouped convolution
// reads; w holds them at w[o, c - first].
struct GroupChannels {
  int64_t first, count;
};
GroupChannels group_channels(int64_t o, const Shape& w, int64_t groups) {
  return {o / (w[0] / groups) * w[1], w[1]};
}

// y[n, o, i, j] = sum over (c, p, q) of x[n, c, h0 + p, w0 + q] * w[o, c - first, p, q], c in
// o's group.
void conv2d_reference(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &w = args.inputs[1];
  Tensor& y = args.outputs[0];
  const Shape &xs = x.shape(), &ws = w.shape();
  const Window win = conv_window(args.attrs, ws[2], ws[3]);
  const int64_t groups = groups_attr(args.attrs);
  for_each_window(y.shape(), win, [&](const At& a) {  // a.c is the output channel o
    const GroupChannels g = group_channels(a.c, ws, groups);
    double sum = 0.0;
    for (int64_t k = 0; k < g.count; ++k)
      for (int64_t p = 0; p < ws[2]; ++p)
        for (int64_t q = 0; q < ws[3]; ++q) {
          const int64_t xi = tap(xs, a.n, g.first + k, a, p, q);
          if (xi >= 0) sum += x.get(xi) * w.get(at4(ws, a.c, k, p, q));
        }
    y.set(at4(y.shape(), a.n, a.c, a.i, a.j), sum);
  });
}

// dx[n, c, h0 + p, w0 + q] += dy[n, o, i, j] * w[o, c - first, p, q]: the forward's sum,
// scattered back.
void conv2d_grad_input_reference(const KernelArgs& args) {
  const Tensor &dy = args.inputs[0], &w = args.inputs[1];
  Tensor& dx = args.outputs[0];
  const Shape &xs = dx.shape(), &ws = w.shape();
  const Window win = conv_window(args.attrs, ws[2], ws[3]);
  const int64_t groups = groups_attr(args.attrs);
  std::vector<double> acc(static_cast<size_t>(dx.numel()), 0.0);
  for_each_window(dy.shape(), win, [&](const At& a) {
    const GroupChannels g = group_channels(a.c, ws, groups);
    const double grad = dy.get(at4(dy.shape(), a.n, a.c, a.i, a.j));
    for (int64_t k = 0; k < g.count; ++k)
      for (int64_t p = 0; p < ws[2]; ++p)
        for (int64_t q = 0; q < ws[3]; ++q) {
          const int64_t xi = tap(xs, a.n, g.first + k, a, p, q);
          if (xi >= 0) acc[xi] += grad * w.get(at4(ws, a.c, k, p, q));
        }
  });
  store(dx, acc);
}

// dw[o, c - first, p, q] += dy[n, o, i, j] * x[n, c, h0 + p, w0 + q].
void conv2d_grad_weight_reference(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &dy = args.inputs[1];
  Tensor& dw = args.outputs[0];
  const Shape &xs = x.shape(), &ws = dw.shape();
  const Window win = conv_window(args.attrs, ws[2], ws[3]);
  const int64_t groups = groups_attr(args.attrs);
  std::vector<double> acc(static_cast<size_t>(dw.numel()), 0.0);
  for_each_window(dy.shape(), win, [&](const At& a) {
    const GroupChannels g = group_channels(a.c, ws, groups);
    const double grad = dy.get(at4(dy.shape(), a.n, a.c, a.i, a.j));
    for (int64_t k = 0; k < g.count; ++k)
      for (int64_t p = 0; p < ws[2]; ++p)
        for (int64_t q = 0; q < ws[3]; ++q) {
          const int64_t xi = tap(xs, a.n, g.first + k, a, p, q);
          if (xi >= 0) acc[at4(ws, a.c, k, p, q)] += grad * x.get(xi);
        }
  });
  store(dw, acc);
}

// The flat index in x of the first (row-major) maximum of window `a` (same channel in x and y).
// Padding is -inf, so only real elements compete; a NaN wins (max propagates NaN).
int64_t window_argmax(const Tensor& x, const Window& win, const At& a) {
  int64_t best = -1;
  double best_value = 0.0;
  for (int64_t p = 0; p < win.kh; ++p)
    for (int64_t q = 0; q < win.kw; ++q) {
      const int64_t xi = tap(x.shape(), a.n, a.c, a, p, q);
      if (xi < 0) continue;
      const double v = x.get(xi);
      if (best < 0 || v > best_value || (std::isnan(v) && !std::isnan(best_value))) {
        best = xi;
        best_value = v;
      }
    }
  return best;  // >= 0: inference ensures every window holds a real element
}

void max_pool2d_reference(const KernelArgs& args) {
  const Tensor& x = args.inputs[0];
  Tensor& y = args.outputs[0];
  const Window win = pool_window(args.attrs);
  for_each_window(y.shape(), win, [&](const At& a) {
    y.set(at4(y.shape(), a.n, a.c, a.i, a.j), x.get(window_argmax(x, win, a)));
  });
}

void max_pool2d_grad_reference(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &dy = args.inputs[1];
  Tensor& dx = args.outputs[0];
  const Window win = pool_window(args.attrs);
  std::vector<double> acc(static_cast<size_t>(dx.numel()), 0.0);
  for_each_window(dy.shape(), win, [&](const At& a) {
    acc[window_argmax(x, win, a)] += dy.get(at4(dy.shape(), a.n, a.c, a.i, a.j));
  });
  store(dx, acc);
}

void avg_pool2d_reference(const KernelArgs& args) {
  const Tensor& x = args.inputs[0];
  Tensor& y = args.outputs[0];
  const Window win = pool_window(args.attrs);
  const double divisor = static_cast<double>(win.kh * win.kw);
  for_each_window(y.shape(), win, [&](const At& a) {
    double sum = 0.0;
    for (int64_t p = 0; p < win.kh; ++p)
      for (int64_t q = 0; q < win.kw; ++q) {
        const int64_t xi = tap(x.shape(), a.n, a.c, a, p, q);
        if (xi >= 0) sum += x.get(xi);
      }
    y.set(at4(y.shape(), a.n, a.c, a.i, a.j), sum / divisor);
  });
}

void avg_pool2d_grad_reference(const KernelArgs& args) {
  const Tensor& dy = args.inputs[0];
  Tensor& dx = args.outputs[0];
  const Window win = pool_window(args.attrs);
  const double divisor = static_cast<double>(win.kh * win.kw);
  std::vector<double> acc(static_cast<size_t>(dx.numel()), 0.0);
  for_each_window(dy.shape(), win, [&](const At& a) {
    const double g = dy.get(at4(dy.shape(), a.n, a.c, a.i, a.j)) / divisor;
    for (int64_t p = 0; p < win.kh; ++p)
      for (int64_t q = 0; q < win.kw; ++q) {
        const int64_t xi = tap(dx.shape(), a.n, a.c, a, p, q);
        if (xi >= 0) acc[xi] += g;
      }
  });
  store(dx, acc);
}

// ---- gradient rules ----

// The attributes every convolution op shares (stride, padding, groups), taken from a node's.
Attributes conv_attributes(const Attributes& attrs) {
  return {{"stride", attrs.ints("stride")},
          {"padding", attrs.ints("padding")},
          {"groups", attrs.i("groups")}};
}

Expr conv_node(Builder& b, Op op, std::vector<Expr> inputs, Attributes attrs, const char* shape_name,
               const Shape& shape) {
  attrs.set(shape_name, shape);
  return b.apply1(op, std::move(inputs), std::move(attrs));
}

std::vector<Expr> conv2d_gradient(const GradContext& c) {
  const Expr &x = c.x(0), &w = c.x(1);
  const Attributes attrs = conv_attributes(c.attrs());
  return {conv_node(c.builder, Op::kConv2dGradInput, {c.dy(), w}, attrs, "input_shape", x.shape()),
          conv_node(c.builder, Op::kConv2dGradWeight, {x, c.dy()}, attrs, "weight_shape",
                    w.shape())};
}

// dx = conv2d_grad_input(dy, w) is bilinear: <g, dx> sums dy[n, o, i, j] * w[o, k, p, q] *
// g[n, c, h0 + p, w0 + q], so d/d(dy) is conv2d(g, w) and d/dw is conv2d_grad_weight(g, dy).
std::vector<Expr> conv2d_grad_input_gradient(const GradContext& c) {
  const Expr &dy = c.x(0), &w = c.x(1);
  const Attributes attrs = conv_attributes(c.attrs());
  return {c.builder.apply1(Op::kConv2d, {c.dy(), w}, attrs),
          conv_node(c.builder, Op::kConv2dGradWeight, {c.dy(), dy}, attrs, "weight_shape",
                    w.shape())};
}

std::vector<Expr> max_pool2d_gradient(const GradContext& c) {
  return {c.builder.apply1(Op::kMaxPool2dGrad, {c.x(), c.dy()}, c.attrs())};
}

std::vector<Expr> avg_pool2d_gradient(const GradContext& c) {
  Attributes attrs = c.attrs();
  attrs.set("input_shape", c.x().shape());
  return {c.builder.apply1(Op::kAvgPool2dGrad, {c.dy()}, std::move(attrs))};
}

std::vector<AttrSpec> conv_attrs() {
  return {with_default("stride", Ints{1, 1}), with_default("padding", Ints{0, 0}),
          with_default("groups", int64_t{1})};
}

std::vector<AttrSpec> pool_attrs() {
  return {required("kernel", AttrKind::kInts), with_default("stride", Ints{}),
          with_default("padding", Ints{0, 0})};
}

// 2 * the larger of the image and the output (per channel pair) * C/groups*KH*KW.
double conv2d_flops(const Graph& g, const Node& node) {
  double out_numel = 0, in_numel = 0;
  for (ValueId o : node.outputs) out_numel += static_cast<double>(g.type(o).numel());
  for (ValueId i : node.inputs) in_numel += static_cast<double>(g.type(i).numel());
  // The 4-d weight: conv2d's and conv2d_grad_input's second input, grad_weight's output.
  const ValueId w = node.op == Op::kConv2dGradWeight ? node.outputs[0] : node.inputs[1];
  const Shape& ws = g.type(w).shape;
  const double per_output = static_cast<double>(g.type(w).numel()) / static_cast<double>(ws[0]);
  return 2.0 * std::max(out_numel, in_numel) * per_output;
}

}  // namespace

void define_conv_ops(OpRegistry& registry) {
  registry.define(Op::kConv2d,
                  OpDef{conv_attrs(), infer_conv2d, conv2d_reference, conv2d_gradient})
      .traits = {.precision = Precision::kLow, .recompute = Recompute::kHeavy,
                 .flops = conv2d_flops};

  std::vector<AttrSpec> grad_input_attrs = conv_attrs();
  grad_input_attrs.push_back(required("input_shape", AttrKind::kInts));
  registry.define(Op::kConv2dGradInput,
                  OpDef{grad_input_attrs, infer_conv2d_grad_input, conv2d_grad_input_reference,
                        conv2d_grad_input_gradient})
      .traits = {.recompute = Recompute::kHeavy, .flops = conv2d_flops};

  std::vector<AttrSpec> grad_weight_attrs = conv_attrs();
  grad_weight_attrs.push_back(required("weight_shape", AttrKind::kInts));
  registry.define(Op::kConv2dGradWeight, OpDef{grad_weight_attrs, infer_conv2d_grad_weight,
                                               conv2d_grad_weight_reference, nullptr, false})
      .traits = {.recompute = Recompute::kHeavy, .flops = conv2d_flops};

  registry.define(Op::kMaxPool2d,
                  OpDef{pool_attrs(), infer_pool, max_pool2d_reference, max_pool2d_gradient});
  registry.define(Op::kMaxPool2dGrad, OpDef{pool_attrs(), infer_max_pool2d_grad,
                                            max_pool2d_grad_reference, nullptr, false});

  registry.define(Op::kAvgPool2d,
                  OpDef{pool_attrs(), infer_pool, avg_pool2d_reference, avg_pool2d_gradient});
  std::vector<AttrSpec> avg_grad_attrs = pool_attrs();
  avg_grad_attrs.push_back(required("input_shape", AttrKind::kInts));
  registry.define(Op::kAvgPool2dGrad, OpDef{avg_grad_attrs, infer_avg_pool2d_grad,
                                            avg_pool2d_grad_reference, nullptr, false});
}

}  // namespace kiln::ops
