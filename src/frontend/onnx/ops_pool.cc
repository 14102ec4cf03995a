// Pooling where kiln's max_pool2d and avg_pool2d do not reach (3-D and higher, dilations,
// MaxPool's Indices output, integer inputs): one strided slice of the padded input per kernel tap, reduced with
// maximum or summed; the Indices are the argmax over the taps mapped back to flat input
// positions. The pool rules in ops_nn.cc call it for those cases (converter.h).
#include <limits>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {

std::vector<Expr> pool_by_taps(Builder& b, const Expr& x_in, const PoolWindow& w, bool is_max, bool include_pad,
                               bool want_indices, bool column_major) {
  const int spatial = x_in.rank() - 2;
  // Max pads with what no element is below: -inf, or an integer dtype's least value.
  double fill = 0.0;
  if (is_max) {
    switch (x_in.dtype()) {
      case DType::kU8: fill = 0; break;
      case DType::kI32: fill = std::numeric_limits<int32_t>::min(); break;
      default: fill = -std::numeric_limits<double>::infinity(); break;
    }
  }
  Expr x = x_in;
  for (int d = 0; d < spatial; ++d) x = pad_axis(b, x, 2 + d, w.pads_begin[d], w.pads_end[d], "constant", scalar_like(x, fill));
  Shape out = x.shape();
  for (int d = 0; d < spatial; ++d) {
    const int64_t extent = (w.kernel[d] - 1) * w.dilations[d] + 1;
    out[2 + d] = (x.dim(2 + d) - extent) / w.strides[d] + 1;
  }
  // Kernel taps in row-major order (the order the first maximum is picked in).
  int64_t taps = 1;
  for (int64_t k : w.kernel) taps *= k;
  auto tap_offsets = [&](int64_t t) {
    std::vector<int64_t> at(spatial);
    for (int d = spatial - 1; d >= 0; --d) {
      at[d] = (t % w.kernel[d]) * w.dilations[d];
      t /= w.kernel[d];
    }
    return at;
  };
  auto tap = [&](const Expr& v, int64_t t) {
    const std::vector<int64_t> at = tap_offsets(t);
    std::vector<int64_t> starts(v.rank(), 0), ends = v.shape(), steps(v.rank(), 1);
    for (int d = 0; d < spatial; ++d) {
      starts[2 + d] = at[d];
      ends[2 + d] = at[d] + (out[2 + d] - 1) * w.strides[d] + 1;
      steps[2 + d] = w.strides[d];
    }
    return slice(v, starts, ends, steps);
  };
  std::vector<Expr> results;
  if (is_max) {
    Expr y = tap(x, 0);
    for (int64_t t = 1; t < taps; ++t) y = maximum(y, tap(x, t));
    results.push_back(y);
  } else {
    // The count of each window: its real elements, and the explicit pads where count_include_pad
    // (never ceil mode's extra ones).
    Expr sum_taps = tap(x, 0);
    for (int64_t t = 1; t < taps; ++t) sum_taps = sum_taps + tap(x, t);
    Shape ones_shape(x_in.rank(), 1);
    for (int d = 0; d < spatial; ++d) ones_shape[2 + d] = x_in.dim(2 + d);
    Expr mask = b.full(ones_shape, 1.0, x_in.dtype());
    for (int d = 0; d < spatial; ++d) {
      const int64_t explicit_end = w.explicit_pads_end[d];
      mask = pad_axis(b, mask, 2 + d, w.pads_begin[d], explicit_end, "constant", scalar_like(mask, include_pad ? 1.0 : 0.0));
      mask = pad_axis(b, mask, 2 + d, 0, w.pads_end[d] - explicit_end, "constant", scalar_like(mask, 0.0));
    }
    Expr counts = tap(mask, 0);
    for (int64_t t = 1; t < taps; ++t) counts = counts + tap(mask, t);
    results.push_back(sum_taps / counts);
  }
  if (want_indices) {
    // argmax over the taps stacked last, then each spatial coordinate: the output position times
    // the stride, minus the pad, plus the tap's offset; flattened over the whole input.
    Shape one = out;
    one.push_back(1);
    std::vector<Expr> stacked;
    for (int64_t t = 0; t < taps; ++t) stacked.push_back(reshape(tap(x, t), one));
    Expr which = argmax(concat(stacked, spatial + 2), -1, false);  // (N, C, out...)
    Expr flat = b.iota(out, 0, DType::kI64) * b.scalar(static_cast<double>(x_in.dim(1)), DType::kI64) +
                b.iota(out, 1, DType::kI64);
    std::vector<Expr> coordinates(spatial);
    for (int d = 0; d < spatial; ++d) {
      Tensor offsets(TensorType{DType::kI64, {taps}});
      for (int64_t t = 0; t < taps; ++t) offsets.data<int64_t>()[t] = tap_offsets(t)[d] - w.pads_begin[d];
      coordinates[d] = b.iota(out, 2 + d, DType::kI64) * b.scalar(static_cast<double>(w.strides[d]), DType::kI64) +
                       gather(constant_of(b, offsets), which, 0);
    }
    // Row-major over the spatial dims, or column-major (storage_order 1): the first spatial dim
    // fastest.
    for (int k = 0; k < spatial; ++k) {
      const int d = column_major ? spatial - 1 - k : k;
      flat = flat * b.scalar(static_cast<double>(x_in.dim(2 + d)), DType::kI64) + coordinates[d];
    }
    results.push_back(flat);
  }
  return results;
}

}  // namespace kiln::onnx
