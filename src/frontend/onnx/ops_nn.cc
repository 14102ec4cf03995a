// ONNX rules for the neural-network ops: MatMul and Gemm, softmax and friends, the norms
// (LayerNormalization, BatchNormalization with its running statistics, InstanceNormalization),
// convolution (groups in conv2d itself; dilation and asymmetric pads as compositions around it),
// ConvTranspose (conv2d_grad_input, the transposed convolution),
// pooling (explicit pads and ceil mode as padding), and the losses.
#include <cmath>
#include <limits>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

using Ints = std::vector<int64_t>;

void require_float(NodeContext& c, const Expr& x) {
  if (!is_float(x.dtype())) c.unsupported("needs float inputs, got {}", dtype_name(x.dtype()));
}

int64_t axis_in(NodeContext& c, int64_t axis, int rank) {
  if (axis < -rank || axis >= rank) c.fail("axis {} is out of range for rank {}", axis, rank);
  return axis < 0 ? axis + rank : axis;
}

// (C,) -> (1, C, 1, ...) to broadcast over (N, C, spatial...).
Expr per_channel(const Expr& v, int rank) {
  Shape s(rank, 1);
  s[1] = v.type().numel();
  return reshape(v, s);
}

Ints all_but(int rank, int keep) {
  Ints axes;
  for (int d = 0; d < rank; ++d)
    if (d != keep) axes.push_back(d);
  return axes;
}

// Softmax-like ops: before opset 13 they work on x flattened to 2-D at `axis` (default 1).
Rule softmax_like(std::string kind) {
  return [kind](NodeContext& c) {
    Expr x = c.in(0);
    require_float(c, x);
    const bool legacy = c.opset() < 13;
    const int64_t axis = axis_in(c, c.attr_int("axis", legacy ? 1 : -1), std::max(x.rank(), 1));
    const Shape shape = x.shape();
    Expr v = x;
    int64_t a = axis;
    if (legacy) {
      int64_t outer = 1, inner = 1;
      for (int d = 0; d < x.rank(); ++d) (d < axis ? outer : inner) *= x.dim(d);
      v = reshape(x, {outer, inner});
      a = 1;
    }
    Expr y;
    if (kind == "softmax") y = softmax(v, a);
    else if (kind == "log_softmax") y = log_softmax(v, a);
    else {  // hardmax: one-hot of the first maximum
      Expr i = argmax(v, a, false);
      y = one_hot(i, v.dim(int(a)), v.dtype());
      if (a != v.rank() - 1) {
        Ints perm;
        for (int d = 0; d < v.rank() - 1; ++d) {
          if (d == a) perm.push_back(v.rank() - 1);
          perm.push_back(d);
        }
        y = transpose(y, perm);
      }
    }
    return std::vector<Expr>{legacy ? reshape(y, shape) : y};
  };
}

// The negative log-likelihood of log-probabilities lp (N, C, d...) at labels (N, d...), as
// SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss define it.
Expr nll(NodeContext& c, const Expr& lp, const Expr& labels, const Expr* weights, std::optional<int64_t> ignore,
         const std::string& reduction) {
  Builder& b = c.b();
  const int rank = lp.rank();
  const int64_t classes = lp.dim(1);
  Ints perm = all_but(rank, 1);
  perm.push_back(1);
  Expr last = rank == 2 ? lp : transpose(lp, perm);  // (N, d..., C)
  Expr index = cast_to(labels, DType::kI64);
  Expr valid = ignore ? ne(index, b.scalar(double(*ignore), DType::kI64)) : b.full(index.shape(), 1, DType::kBool);
  Expr safe = where(valid, index, b.scalar(0, DType::kI64));
  Expr picked = sum(last * one_hot(safe, classes, lp.dtype()), {-1});
  Expr w = cast(valid, lp.dtype());
  // A label outside [0, C) that is not ignore_index is an error, as in cross_entropy (and torch),
  // where one_hot alone would give its row no loss: a gather at the labels (of the weights, or
  // of ones) carries the gather's range check.
  w = w * gather(weights ? *weights : b.full({classes}, 1, lp.dtype()), safe, 0);
  Expr loss = -(picked * w);
  if (reduction == "none") return loss;
  if (reduction == "sum") return sum(loss);
  if (reduction == "mean") return sum(loss) / sum(w);
  c.unsupported("reduction '{}'", reduction);
}

Rule loss_rule(bool from_scores) {
  return [from_scores](NodeContext& c) {
    Expr scores = c.in(0), labels = c.in(1);
    require_float(c, scores);
    const std::string reduction = c.attr_string("reduction", "mean");
    std::optional<int64_t> ignore;
    if (c.has_attr("ignore_index")) ignore = c.attr_int("ignore_index", 0);
    Expr weights;
    const bool weighted = c.has_input(2);
    if (weighted) weights = c.in(2);
    if (scores.rank() < 2) c.fail("needs scores of rank >= 2 (N, C, ...), got {}", to_string(scores.type()));
    if (!from_scores) return std::vector<Expr>{nll(c, scores, labels, weighted ? &weights : nullptr, ignore, reduction)};
    // Unweighted, no log_prob output: kiln's cross_entropy over the class axis moved last.
    if (!weighted && !c.wants_output(1) && (reduction == "mean" || reduction == "sum" || reduction == "none")) {
      Ints perm = all_but(scores.rank(), 1);
      perm.push_back(1);
      Expr logits = scores.rank() == 2 ? scores : transpose(scores, perm);
      // ONNX has no ignored label without ignore_index: one no label can equal.
      const int64_t ignore_index = ignore.value_or(std::numeric_limits<int64_t>::min());
      return std::vector<Expr>{cross_entropy(logits, cast_to(labels, DType::kI64), ignore_index, reduction)};
    }
    Expr lp = log_softmax(scores, 1);
    return std::vector<Expr>{nll(c, lp, labels, weighted ? &weights : nullptr, ignore, reduction), lp};
  };
}

// Spatial geometry of a conv or pool node, 2-D (1-D inputs are seen as height 1).
struct Window {
  Ints kernel, strides, dilations, pads_begin, pads_end;
};

Window window_of(NodeContext& c, const Shape& spatial, const Ints& kernel, bool ceil_mode = false) {
  const size_t n = spatial.size();
  Window w;
  w.kernel = kernel;
  w.strides = c.attr_ints("strides", Ints(n, 1));
  w.dilations = c.attr_ints("dilations", Ints(n, 1));
  Ints pads = c.attr_ints("pads", Ints(2 * n, 0));
  const std::string auto_pad = c.attr_string("auto_pad", "NOTSET");
  if (w.strides.size() != n || w.dilations.size() != n || pads.size() != 2 * n)
    c.fail("strides, dilations or pads do not match {} spatial dims", n);
  w.pads_begin.assign(pads.begin(), pads.begin() + n);
  w.pads_end.assign(pads.begin() + n, pads.end());
  if (auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER") {
    for (size_t d = 0; d < n; ++d) {
      const int64_t out = (spatial[d] + w.strides[d] - 1) / w.strides[d];
      const int64_t extent = (kernel[d] - 1) * w.dilations[d] + 1;
      const int64_t total = std::max<int64_t>(0, (out - 1) * w.strides[d] + extent - spatial[d]);
      const int64_t small = total / 2;
      w.pads_begin[d] = auto_pad == "SAME_UPPER" ? small : total - small;
      w.pads_end[d] = total - w.pads_begin[d];
    }
  } else if (auto_pad == "VALID") {
    w.pads_begin.assign(n, 0);
    w.pads_end.assign(n, 0);
  } else if (auto_pad != "NOTSET") {
    c.unsupported("auto_pad '{}'", auto_pad);
  }
  if (ceil_mode) {  // pad the end so that the floor formula gives the ceil one's size
    for (size_t d = 0; d < n; ++d) {
      const int64_t extent = (kernel[d] - 1) * w.dilations[d] + 1;
      const int64_t span = spatial[d] + w.pads_begin[d] + w.pads_end[d] - extent;
      const int64_t out = (span + w.strides[d] - 1) / w.strides[d] + 1;
      w.pads_end[d] += std::max<int64_t>(0, (out - 1) * w.strides[d] + extent - (span + extent));
    }
  }
  return w;
}

// Pads the spatial dims (from axis 2) of x by the window's pads.
Expr pad_spatial(Builder& b, Expr x, const Window& w, const Expr& value) {
  for (size_t d = 0; d < w.kernel.size(); ++d) x = pad_axis(b, x, 2 + d, w.pads_begin[d], w.pads_end[d], "constant", value);
  return x;
}

// (N, C, L) -> (N, C, 1, L): 1-D convs and pools run as 2-D ones.
Expr as_2d(NodeContext& c, const Expr& x, int spatial_rank) {
  if (spatial_rank == 2) return x;
  if (spatial_rank == 1) return reshape(x, {x.dim(0), x.dim(1), 1, x.dim(2)});
  c.unsupported("{}-D inputs (kiln has 1-D and 2-D convolution and pooling)", spatial_rank);
}

// The weight (O, C, KH, KW) with dilation d: zeros between the taps, (K - 1) d + 1 wide.
Expr dilate(Builder& b, Expr w, int axis, int64_t d) {
  if (d == 1) return w;
  Shape s = w.shape();
  const int64_t k = s[axis];
  Shape spread = s;
  spread.insert(spread.begin() + axis + 1, 1);
  Shape zeros = spread;
  zeros[axis + 1] = d - 1;
  Expr x = concat({reshape(w, spread), b.full(zeros, 0.0, w.dtype())}, axis + 1);
  Shape merged = s;
  merged[axis] = k * d;
  return slice_axis(reshape(x, merged), axis, 0, (k - 1) * d + 1);
}

}  // namespace

void add_nn_rules(RuleTable& r) {
  r["MatMul"] = [](NodeContext& c) {
    Expr a = c.in(0), b = c.in(1);
    require_float(c, a);
    const bool vector_a = a.rank() == 1, vector_b = b.rank() == 1;
    if (vector_a) a = reshape(a, {1, a.dim(0)});
    if (vector_b) b = reshape(b, {b.dim(0), 1});
    Expr y = matmul(a, b);
    if (vector_a || vector_b) {
      Shape s = y.shape();
      if (vector_b) s.pop_back();
      if (vector_a) s.erase(s.end() - (vector_b ? 1 : 2));
      y = reshape(y, s);
    }
    return std::vector<Expr>{y};
  };
  r["Gemm"] = [](NodeContext& c) {
    Expr a = c.in(0), b = c.in(1);
    require_float(c, a);
    const double alpha = c.attr_float("alpha", 1.0), beta = c.attr_float("beta", 1.0);
    c.ignore_attr("broadcast");  // opset < 7: C broadcasts, as it always does since
    Expr y = matmul(a, b, c.attr_int("transA", 0) != 0, c.attr_int("transB", 0) != 0);
    if (alpha != 1.0) y = y * alpha;
    if (c.has_input(2) && beta != 0.0) y = y + (beta == 1.0 ? c.in(2) : c.in(2) * beta);
    return std::vector<Expr>{y};
  };
  r["Softmax"] = softmax_like("softmax");
  r["LogSoftmax"] = softmax_like("log_softmax");
  r["Hardmax"] = softmax_like("hardmax");

  // Local response normalization over channels: x / (bias + alpha / size * sum of x^2 over the
  // size channels around c)^beta, the sum as shifted slices of the squares padded with zeros.
  r["LRN"] = [](NodeContext& c) {
    Expr x = c.in(0);
    require_float(c, x);
    const double alpha = c.attr_float("alpha", 1e-4), beta = c.attr_float("beta", 0.75), bias = c.attr_float("bias", 1.0);
    const int64_t size = c.attr_int("size", 0);
    if (size < 1) c.fail("size {} (expected >= 1)", size);
    if (x.rank() < 3) c.fail("needs (N, C, D1, ...), got {}", to_string(x.type()));
    const int64_t channels = x.dim(1), before = (size - 1) / 2, after = size - 1 - before;
    Expr padded = pad_axis(c.b(), square(x), 1, before, after, "constant", scalar_like(x, 0.0));
    Expr sums = slice_axis(padded, 1, 0, channels);
    for (int64_t k = 1; k < size; ++k) sums = sums + slice_axis(padded, 1, k, k + channels);
    return std::vector<Expr>{x * pow(sums * (alpha / static_cast<double>(size)) + bias, -beta)};
  };

  r["LayerNormalization"] = [](NodeContext& c) {
    Expr x = c.in(0), scale = c.in(1);
    require_float(c, x);
    const int64_t axis = axis_in(c, c.attr_int("axis", -1), x.rank());
    const double epsilon = c.attr_float("epsilon", 1e-5);
    c.ignore_attr("stash_type");  // kiln computes the statistics in f32 or wider anyway
    const bool last_only = axis == x.rank() - 1;
    if (last_only && scale.rank() == 1 && (!c.has_input(2) || c.in(2).rank() == 1) && !c.wants_output(1) &&
        !c.wants_output(2)) {
      Expr bias = c.has_input(2) ? c.in(2) : c.b().full(scale.shape(), 0.0, scale.dtype());
      return std::vector<Expr>{layer_norm(x, scale, bias, epsilon)};
    }
    Ints axes;
    for (int d = int(axis); d < x.rank(); ++d) axes.push_back(d);
    Expr m = mean(x, axes, true);
    Expr centered = x - m;
    Expr inv = rsqrt(mean(square(centered), axes, true) + epsilon);
    Expr y = centered * inv * scale;
    if (c.has_input(2)) y = y + c.in(2);
    return std::vector<Expr>{y, m, inv};
  };
  r["BatchNormalization"] = [](NodeContext& c) {
    Expr x = c.in(0), scale = c.in(1), bias = c.in(2), mean_in = c.in(3), var_in = c.in(4);
    require_float(c, x);
    const double epsilon = c.attr_float("epsilon", 1e-5), momentum = c.attr_float("momentum", 0.9);
    if (c.opset() < 9 && c.attr_int("spatial", 1) == 0) c.unsupported("spatial = 0");
    if (c.opset() < 7) c.ignore_attr("is_test");
    c.ignore_attr("consumed_inputs");  // opset 1
    const bool training = c.attr_int("training_mode", 0) != 0;
    const int rank = x.rank();
    if (rank < 2) c.fail("needs (N, C, ...), got {}", to_string(x.type()));
    auto normalize = [&](const Expr& m, const Expr& v) {
      return (x - per_channel(m, rank)) * per_channel(rsqrt(v + epsilon) * scale, rank) + per_channel(bias, rank);
    };
    if (!training) {
      if (c.num_outputs() > 1 && c.opset() < 14) c.unsupported("the running statistics outputs of opset {}", c.opset());
      return std::vector<Expr>{normalize(mean_in, var_in)};
    }
    // Training: the batch's statistics normalize; the running ones move toward them, with the
    // biased variance as the ONNX reference computes it, or the unbiased one as torch does for
    // a model PyTorch exported.
    const Ints axes = all_but(rank, 1);
    Expr batch_mean = mean(x, axes);
    Expr batch_var = mean(square(x - per_channel(batch_mean, rank)), axes);
    Expr y = normalize(batch_mean, batch_var);
    const double count = static_cast<double>(x.type().numel() / x.dim(1));
    Expr update_var = c.from_pytorch() && count > 1 ? batch_var * (count / (count - 1)) : batch_var;
    Expr running_mean = mean_in * momentum + batch_mean * (1.0 - momentum);
    Expr running_var = var_in * momentum + update_var * (1.0 - momentum);
    c.add_update(mean_in, running_mean);
    c.add_update(var_in, running_var);
    return std::vector<Expr>{y, running_mean, running_var};
  };
  r["InstanceNormalization"] = [](NodeContext& c) {
    Expr x = c.in(0), scale = c.in(1), bias = c.in(2);
    require_float(c, x);
    const double epsilon = c.attr_float("epsilon", 1e-5);
    Ints axes;
    for (int d = 2; d < x.rank(); ++d) axes.push_back(d);
    Expr centered = x - mean(x, axes, true);
    Expr y = centered * rsqrt(mean(square(centered), axes, true) + epsilon);
    return std::vector<Expr>{y * per_channel(scale, x.rank()) + per_channel(bias, x.rank())};
  };
  r["MeanVarianceNormalization"] = [](NodeContext& c) {
    Expr x = c.in(0);
    require_float(c, x);
    Ints axes = c.attr_ints("axes", {0, 2, 3});
    Expr centered = x - mean(x, axes, true);
    return std::vector<Expr>{centered / sqrt(mean(square(centered), axes, true) + 1e-9)};
  };

  r["Conv"] = [](NodeContext& c) {
    Expr x = c.in(0), w = c.in(1);
    require_float(c, x);
    const int spatial_rank = x.rank() - 2;
    const Shape w_shape = w.shape(), x_shape = x.shape();
    const Ints kernel(w_shape.begin() + 2, w_shape.end());
    if (c.has_attr("kernel_shape") && c.attr_ints("kernel_shape") != kernel)
      c.fail("kernel_shape {} differs from the weight's {}", to_string(c.attr_ints("kernel_shape")), to_string(kernel));
    Window win = window_of(c, Shape(x_shape.begin() + 2, x_shape.end()), kernel);
    const int64_t groups = c.attr_int("group", 1);
    if (groups < 1 || x.dim(1) % groups != 0 || w.dim(0) % groups != 0 || w.dim(1) * groups != x.dim(1))
      c.fail("group {} for {} input channels and a weight {}, expected a group dividing both channel "
             "counts and a weight (M, C / group, ...)", groups, x.dim(1), to_string(w_shape));
    x = as_2d(c, x, spatial_rank);
    w = as_2d(c, w, spatial_rank);
    if (spatial_rank == 1)
      for (Ints* v : {&win.kernel, &win.strides, &win.dilations, &win.pads_begin, &win.pads_end}) v->insert(v->begin(), v == &win.kernel || v == &win.strides || v == &win.dilations ? 1 : 0);
    for (int d = 0; d < 2; ++d) w = dilate(c.b(), w, 2 + d, win.dilations[d]);
    Ints padding{0, 0};
    if (win.pads_begin == win.pads_end) {
      padding = win.pads_begin;
    } else {
      win.kernel = {w.dim(2), w.dim(3)};
      x = pad_spatial(c.b(), x, win, scalar_like(x, 0.0));
    }
    // Groups stay one node: conv2d has them (a split and a conv per group made a depthwise
    // network thousands of nodes).
    Expr y = c.b().apply1(Op::kConv2d, {x, w}, {{"stride", win.strides}, {"padding", padding}, {"groups", groups}});
    if (c.has_input(2)) y = y + per_channel(c.in(2), 4);
    if (spatial_rank == 1) y = reshape(y, {y.dim(0), y.dim(1), y.dim(3)});
    return std::vector<Expr>{y};
  };

  // ConvTranspose is the transpose of a convolution: kiln's conv2d_grad_input, x in the place
  // of dy and ONNX's weight (C, M / group, KH, KW) as the convolution's (O, C / groups, KH, KW).
  // Along one spatial dim, with the taps as placed unpadded (input i, tap k at i * s + k * d),
  // data lies at [0, full), full = s * (in - 1) + (K - 1) * d + 1; the output is [b, b + out) of
  // that line, zero past it, with b and out from pads, output_padding, output_shape and auto_pad
  // as ONNX defines them. conv2d_grad_input with symmetric padding q and input size H gives
  // [q, q + H), where H must lie in [full - 2q, full - 2q + s - 1] (the sizes whose convolution
  // has `in` outputs); what that misses is a slice (and zeros padded past the data).
  r["ConvTranspose"] = [](NodeContext& c) {
    Expr x = c.in(0), w = c.in(1);
    require_float(c, x);
    const int spatial_rank = x.rank() - 2;
    const size_t n = static_cast<size_t>(std::max(spatial_rank, 0));
    x = as_2d(c, x, spatial_rank);
    const Shape w_shape = w.shape(), x_shape = c.in(0).shape();
    const Ints kernel(w_shape.begin() + 2, w_shape.end());
    if (c.has_attr("kernel_shape") && c.attr_ints("kernel_shape") != kernel)
      c.fail("kernel_shape {} differs from the weight's {}", to_string(c.attr_ints("kernel_shape")), to_string(kernel));
    const int64_t groups = c.attr_int("group", 1);
    if (groups < 1 || w.dim(0) != x.dim(1) || x.dim(1) % groups != 0)
      c.fail("group {} for {} input channels and a weight {}, expected a weight (C, M / group, ...) with "
             "C the input's channels and a group dividing it", groups, x.dim(1), to_string(w_shape));
    const Ints strides = c.attr_ints("strides", Ints(n, 1)), dilations = c.attr_ints("dilations", Ints(n, 1));
    const Ints pads = c.attr_ints("pads", Ints(2 * n, 0)), output_padding = c.attr_ints("output_padding", Ints(n, 0));
    Ints output_shape = c.attr_ints("output_shape");
    if (output_shape.size() == n + 2) output_shape.erase(output_shape.begin(), output_shape.begin() + 2);
    if (strides.size() != n || dilations.size() != n || pads.size() != 2 * n || output_padding.size() != n ||
        (!output_shape.empty() && output_shape.size() != n))
      c.fail("strides, dilations, pads, output_padding or output_shape do not match {} spatial dims", n);
    const std::string auto_pad = c.attr_string("auto_pad", "NOTSET");
    if (auto_pad != "NOTSET" && auto_pad != "VALID" && auto_pad != "SAME_UPPER" && auto_pad != "SAME_LOWER")
      c.unsupported("auto_pad '{}'", auto_pad);
    // Per dim (height first; a 1-D input is height 1): where the output begins, its size.
    Ints begin(2, 0), out(2, 1), stride(2, 1), full(2, 1);
    w = as_2d(c, w, spatial_rank);
    for (size_t d = 0; d < n; ++d) {
      const size_t at = d + 2 - n;
      const int64_t in = x_shape[2 + d], s = strides[d];
      if (s < 1 || dilations[d] < 1) c.fail("strides {} and dilations {}, expected values >= 1", to_string(strides), to_string(dilations));
      stride[at] = s;
      full[at] = s * (in - 1) + (kernel[d] - 1) * dilations[d] + 1;
      const int64_t natural = full[at] + output_padding[d];
      int64_t pad_begin = pads[d], pad_end = pads[n + d];
      if (!output_shape.empty() || auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER") {
        out[at] = output_shape.empty() ? in * s : output_shape[d];
        const int64_t total = std::max<int64_t>(0, natural - out[at]);  // a larger output: zeros at the end
        pad_begin = auto_pad == "SAME_UPPER" ? total / 2 : total - total / 2;
      } else {
        if (auto_pad == "VALID") pad_begin = pad_end = 0;
        out[at] = natural - pad_begin - pad_end;
      }
      begin[at] = pad_begin;
      if (out[at] < 1 || pad_begin < 0) c.fail("an output of {} along spatial dim {} (pads {}), expected at least 1", out[at], d, to_string(pads));
    }
    for (int d = 0; d < 2; ++d) w = dilate(c.b(), w, 2 + d, d + n < 2 ? 1 : dilations[d + n - 2]);
    Ints padding(2), size(2);
    for (int d = 0; d < 2; ++d) {
      const int64_t b = begin[d], end = full[d] - (b + out[d]);  // end < 0: the output runs past the data
      // q = b takes the output as it is when its size is one the convolution allows; otherwise
      // the largest q that covers the data the output needs (q <= b, q <= end).
      const bool exact = out[d] >= full[d] - 2 * b && out[d] <= full[d] - 2 * b + stride[d] - 1;
      padding[d] = exact ? b : std::max<int64_t>(0, std::min(b, end));
      size[d] = std::clamp(b + out[d] - padding[d], full[d] - 2 * padding[d], full[d] - 2 * padding[d] + stride[d] - 1);
    }
    Expr y = c.b().apply1(Op::kConv2dGradInput, {x, w},
                          {{"stride", stride}, {"padding", padding}, {"groups", groups},
                           {"input_shape", Ints{x.dim(0), w.dim(1) * groups, size[0], size[1]}}});
    for (int d = 0; d < 2; ++d) {  // y covers [padding, padding + size) of the line
      const int64_t first = begin[d] - padding[d], last = first + out[d];
      if (last > y.dim(2 + d)) y = pad_axis(c.b(), y, 2 + d, 0, last - y.dim(2 + d), "constant", scalar_like(y, 0.0));
      if (first > 0 || last < y.dim(2 + d)) y = slice_axis(y, 2 + d, first, last);
    }
    if (c.has_input(2)) y = y + per_channel(c.in(2), 4);
    if (spatial_rank == 1) y = reshape(y, {y.dim(0), y.dim(1), y.dim(3)});
    return std::vector<Expr>{y};
  };

  auto pool = [](bool is_max) {
    return [is_max](NodeContext& c) {
      Expr x = c.in(0);
      // Max pooling also takes uint8 and int32 (the pads' least value is exact in a double fill).
      if (!is_max || (x.dtype() != DType::kU8 && x.dtype() != DType::kI32)) require_float(c, x);
      const bool indices = is_max && c.wants_output(1);
      const int spatial_rank = x.rank() - 2;
      const Ints kernel = c.attr_ints("kernel_shape");
      const bool ceil_mode = c.attr_int("ceil_mode", 0) != 0;
      const bool column_major = is_max && c.attr_int("storage_order", 0) != 0;  // of the Indices
      const bool include_pad = !is_max && c.attr_int("count_include_pad", 0) != 0;
      const Shape x_shape = x.shape();
      const Shape spatial(x_shape.begin() + 2, x_shape.end());
      if (static_cast<int>(kernel.size()) != spatial_rank) c.fail("kernel_shape {} for {} spatial dims", to_string(kernel), spatial_rank);
      Window explicit_pads = window_of(c, spatial, kernel, false);
      Window win = window_of(c, spatial, kernel, ceil_mode);
      bool dilated = false;
      for (int64_t d : win.dilations) dilated = dilated || d != 1;
      if (dilated || spatial_rank > 2 || indices || !is_float(x.dtype())) {  // beyond max_pool2d and avg_pool2d
        const PoolWindow taps{win.kernel, win.strides, win.dilations, win.pads_begin, win.pads_end, explicit_pads.pads_end};
        return pool_by_taps(c.b(), x, taps, is_max, include_pad, indices, column_major);
      }
      x = as_2d(c, x, spatial_rank);
      if (spatial_rank == 1)
        for (Window* wp : {&win, &explicit_pads})
          for (Ints* v : {&wp->kernel, &wp->strides, &wp->dilations, &wp->pads_begin, &wp->pads_end})
            v->insert(v->begin(), v == &wp->kernel || v == &wp->strides || v == &wp->dilations ? 1 : 0);
      const bool padded = win.pads_begin != Ints{0, 0} || win.pads_end != Ints{0, 0};
      Expr y;
      if (is_max) {
        Expr padded_x = padded ? pad_spatial(c.b(), x, win, scalar_like(x, -std::numeric_limits<double>::infinity())) : x;
        y = max_pool2d(padded_x, win.kernel, win.strides);
      } else if (!padded) {
        y = avg_pool2d(x, win.kernel, win.strides);
      } else {
        // The sum over each window, divided by how many of its elements count: the real ones,
        // and the explicit pads where count_include_pad (never the ceil mode's extra ones).
        const double window = static_cast<double>(win.kernel[0] * win.kernel[1]);
        Expr sums = avg_pool2d(pad_spatial(c.b(), x, win, scalar_like(x, 0.0)), win.kernel, win.strides) * window;
        Builder& b = c.b();
        Expr ones = b.full({1, 1, x.dim(2), x.dim(3)}, 1.0, x.dtype());
        Expr counted = include_pad ? pad_spatial(b, ones, explicit_pads, scalar_like(x, 1.0)) : ones;
        Window rest = win;
        if (include_pad) {
          rest.pads_begin.assign(2, 0);
          for (int d = 0; d < 2; ++d) rest.pads_end[d] = win.pads_end[d] - explicit_pads.pads_end[d];
        }
        Expr mask = pad_spatial(b, counted, rest, scalar_like(x, 0.0));
        Expr counts = avg_pool2d(mask, win.kernel, win.strides) * window;
        y = sums / counts;
      }
      if (spatial_rank == 1) y = reshape(y, {y.dim(0), y.dim(1), y.dim(3)});
      return std::vector<Expr>{y};
    };
  };
  r["MaxPool"] = pool(true);
  r["AveragePool"] = pool(false);
  r["GlobalAveragePool"] = [](NodeContext& c) {
    Expr x = c.in(0);
    Ints axes;
    for (int d = 2; d < x.rank(); ++d) axes.push_back(d);
    return std::vector<Expr>{mean(x, axes, true)};
  };
  r["GlobalMaxPool"] = [](NodeContext& c) {
    Expr x = c.in(0);
    Ints axes;
    for (int d = 2; d < x.rank(); ++d) axes.push_back(d);
    return std::vector<Expr>{max(x, axes, true)};
  };

  r["SoftmaxCrossEntropyLoss"] = loss_rule(true);
  r["NegativeLogLikelihoodLoss"] = loss_rule(false);
}

}  // namespace kiln::onnx
