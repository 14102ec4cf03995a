// ONNX's Resize (opsets 10 to 19), Upsample (7 to 9), GridSample (16) and RoiAlign as kiln ops. The scales or sizes are
// known at import, so every output position's source positions and weights along an axis are
// numbers computed here: an axis is resized by gathers at constant positions, each multiplied by
// its constant weights and added (nearest: one gather, linear: two, cubic: four, antialiased: the
// filter's width), one axis after the other. The gathers' gradient is scatter_add, so a resize
// trains and runs on every backend with no op of its own.
//
// GridSample and RoiAlign read positions that come from the data (the grid): its taps' positions and
// weights are computed in the graph (rounded down through casts, torch's grid_sample's padding and
// reflection), the gathers read rows of the input at them, and the grid's gradient flows through
// the weights.
//
// Resize's coordinates follow the ONNX reference (onnx/backend/test/case/node/resize.py and its
// successor onnx.reference): the resized length in a coordinate transform is the input's length
// times the scale (not rounded), a source position outside the input reads its nearest edge
// (or, with exclude_outside, has weight 0 and the others are renormalized), tf_crop_and_resize
// gives extrapolation_value outside the input.
#include <algorithm>
#include <cmath>
#include <map>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

using Ints = std::vector<int64_t>;

struct Tap {
  int64_t index;
  double weight;
};

struct ResizeMode {
  std::string mode = "nearest";  // nearest, linear, cubic
  std::string coordinates = "half_pixel";
  std::string nearest = "round_prefer_floor";
  double cubic_a = -0.75;
  bool exclude_outside = false;
  bool antialias = false;
  double extrapolation = 0.0;
};

// One axis: for each output position, the input positions it reads and their weights; `outside`
// marks the positions tf_crop_and_resize fills with the extrapolation value.
struct AxisPlan {
  std::vector<std::vector<Tap>> taps;
  std::vector<bool> outside;
};

double cubic_weight(double d, double a) {
  d = std::abs(d);
  if (d <= 1) return ((a + 2) * d - (a + 3)) * d * d + 1;
  if (d < 2) return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a;
  return 0;
}

// The input coordinate of output position x. `scale` is the axis's scale, `in` and `out` its
// lengths; roi_start and roi_end only for tf_crop_and_resize.
double source_coordinate(NodeContext& c, const ResizeMode& m, double x, double scale, int64_t in, int64_t out,
                         double roi_start, double roi_end) {
  const double resized = scale * static_cast<double>(in);  // as the reference: not rounded
  const std::string& t = m.coordinates;
  if (t == "half_pixel") return (x + 0.5) / scale - 0.5;
  if (t == "half_pixel_symmetric") {
    const double adjustment = static_cast<double>(out) / resized;
    const double offset = static_cast<double>(in) / 2 * (1 - adjustment);
    return offset + (x + 0.5) / scale - 0.5;
  }
  // The spec's 0 for a length-1 output; the reference's -0.5 reads the same edge.
  if (t == "pytorch_half_pixel") return resized > 1 ? (x + 0.5) / scale - 0.5 : 0.0;
  if (t == "align_corners") return resized == 1 ? 0.0 : x * static_cast<double>(in - 1) / (resized - 1);
  if (t == "asymmetric") return x / scale;
  if (t == "tf_half_pixel_for_nn") return (x + 0.5) / scale;
  if (t == "tf_crop_and_resize") {
    const double span = (roi_end - roi_start) * static_cast<double>(in - 1);
    return roi_start * static_cast<double>(in - 1) + (resized == 1 ? span / 2 : x * span / (resized - 1));
  }
  c.unsupported("coordinate_transformation_mode '{}'", t);
}

AxisPlan plan_axis(NodeContext& c, const ResizeMode& m, double scale, int64_t in, int64_t out, double roi_start,
                   double roi_end) {
  AxisPlan plan;
  plan.taps.resize(out);
  plan.outside.assign(out, false);
  const auto clamp = [&](int64_t i) { return std::clamp<int64_t>(i, 0, in - 1); };
  for (int64_t o = 0; o < out; ++o) {
    const double x = source_coordinate(c, m, static_cast<double>(o), scale, in, out, roi_start, roi_end);
    if (m.coordinates == "tf_crop_and_resize" && (x < 0 || x > static_cast<double>(in - 1))) {
      plan.outside[o] = true;
      continue;
    }
    std::vector<Tap>& taps = plan.taps[o];
    if (m.mode == "nearest") {
      const double below = std::floor(x), fraction = x - below;
      int64_t i = static_cast<int64_t>(below);
      const std::string& n = m.nearest;
      if (fraction != 0 && (n == "ceil" || (n == "round_prefer_ceil" && fraction >= 0.5) ||
                            (n == "round_prefer_floor" && fraction > 0.5)))
        ++i;
      taps.push_back({clamp(i), 1.0});
      continue;
    }
    // linear and cubic: the filter, stretched by 1 / scale when antialiasing a downscale.
    const double radius = m.mode == "linear" ? 1.0 : 2.0;
    const double stretch = m.antialias ? std::min(scale, 1.0) : 1.0;
    std::vector<Tap> raw;
    double total = 0;
    for (int64_t i = static_cast<int64_t>(std::floor(x - radius / stretch));
         i <= static_cast<int64_t>(std::ceil(x + radius / stretch)); ++i) {
      const double d = (static_cast<double>(i) - x) * stretch;
      const double w = m.mode == "linear" ? std::max(0.0, 1 - std::abs(d)) : cubic_weight(d, m.cubic_a);
      if (w == 0) continue;
      if (m.exclude_outside && (i < 0 || i >= in)) continue;
      raw.push_back({i, w});
      total += w;
    }
    const bool normalize = m.exclude_outside || m.antialias;
    for (const Tap& t : raw) {
      const Tap tap{clamp(t.index), normalize ? t.weight / total : t.weight};
      auto same = std::find_if(taps.begin(), taps.end(), [&](const Tap& u) { return u.index == tap.index; });
      if (same != taps.end()) same->weight += tap.weight;
      else taps.push_back(tap);
    }
  }
  return plan;
}

Expr index_constant(Builder& b, const Ints& values) {
  Tensor t(TensorType{DType::kI64, {static_cast<int64_t>(values.size())}});
  std::copy(values.begin(), values.end(), t.data<int64_t>());
  return constant_of(b, t);
}

// x resized along `axis` by the plan: sum over tap slots j of gather(x, index_j) * weight_j.
Expr resize_axis(NodeContext& c, Expr x, int axis, const AxisPlan& plan, const ResizeMode& m) {
  Builder& b = c.b();
  const int64_t in = x.dim(axis), out = static_cast<int64_t>(plan.taps.size());
  size_t slots = 0;
  bool single = true, any_outside = false;
  for (int64_t o = 0; o < out; ++o) {
    slots = std::max(slots, plan.taps[o].size());
    single = single && (plan.outside[o] || (plan.taps[o].size() == 1 && plan.taps[o][0].weight == 1.0));
    any_outside = any_outside || plan.outside[o];
  }
  if (single && !any_outside) {  // nearest, or a linear that lands on input positions
    Ints index;
    for (int64_t o = 0; o < out; ++o) index.push_back(plan.taps[o][0].index);
    bool identity = out == in;
    for (int64_t o = 0; o < out && identity; ++o) identity = index[o] == o;
    return identity ? x : gather(x, index_constant(b, index), axis);
  }
  if (!is_float(x.dtype()))
    c.unsupported("{} interpolation of {} (kiln weighs floats only)", m.mode, dtype_name(x.dtype()));
  Shape along(x.rank(), 1);
  along[axis] = out;
  auto column = [&](const std::vector<double>& v) {
    return reshape(b.constant({out}, v, x.dtype()), along);
  };
  Expr y;
  for (size_t j = 0; j < slots; ++j) {
    Ints index(out, 0);
    std::vector<double> weight(out, 0.0);
    for (int64_t o = 0; o < out; ++o) {
      if (j >= plan.taps[o].size()) continue;
      index[o] = plan.taps[o][j].index;
      weight[o] = plan.taps[o][j].weight;
    }
    Expr term = gather(x, index_constant(b, index), axis) * column(weight);
    y = j == 0 ? term : y + term;
  }
  if (any_outside) {
    std::vector<double> fill(out, 0.0);
    for (int64_t o = 0; o < out; ++o) fill[o] = plan.outside[o] ? m.extrapolation : 0.0;
    Expr e = column(fill);
    y = slots == 0 ? broadcast_to(e, [&] { Shape s = x.shape(); s[axis] = out; return s; }()) : y + e;
  }
  return y;
}

// The tensor of a Resize input, or nothing where it is absent or empty (an empty scales or roi
// stands for "not given").
std::optional<Tensor> optional_input(NodeContext& c, int i, const std::string& what) {
  if (!c.has_input(i)) return std::nullopt;
  if (c.in(i).type().numel() == 0) return std::nullopt;
  return c.constant(i, what);
}

// Resizes x: per axis a scale (scales given) or a length (sizes given).
Expr resize(NodeContext& c, Expr x, ResizeMode m, std::optional<Tensor> scales_in, std::optional<Tensor> sizes_in,
            std::optional<Tensor> roi_in, Ints axes, const std::string& aspect_policy) {
  const int rank = x.rank();
  if (m.mode != "nearest" && m.mode != "linear" && m.mode != "cubic") c.unsupported("mode '{}'", m.mode);
  if (m.mode == "nearest" && m.nearest != "round_prefer_floor" && m.nearest != "round_prefer_ceil" &&
      m.nearest != "floor" && m.nearest != "ceil")
    c.unsupported("nearest_mode '{}'", m.nearest);
  if (m.antialias && m.mode == "nearest") c.fail("antialias applies to linear and cubic, not to nearest");
  if (scales_in && sizes_in) c.fail("takes scales or sizes, not both");
  if (!scales_in && !sizes_in) c.fail("needs scales or sizes");
  if (axes.empty())
    for (int d = 0; d < rank; ++d) axes.push_back(d);
  for (int64_t& a : axes) {
    if (a < -rank || a >= rank) c.fail("axis {} is out of range for rank {}", a, rank);
    if (a < 0) a += rank;
  }
  const size_t n = axes.size();
  std::vector<double> scale(rank, 1.0), roi_start(rank, 0.0), roi_end(rank, 1.0);
  Shape out = x.shape();
  if (roi_in && m.coordinates == "tf_crop_and_resize") {
    if (roi_in->numel() != static_cast<int64_t>(2 * n)) c.fail("roi has {} values for {} axes", roi_in->numel(), n);
    for (size_t i = 0; i < n; ++i) {
      roi_start[axes[i]] = roi_in->get(static_cast<int64_t>(i));
      roi_end[axes[i]] = roi_in->get(static_cast<int64_t>(i + n));
    }
  } else if (m.coordinates == "tf_crop_and_resize") {
    c.fail("tf_crop_and_resize needs a roi");
  }
  if (scales_in) {
    if (scales_in->numel() != static_cast<int64_t>(n)) c.fail("{} scales for {} axes", scales_in->numel(), n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t a = axes[i];
      scale[a] = scales_in->get(static_cast<int64_t>(i));
      if (!(scale[a] > 0)) c.fail("scale {} of axis {} is not positive", scale[a], a);
      const double length = static_cast<double>(x.dim(static_cast<int>(a))) * (roi_end[a] - roi_start[a]) * scale[a];
      out[a] = static_cast<int64_t>(std::floor(length));
    }
  } else {
    if (sizes_in->numel() != static_cast<int64_t>(n)) c.fail("{} sizes for {} axes", sizes_in->numel(), n);
    if (sizes_in->dtype() != DType::kI64) c.fail("sizes must be int64, got {}", dtype_name(sizes_in->dtype()));
    for (size_t i = 0; i < n; ++i) {
      const int64_t a = axes[i], want = sizes_in->data<int64_t>()[i];
      if (want <= 0) c.fail("size {} of axis {} is not positive", want, a);
      if (x.dim(static_cast<int>(a)) == 0) c.fail("axis {} is empty: no scale takes it to {}", a, want);
      out[a] = want;
      scale[a] = static_cast<double>(want) / static_cast<double>(x.dim(static_cast<int>(a)));
    }
    if (aspect_policy != "stretch") {
      if (aspect_policy != "not_larger" && aspect_policy != "not_smaller")
        c.fail("keep_aspect_ratio_policy '{}' (expected stretch, not_larger or not_smaller)", aspect_policy);
      double common = scale[axes[0]];
      for (int64_t a : axes) common = aspect_policy == "not_larger" ? std::min(common, scale[a]) : std::max(common, scale[a]);
      for (int64_t a : axes) {
        scale[a] = common;
        out[a] = static_cast<int64_t>(common * static_cast<double>(x.dim(static_cast<int>(a))) + 0.5);
      }
    }
  }
  // Innermost axis first, as the reference nests them (it matters for nothing but rounding).
  for (int a = rank - 1; a >= 0; --a) {
    if (std::find(axes.begin(), axes.end(), a) == axes.end()) continue;
    if (out[a] == 0) c.unsupported("an output of length 0 along axis {}", a);
    const AxisPlan plan = plan_axis(c, m, scale[a], x.dim(a), out[a], roi_start[a], roi_end[a]);
    x = resize_axis(c, x, a, plan, m);
  }
  return x;
}

std::vector<Expr> resize_rule(NodeContext& c) {
  Expr x = c.in(0);
  ResizeMode m;
  m.mode = c.attr_string("mode", "nearest");
  std::optional<Tensor> roi, scales, sizes;
  Ints axes;
  std::string policy = "stretch";
  if (c.opset() < 11) {  // Resize-10: Upsample's semantics, scales as input 1
    m.coordinates = "asymmetric";
    m.nearest = "floor";
    scales = c.constant(1, "scales");
  } else {
    m.coordinates = c.attr_string("coordinate_transformation_mode", "half_pixel");
    // Attributes of the modes other than the node's change nothing for it.
    m.nearest = c.attr_string("nearest_mode", "round_prefer_floor");
    m.cubic_a = c.attr_float("cubic_coeff_a", -0.75);
    m.exclude_outside = c.attr_int("exclude_outside", 0) != 0;
    m.extrapolation = c.attr_float("extrapolation_value", 0.0);
    if (c.opset() >= 18) {
      m.antialias = c.attr_int("antialias", 0) != 0;
      axes = c.attr_ints("axes");
      policy = c.attr_string("keep_aspect_ratio_policy", "stretch");
    }
    if (m.coordinates == "tf_crop_and_resize") roi = optional_input(c, 1, "roi");
    scales = optional_input(c, 2, "scales");
    sizes = optional_input(c, 3, "sizes");
  }
  return {resize(c, x, m, scales, sizes, roi, axes, policy)};
}

std::vector<Expr> upsample_rule(NodeContext& c) {
  Expr x = c.in(0);
  if (c.opset() < 7) c.unsupported("Upsample before opset 7 (height_scale and width_scale)");
  ResizeMode m;
  m.mode = c.attr_string("mode", "nearest");
  if (m.mode == "bilinear") m.mode = "linear";
  if (m.mode != "nearest" && m.mode != "linear") c.unsupported("mode '{}'", m.mode);
  m.coordinates = "asymmetric";
  m.nearest = "floor";
  Tensor scales;
  if (c.opset() >= 9) {
    scales = c.constant(1, "scales");
  } else {
    const std::vector<double> v = c.attr_floats("scales");
    scales = Tensor::from_f64({DType::kF64, {static_cast<int64_t>(v.size())}}, v);
  }
  return {resize(c, x, m, scales, std::nullopt, std::nullopt, {}, "stretch")};
}

// ---- GridSample: positions that come from the data ----------------------------------------------

// A coordinate mirrored into [low, high] / 2 as torch's grid_sample reflects it (twice_low and
// twice_high are twice the bounds: pixel edges or pixel centers).
Expr reflect(const Expr& x, double twice_low, double twice_high) {
  if (twice_low == twice_high) return x * 0.0;
  const double low = twice_low / 2, span = (twice_high - twice_low) / 2;
  Expr d = abs(x - low);
  Expr flips = rounded_down(d / span);
  Expr extra = d - flips * span;
  Expr odd = ne(flips - rounded_down(flips / 2.0) * 2.0, scalar_like(x, 0.0));
  return where(odd, (span + low) - extra, extra + low);
}

// The input position of a normalized grid coordinate along an axis of `size` pixels, with the
// padding mode's clipping or reflection (bilinear and nearest; bicubic pads its taps instead).
Expr unnormalize(const Expr& g, int64_t size, bool align_corners) {
  const double n = static_cast<double>(size);
  return align_corners ? (g + 1.0) * ((n - 1) / 2) : ((g + 1.0) * n - 1.0) / 2.0;
}

Expr pad_coordinate(const Expr& x, int64_t size, bool align_corners, const std::string& padding) {
  const double n = static_cast<double>(size);
  auto clip = [&](const Expr& v) { return minimum(maximum(v, scalar_like(v, 0.0)), scalar_like(v, n - 1)); };
  if (padding == "border") return clip(x);
  if (padding == "reflection") return clip(align_corners ? reflect(x, 0, 2 * (n - 1)) : reflect(x, -1, 2 * n - 1));
  return x;  // zeros: taps outside read 0
}

std::vector<Expr> grid_sample(NodeContext& c) {
  Expr x = c.in(0), grid = c.in(1);
  Builder& b = c.b();
  if (!is_float(x.dtype())) c.unsupported("needs float inputs, got {}", dtype_name(x.dtype()));
  if (x.rank() != 4) c.unsupported("{}-D inputs (kiln samples (N, C, H, W))", x.rank() - 2);
  const int64_t n = x.dim(0), channels = x.dim(1), height = x.dim(2), width = x.dim(3);
  if (grid.rank() != 4 || grid.dim(0) != n || grid.dim(3) != 2)
    c.fail("grid is {}, expected ({}, H_out, W_out, 2)", to_string(grid.type()), n);
  std::string mode = c.attr_string("mode", c.opset() >= 20 ? "linear" : "bilinear");
  if (mode == "linear") mode = "bilinear";
  if (mode == "cubic") mode = "bicubic";
  const std::string padding = c.attr_string("padding_mode", "zeros");
  const bool align = c.attr_int("align_corners", 0) != 0;
  if (mode != "bilinear" && mode != "nearest" && mode != "bicubic") c.unsupported("mode '{}'", mode);
  if (padding != "zeros" && padding != "border" && padding != "reflection") c.unsupported("padding_mode '{}'", padding);
  grid = cast_to(grid, x.dtype());
  const int64_t ho = grid.dim(1), wo = grid.dim(2);
  Expr gx = reshape(slice_axis(grid, 3, 0, 1), {n, ho, wo}), gy = reshape(slice_axis(grid, 3, 1, 2), {n, ho, wo});
  Expr ix = unnormalize(gx, width, align), iy = unnormalize(gy, height, align);
  if (mode != "bicubic") {
    ix = pad_coordinate(ix, width, align, padding);
    iy = pad_coordinate(iy, height, align, padding);
  }
  // (N * H * W, C): one row per pixel; a tap gathers rows at n * H * W + y * W + x.
  Expr rows = reshape(transpose(x, {0, 2, 3, 1}), {n * height * width, channels});
  Expr batch_offset = b.iota({n, ho, wo}, 0, DType::kI64) * b.scalar(static_cast<double>(height * width), DType::kI64);
  Expr y;
  auto add_tap = [&](Expr tx, Expr ty, Expr weight) {
    if (mode == "bicubic" && padding != "zeros") {  // bicubic pads the tap positions themselves
      tx = pad_coordinate(tx, width, align, padding);
      ty = pad_coordinate(ty, height, align, padding);
    }
    Expr zero = scalar_like(tx, 0.0);
    Expr inside = cast(ge(tx, zero), x.dtype()) * cast(le(tx, scalar_like(tx, double(width - 1))), x.dtype()) *
                  cast(ge(ty, zero), x.dtype()) * cast(le(ty, scalar_like(ty, double(height - 1))), x.dtype());
    Expr cx = minimum(maximum(tx, zero), scalar_like(tx, double(width - 1)));
    Expr cy = minimum(maximum(ty, zero), scalar_like(ty, double(height - 1)));
    Expr index = cast(cy * static_cast<double>(width) + cx, DType::kI64) + batch_offset;
    Expr term = gather(rows, index, 0) * reshape(weight * inside, {n, ho, wo, 1});  // (N, Ho, Wo, C)
    y = y.id() < 0 ? term : y + term;
  };
  if (mode == "nearest") {
    add_tap(rounded_half_even(ix), rounded_half_even(iy), b.full({n, ho, wo}, 1.0, x.dtype()));
  } else if (mode == "bilinear") {
    Expr x0 = rounded_down(ix), y0 = rounded_down(iy);
    Expr fx = ix - x0, fy = iy - y0;
    for (int dy = 0; dy < 2; ++dy)
      for (int dx = 0; dx < 2; ++dx)
        add_tap(x0 + double(dx), y0 + double(dy), (dx ? fx : 1.0 - fx) * (dy ? fy : 1.0 - fy));
  } else {  // bicubic, A = -0.75, taps at floor - 1 .. floor + 2
    const double a = -0.75;
    auto near_weight = [&](const Expr& t) { return ((t * (a + 2) - (a + 3)) * t) * t + 1.0; };          // |d| <= 1
    auto far_weight = [&](const Expr& t) { return ((t * a - 5 * a) * t + 8 * a) * t - 4 * a; };         // 1 < |d| < 2
    auto weights = [&](const Expr& f) {
      return std::vector<Expr>{far_weight(f + 1.0), near_weight(f), near_weight(1.0 - f), far_weight(2.0 - f)};
    };
    Expr x0 = rounded_down(ix), y0 = rounded_down(iy);
    const std::vector<Expr> wx = weights(ix - x0), wy = weights(iy - y0);
    for (int dy = 0; dy < 4; ++dy)
      for (int dx = 0; dx < 4; ++dx) add_tap(x0 + double(dx - 1), y0 + double(dy - 1), wx[dx] * wy[dy]);
  }
  return {transpose(y, {0, 3, 1, 2})};
}

// RoiAlign: each region of interest (x1, y1, x2, y2) of image batch_indices[r] cut into
// output_height x output_width bins, each the mean (or max) of sampling_ratio^2 bilinear samples,
// with the sampling rules of the runtimes (Caffe2's, torchvision's): samples past one pixel
// outside the image read 0, others clamp to the edge. The regions may come from the data (the
// samples' positions and weights are computed in the graph); an adaptive sampling_ratio (0)
// needs them known, as it sets how many samples there are.
std::vector<Expr> roi_align(NodeContext& c) {
  Builder& b = c.b();
  Expr x = c.in(0), rois = c.in(1), batch_index = cast_to(c.in(2), DType::kI64);
  if (!is_float(x.dtype())) c.unsupported("needs float inputs, got {}", dtype_name(x.dtype()));
  if (x.rank() != 4) c.fail("X must be (N, C, H, W), got {}", to_string(x.type()));
  const int64_t n = x.dim(0), channels = x.dim(1), height = x.dim(2), width = x.dim(3);
  if (rois.rank() != 2 || rois.dim(1) != 4) c.fail("rois must be (R, 4), got {}", to_string(rois.type()));
  const int64_t regions = rois.dim(0);
  if (batch_index.shape() != Shape{regions}) c.fail("batch_indices {} for {} rois", to_string(batch_index.type()), regions);
  const std::string mode = c.attr_string("mode", "avg");
  if (mode != "avg" && mode != "max") c.fail("mode '{}' (expected avg or max)", mode);
  const std::string transform = c.attr_string("coordinate_transformation_mode", c.opset() >= 16 ? "half_pixel" : "output_half_pixel");
  if (transform != "half_pixel" && transform != "output_half_pixel") c.fail("coordinate_transformation_mode '{}'", transform);
  const int64_t out_h = c.attr_int("output_height", 1), out_w = c.attr_int("output_width", 1);
  const int64_t ratio = c.attr_int("sampling_ratio", 0);
  const double spatial_scale = c.attr_float("spatial_scale", 1.0);
  if (ratio <= 0) c.unsupported("an adaptive sampling_ratio (0): the sample count depends on the regions");
  rois = cast_to(rois, x.dtype());
  const double offset = transform == "half_pixel" ? 0.5 : 0.0;
  auto column = [&](int64_t k) { return reshape(slice_axis(rois, 1, k, k + 1), {regions, 1}); };  // (R, 1)
  Expr x1 = column(0) * spatial_scale - offset, y1 = column(1) * spatial_scale - offset;
  Expr w = column(2) * spatial_scale - offset - x1, h = column(3) * spatial_scale - offset - y1;
  if (transform == "output_half_pixel") {  // the legacy mode makes a region at least one pixel
    w = maximum(w, scalar_like(w, 1.0));
    h = maximum(h, scalar_like(h, 1.0));
  }
  // Sample positions along one axis, (R, bins * ratio): start + (bin + (i + 0.5) / ratio) * size / bins.
  auto samples = [&](const Expr& start, const Expr& size, int64_t bins) {
    std::vector<double> unit(bins * ratio);
    for (int64_t k = 0; k < bins * ratio; ++k)
      unit[k] = (static_cast<double>(k / ratio) + (static_cast<double>(k % ratio) + 0.5) / static_cast<double>(ratio)) /
                static_cast<double>(bins);
    return start + b.constant({1, bins * ratio}, unit, x.dtype()) * size;
  };
  // Per axis: the sample's two taps and their weights, and whether it reads the image at all.
  struct Taps {
    Expr low, high, w_low, w_high, inside;
  };
  auto taps = [&](Expr p, int64_t size) {
    const double last = static_cast<double>(size - 1);
    Expr inside = cast(ge(p, scalar_like(p, -1.0)), p.dtype()) * cast(le(p, scalar_like(p, double(size))), p.dtype());
    p = maximum(p, scalar_like(p, 0.0));
    Expr low = rounded_down(p);
    Expr at_end = ge(low, scalar_like(low, last));
    low = where(at_end, scalar_like(low, last), low);
    Expr high = where(at_end, scalar_like(low, last), low + 1.0);
    p = where(at_end, low, p);
    Expr frac = p - low;
    return Taps{low, high, 1.0 - frac, frac, inside};
  };
  const Taps ty = taps(samples(y1, h, out_h), height), tx = taps(samples(x1, w, out_w), width);
  const int64_t sh = out_h * ratio, sw = out_w * ratio;
  // (R, SH, SW) grids of rows of X (N * H * W, C) to gather.
  Expr rows = reshape(transpose(x, {0, 2, 3, 1}), {n * height * width, channels});
  Expr base = reshape(batch_index, {regions, 1, 1}) * b.scalar(static_cast<double>(height * width), DType::kI64);
  auto grid_y = [&](const Expr& v) { return reshape(v, {regions, sh, 1}); };
  auto grid_x = [&](const Expr& v) { return reshape(v, {regions, 1, sw}); };
  Expr inside = grid_y(ty.inside) * grid_x(tx.inside);
  Expr y;
  for (int a = 0; a < 2; ++a)
    for (int d = 0; d < 2; ++d) {
      Expr iy = a ? ty.high : ty.low, ix = d ? tx.high : tx.low;
      Expr index = base + cast(grid_y(iy) * static_cast<double>(width) + grid_x(ix), DType::kI64);  // (R, SH, SW)
      Expr weight = grid_y(a ? ty.w_high : ty.w_low) * grid_x(d ? tx.w_high : tx.w_low) * inside;
      Expr term = gather(rows, index, 0) * reshape(weight, {regions, sh, sw, 1});  // (R, SH, SW, C)
      // max mode takes the largest weighted tap (as the runtimes do), avg their sum.
      y = y.id() < 0 ? term : mode == "avg" ? y + term : maximum(y, term);
    }
  Expr bins = reshape(y, {regions, out_h, ratio, out_w, ratio, channels});
  Expr pooled = mode == "avg" ? sum(bins, {2, 4}) / static_cast<double>(ratio * ratio) : max(bins, {2, 4});
  return {transpose(pooled, {0, 3, 1, 2})};
}

}  // namespace

void add_resize_rules(RuleTable& r) {
  r["RoiAlign"] = roi_align;
  r["Resize"] = resize_rule;
  r["Upsample"] = upsample_rule;
  r["GridSample"] = grid_sample;
}

}  // namespace kiln::onnx
