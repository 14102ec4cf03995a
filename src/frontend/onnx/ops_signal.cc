// ONNX's signal-processing ops. The generators whose inputs are sizes and rates (HannWindow,
// HammingWindow, BlackmanWindow, MelWeightMatrix) are constants computed here in double
// precision, their inputs being known at import. DFT and STFT are matmuls of the signal by
// constant cosine and sine tables (a GEMM per transform, which trains like any product; an FFT
// would need an op of its own), STFT's frames a gather at constant positions.
#include <algorithm>
#include <cmath>
#include <numbers>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

DType output_dtype(NodeContext& c) {
  return dtype_of(static_cast<int>(c.attr_int("output_datatype", ::onnx::TensorProto::FLOAT)),
                  c.where() + " output_datatype");
}

// The count input (a scalar of int32 or int64) as a non-negative length.
int64_t length_input(NodeContext& c, int i, const std::string& what) {
  const Tensor t = c.constant(i, what);
  if (t.numel() != 1 || !is_integer(t.dtype())) c.fail("its {} must be one integer, got {}", what, to_string(t.type()));
  const int64_t n = t.dtype() == DType::kI64 ? t.data<int64_t>()[0] : static_cast<int64_t>(t.get(0));
  if (n < 0) c.fail("its {} is {}", what, n);
  return n;
}

// A generalized cosine window: sum_k a_k cos(2 pi k n / N), N = size (periodic) or size - 1.
Rule cosine_window(std::vector<double> coefficients) {
  return [coefficients](NodeContext& c) {
    const int64_t size = length_input(c, 0, "size");
    const bool periodic = c.attr_int("periodic", 1) != 0;
    const DType dtype = output_dtype(c);
    const double period = static_cast<double>(periodic ? size : size - 1);
    std::vector<double> v(size, 0.0);
    for (int64_t n = 0; n < size; ++n)
      for (size_t k = 0; k < coefficients.size(); ++k)
        v[n] += coefficients[k] * std::cos(2 * std::numbers::pi * static_cast<double>(k * n) / period);
    return std::vector<Expr>{constant_of(c.b(), Tensor::from_f64({dtype, {size}}, v))};
  };
}

// The triangular filters of num_mel_bins mel bands over the dft_length / 2 + 1 bins of a
// spectrum, as the ONNX operator's definition computes them (band edges spaced evenly in mel,
// rounded down to bins).
std::vector<Expr> mel_weight_matrix(NodeContext& c) {
  const int64_t bands = length_input(c, 0, "num_mel_bins");
  const int64_t dft_length = length_input(c, 1, "dft_length");
  const int64_t sample_rate = length_input(c, 2, "sample_rate");
  const double lower = c.scalar(3, "lower_edge_hertz"), upper = c.scalar(4, "upper_edge_hertz");
  const DType dtype = output_dtype(c);
  if (sample_rate == 0) c.fail("sample_rate is 0");
  const int64_t bins = dft_length / 2 + 1;
  auto mel = [](double hertz) { return 2595 * std::log10(1 + hertz / 700); };
  const double low_mel = mel(lower), step = (mel(upper) - low_mel) / static_cast<double>(bands + 2);
  std::vector<int64_t> edge(bands + 2);
  for (int64_t i = 0; i < bands + 2; ++i) {
    const double hertz = 700 * (std::pow(10.0, (static_cast<double>(i) * step + low_mel) / 2595) - 1);
    edge[i] = static_cast<int64_t>(std::floor(static_cast<double>(dft_length + 1) * hertz / static_cast<double>(sample_rate)));
  }
  std::vector<double> w(bins * bands, 0.0);
  auto at = [&](int64_t bin, int64_t band) -> double& {
    if (bin < 0 || bin >= bins) c.fail("band {} reaches bin {} of {}: the edges lie past the spectrum", band, bin, bins);
    return w[bin * bands + band];
  };
  for (int64_t i = 0; i < bands; ++i) {
    const int64_t left = edge[i], center = edge[i + 1], right = edge[i + 2];
    if (center == left) at(center, i) = 1;
    else
      for (int64_t j = left; j <= center; ++j) at(j, i) = static_cast<double>(j - left) / static_cast<double>(center - left);
    for (int64_t j = center; j < right; ++j) at(j, i) = static_cast<double>(right - j) / static_cast<double>(right - center);
  }
  return {constant_of(c.b(), Tensor::from_f64({dtype, {bins, bands}}, w))};
}

// The transform of the complex signal re + i im (im may be absent: a real signal) along its
// last axis of n samples, as a length-`length` DFT (samples past `length` dropped, missing ones
// zeros), keeping `bins` frequencies: (Re, Im), each (..., bins).
std::pair<Expr, Expr> dft_last_axis(Builder& b, const Expr& re, const std::optional<Expr>& im, int64_t length,
                                    int64_t bins, bool inverse) {
  const int64_t n = re.dim(-1);
  std::vector<double> cosines(n * bins, 0.0), sines(n * bins, 0.0);
  const double sign = inverse ? 1.0 : -1.0, scale = inverse ? 1.0 / static_cast<double>(length) : 1.0;
  for (int64_t t = 0; t < std::min(n, length); ++t)
    for (int64_t k = 0; k < bins; ++k) {
      // t * k mod length keeps the angle small (and exact) for long transforms.
      const double angle = sign * 2 * std::numbers::pi * static_cast<double>((t * k) % length) / static_cast<double>(length);
      cosines[t * bins + k] = std::cos(angle) * scale;
      sines[t * bins + k] = std::sin(angle) * scale;
    }
  Expr c = b.constant({n, bins}, cosines, re.dtype()), s = b.constant({n, bins}, sines, re.dtype());
  // matmul takes rank >= 2: a lone signal (n,) as one row.
  auto row = [](const Expr& v) { return v.rank() == 1 ? reshape(v, {1, v.dim(0)}) : v; };
  auto unrow = [&](const Expr& v) { return re.rank() == 1 ? reshape(v, {bins}) : v; };
  // (a + i b)(cos + i sin) = a cos - b sin + i (a sin + b cos)
  Expr out_re = matmul(row(re), c), out_im = matmul(row(re), s);
  if (im) {
    out_re = out_re - matmul(row(*im), s);
    out_im = out_im + matmul(row(*im), c);
  }
  return {unrow(out_re), unrow(out_im)};
}

// x (..., 1 or 2): its real part and, for 2, its imaginary part, each (...).
std::pair<Expr, std::optional<Expr>> complex_parts(NodeContext& c, const Expr& x) {
  const int last = x.rank() - 1;
  Shape s = x.shape();
  s.pop_back();
  if (x.dim(last) == 1) return {reshape(x, s), std::nullopt};
  if (x.dim(last) != 2) c.fail("the last dim of {} must be 1 (real) or 2 (complex)", to_string(x.type()));
  return {reshape(slice_axis(x, last, 0, 1), s), reshape(slice_axis(x, last, 1, 2), s)};
}

// Re and Im (..., k) stacked to (..., k, 2).
Expr stack_complex(const Expr& re, const Expr& im) {
  Shape s = re.shape();
  s.push_back(1);
  return concat({reshape(re, s), reshape(im, s)}, static_cast<int64_t>(s.size()) - 1);
}

std::vector<Expr> dft(NodeContext& c) {
  Expr x = c.in(0);
  if (!is_float(x.dtype())) c.unsupported("needs float inputs, got {}", dtype_name(x.dtype()));
  const bool inverse = c.attr_int("inverse", 0) != 0, onesided = c.attr_int("onesided", 0) != 0;
  if (x.rank() < 2) c.fail("needs (..., N, 1 or 2), got {}", to_string(x.type()));
  int64_t axis = c.opset() >= 20 ? (c.has_input(2) ? static_cast<int64_t>(c.scalar(2, "axis")) : -2) : c.attr_int("axis", 1);
  const int signal_rank = x.rank() - 1;  // the last dim holds the real and imaginary parts
  if (axis < 0) axis += x.rank();
  if (axis < 0 || axis >= signal_rank) c.fail("axis {} is not a signal axis of {}", axis, to_string(x.type()));
  auto [re, im] = complex_parts(c, x);
  if (onesided && im) c.fail("onesided takes a real signal, got a complex one");
  if (onesided && inverse) c.unsupported("an inverse onesided DFT");
  const int64_t length = c.has_input(1) && c.in(1).type().numel() > 0 ? static_cast<int64_t>(c.scalar(1, "dft_length"))
                                                                       : x.dim(static_cast<int>(axis));
  if (length < 1) c.fail("dft_length {} (expected >= 1)", length);
  const int64_t bins = onesided ? length / 2 + 1 : length;
  // The transformed axis last, as matmul's columns, and back.
  std::vector<int64_t> perm;
  for (int d = 0; d < signal_rank; ++d)
    if (d != axis) perm.push_back(d);
  perm.push_back(axis);
  std::vector<int64_t> back(signal_rank);
  for (int d = 0; d < signal_rank; ++d) back[perm[d]] = d;
  const bool moved = axis != signal_rank - 1;
  auto to_last = [&](const Expr& v) { return moved ? transpose(v, perm) : v; };
  auto from_last = [&](const Expr& v) { return moved ? transpose(v, back) : v; };
  std::optional<Expr> im_last;
  if (im) im_last = to_last(*im);
  auto [out_re, out_im] = dft_last_axis(c.b(), to_last(re), im_last, length, bins, inverse);
  return {stack_complex(from_last(out_re), from_last(out_im))};
}

std::vector<Expr> stft(NodeContext& c) {
  Expr signal = c.in(0);
  if (!is_float(signal.dtype())) c.unsupported("needs float inputs, got {}", dtype_name(signal.dtype()));
  if (signal.rank() != 3) c.fail("signal must be (batch, length, 1 or 2), got {}", to_string(signal.type()));
  const bool onesided = c.attr_int("onesided", 1) != 0;
  const int64_t step = static_cast<int64_t>(c.scalar(1, "frame_step"));
  std::optional<Expr> window;
  if (c.has_input(2)) window = cast_to(c.in(2), signal.dtype());
  int64_t frame = 0;
  if (c.has_input(3)) frame = static_cast<int64_t>(c.scalar(3, "frame_length"));
  else if (window) frame = window->dim(0);
  else c.fail("needs a window or a frame_length");
  if (window && (window->rank() != 1 || window->dim(0) != frame))
    c.fail("window {} does not match frame_length {}", to_string(window->type()), frame);
  const int64_t samples = signal.dim(1);
  if (step < 1 || frame < 1 || frame > samples) c.fail("frame_step {} and frame_length {} over {} samples", step, frame, samples);
  const int64_t frames = 1 + (samples - frame) / step;
  auto [re, im] = complex_parts(c, signal);  // (batch, samples)
  if (onesided && im) c.fail("onesided takes a real signal, got a complex one");
  Tensor index(TensorType{DType::kI64, {frames, frame}});
  for (int64_t f = 0; f < frames; ++f)
    for (int64_t j = 0; j < frame; ++j) index.data<int64_t>()[f * frame + j] = f * step + j;
  Expr positions = constant_of(c.b(), index);
  auto framed = [&](const Expr& v) {  // (batch, frames, frame), windowed
    Expr f = gather(v, positions, 1);
    return window ? f * *window : f;
  };
  std::optional<Expr> im_frames;
  if (im) im_frames = framed(*im);
  auto [out_re, out_im] = dft_last_axis(c.b(), framed(re), im_frames, frame, onesided ? frame / 2 + 1 : frame, false);
  return {stack_complex(out_re, out_im)};
}

}  // namespace

void add_signal_rules(RuleTable& r) {
  r["DFT"] = dft;
  r["STFT"] = stft;
  r["HannWindow"] = cosine_window({0.5, -0.5});
  r["HammingWindow"] = cosine_window({25.0 / 46.0, -21.0 / 46.0});
  r["BlackmanWindow"] = cosine_window({0.42, -0.5, 0.08});
  r["MelWeightMatrix"] = mel_weight_matrix;
}

}  // namespace kiln::onnx
