// ONNX rules that pick or place elements by position: ReverseSequence (each batch entry's first
// sequence_lens[b] steps reversed, positions computed in the graph so the lengths may be data)
// and Compress (the positions where a condition known at import holds) are gathers, whose
// gradient is scatter_add; MaxUnpool (values placed at MaxPool's flat indices, which may be data)
// is a scatter_add into zeros, whose gradient is a gather.
#include <algorithm>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

using Ints = std::vector<int64_t>;

std::vector<Expr> reverse_sequence(NodeContext& c) {
  Expr x = c.in(0);
  const int64_t batch_axis = c.attr_int("batch_axis", 1), time_axis = c.attr_int("time_axis", 0);
  if (x.rank() < 2) c.fail("needs rank >= 2, got {}", to_string(x.type()));
  if (!((batch_axis == 0 && time_axis == 1) || (batch_axis == 1 && time_axis == 0)))
    c.fail("batch_axis {} and time_axis {}: expected 0 and 1 in some order", batch_axis, time_axis);
  Expr lengths = cast_to(c.in(1), DType::kI64);
  const int64_t batch = x.dim(static_cast<int>(batch_axis)), steps = x.dim(static_cast<int>(time_axis));
  if (lengths.shape() != Shape{batch}) c.fail("sequence_lens is {}, expected ({},)", to_string(lengths.type()), batch);
  Builder& b = c.b();
  // (B, T, ...) rows flattened to (B * T, ...); row b * T + source(b, t) for each (b, t), where
  // source is len - 1 - t inside the sequence and t past its end. Lengths past T clamp to T, as
  // the positions must stay inside the row.
  Ints perm(x.rank());
  for (int d = 0; d < x.rank(); ++d) perm[d] = d;
  if (time_axis == 0) std::swap(perm[0], perm[1]);
  Expr rows = time_axis == 0 ? transpose(x, perm) : x;
  Shape flat = rows.shape();
  flat.erase(flat.begin());
  flat[0] = batch * steps;
  Expr len = reshape(minimum(lengths, b.scalar(static_cast<double>(steps), DType::kI64)), {batch, 1});
  Expr t = b.iota({batch, steps}, 1, DType::kI64);
  Expr source = where(lt(t, len), len - b.scalar(1, DType::kI64) - t, t);
  Expr index = b.iota({batch, steps}, 0, DType::kI64) * b.scalar(static_cast<double>(steps), DType::kI64) + source;
  Expr y = gather(reshape(rows, flat), index, 0);
  return {time_axis == 0 ? transpose(y, perm) : y};
}

std::vector<Expr> compress(NodeContext& c) {
  Expr x = c.in(0);
  const Tensor condition = c.constant(1, "condition");
  if (condition.rank() != 1) c.fail("condition must be 1-D, got {}", to_string(condition.type()));
  int64_t axis = -1;
  if (c.has_attr("axis")) {
    axis = c.attr_int("axis", 0);
    if (axis < -x.rank() || axis >= x.rank()) c.fail("axis {} is out of range for rank {}", axis, x.rank());
    if (axis < 0) axis += x.rank();
  } else {  // no axis: the flattened input
    x = reshape(x, {x.type().numel()});
    axis = 0;
  }
  const int64_t dim = x.dim(static_cast<int>(axis));
  if (condition.numel() > dim) c.fail("condition has {} entries for a dim of {}", condition.numel(), dim);
  Ints index;
  for (int64_t i = 0; i < condition.numel(); ++i)
    if (condition.get(i) != 0) index.push_back(i);
  if (index.empty()) c.unsupported("a condition that selects nothing (an empty output)");
  Tensor t(TensorType{DType::kI64, {static_cast<int64_t>(index.size())}});
  std::copy(index.begin(), index.end(), t.data<int64_t>());
  return {gather(x, constant_of(c.b(), t), axis)};
}

std::vector<Expr> max_unpool(NodeContext& c) {
  Expr x = c.in(0), indices = cast_to(c.in(1), DType::kI64);
  if (x.rank() < 3) c.fail("needs (N, C, D1, ...), got {}", to_string(x.type()));
  if (indices.shape() != x.shape()) c.fail("indices {} differ from X {} in shape", to_string(indices.type()), to_string(x.type()));
  const size_t spatial = static_cast<size_t>(x.rank() - 2);
  const Ints kernel = c.attr_ints("kernel_shape");
  const Ints strides = c.attr_ints("strides", Ints(spatial, 1));
  const Ints pads = c.attr_ints("pads", Ints(2 * spatial, 0));
  if (kernel.size() != spatial || strides.size() != spatial || pads.size() != 2 * spatial)
    c.fail("kernel_shape, strides or pads do not match {} spatial dims", spatial);
  Shape out = x.shape();
  for (size_t d = 0; d < spatial; ++d)
    out[2 + d] = (x.dim(static_cast<int>(2 + d)) - 1) * strides[d] + kernel[d] - pads[d] - pads[spatial + d];
  // The indices are flat positions in the whole output of that shape (batch and channel
  // included).
  Expr flat = scatter_add(c.b().full({numel(out)}, 0.0, x.dtype()), reshape(indices, {x.type().numel()}),
                          reshape(x, {x.type().numel()}), 0);
  Expr y = reshape(flat, out);
  if (c.has_input(2)) {
    // A larger output (what MaxPool's input was): pads generated around the unpooled values,
    // the odd one at the end (as SAME_UPPER places it).
    const Ints given = c.ints(2, "output_shape");
    if (given.size() != out.size() || given[0] != out[0] || given[1] != out[1])
      c.fail("output_shape {} does not fit X {}", to_string(given), to_string(x.type()));
    for (size_t d = 0; d < spatial; ++d) {
      if (given[2 + d] < out[2 + d]) c.fail("output_shape {} is smaller than the unpooled {}", to_string(given), to_string(out));
      const int64_t total = given[2 + d] - out[2 + d];
      y = pad_axis(c.b(), y, static_cast<int64_t>(2 + d), total / 2, total - total / 2, "constant", scalar_like(y, 0.0));
    }
  }
  return {y};
}

}  // namespace

void add_indexing_rules(RuleTable& r) {
  r["MaxUnpool"] = max_unpool;
  r["ReverseSequence"] = reverse_sequence;
  r["Compress"] = compress;
}

}  // namespace kiln::onnx
