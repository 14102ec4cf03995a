// Dialect "cpu", reductions in f32: sum, mean and max{axes, keepdims} when the reduced axes are
// a suffix of the dims (the last axis, the last few, or all of them: axes=[] means all). The
// input is then `outer` contiguous rows of `inner` elements and the output is one value per
// row, whatever keepdims says. Also when the reduced axes are a prefix (column reductions: the
// bias and LayerNorm-parameter gradients, a sum over batch and time): one value per column. And
// when they are a prefix and a suffix around kept axes (BatchNorm's per-channel statistics of
// (N, C, H, W) over N, H and W): one value per kept index, each a sum of contiguous rows.
// Reductions over other scattered axes are refused by supports() and served by the reference
// kernel.
//
// Many rows: rows are split across threads. Few long rows (e.g. a sum over everything): each
// row is split across threads and the per-chunk partial results are combined in chunk order.
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/row_ops.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

struct RowShape {
  int64_t outer = 0, inner = 0;
};

// Rows for a reduction over `axes` of `shape`; nullopt when the axes are not a suffix (or are
// out of range, which inference reports).
std::optional<RowShape> suffix_rows(const Shape& shape, const std::vector<int64_t>& axes) {
  const int rank = static_cast<int>(shape.size());
  std::vector<bool> reduced(rank, axes.empty());
  for (int64_t axis : axes) {
    if (axis < -rank || axis >= rank) return std::nullopt;
    reduced[axis < 0 ? axis + rank : axis] = true;
  }
  int first = rank;
  while (first > 0 && reduced[first - 1]) --first;
  for (int d = 0; d < first; ++d)
    if (reduced[d]) return std::nullopt;
  RowShape rows{1, 1};
  for (int d = 0; d < rank; ++d) (d < first ? rows.outer : rows.inner) *= shape[d];
  return rows;
}

// Per axis of `shape`, whether `axes` reduces it; nullopt for no axes or one out of range.
std::optional<std::vector<bool>> reduced_axes(const Shape& shape, const std::vector<int64_t>& axes) {
  const int rank = static_cast<int>(shape.size());
  if (axes.empty()) return std::nullopt;
  std::vector<bool> reduced(rank, false);
  for (int64_t axis : axes) {
    if (axis < -rank || axis >= rank) return std::nullopt;
    reduced[axis < 0 ? axis + rank : axis] = true;
  }
  return reduced;
}

// Rows for a reduction over a proper prefix of the axes (a column reduction): `outer` rows of
// `inner` columns, one result per column. nullopt otherwise (suffix reductions go above).
std::optional<RowShape> prefix_rows(const Shape& shape, const std::vector<int64_t>& axes) {
  const int rank = static_cast<int>(shape.size());
  const std::optional<std::vector<bool>> mask = reduced_axes(shape, axes);
  if (!mask) return std::nullopt;
  const std::vector<bool>& reduced = *mask;
  int last = 0;
  while (last < rank && reduced[last]) ++last;
  if (last == 0 || last == rank) return std::nullopt;
  for (int d = last; d < rank; ++d)
    if (reduced[d]) return std::nullopt;
  RowShape rows{1, 1};
  for (int d = 0; d < rank; ++d) (d < last ? rows.outer : rows.inner) *= shape[d];
  return rows;
}

// A reduction over a non-empty prefix and a non-empty suffix of the axes around a kept block:
// outer (the prefix's elements) x mid (the block's) x inner (the suffix's).
struct BlockShape {
  int64_t outer = 1, mid = 1, inner = 1;
};
std::optional<BlockShape> middle_kept(const Shape& shape, const std::vector<int64_t>& axes) {
  const int rank = static_cast<int>(shape.size());
  const std::optional<std::vector<bool>> mask = reduced_axes(shape, axes);
  if (!mask) return std::nullopt;
  const std::vector<bool>& reduced = *mask;
  int first = 0, last = rank;  // the kept block is [first, last)
  while (first < rank && reduced[first]) ++first;
  while (last > first && reduced[last - 1]) --last;
  if (first == 0 || last == rank || first == last) return std::nullopt;
  for (int d = first; d < last; ++d)
    if (reduced[d]) return std::nullopt;
  BlockShape b;
  for (int d = 0; d < rank; ++d) (d < first ? b.outer : d < last ? b.mid : b.inner) *= shape[d];
  return b;
}

enum class Reduce { kSum, kMean, kMax };

// Column reduction: each thread folds a contiguous chunk of rows into per-column f64 partials
// (rows are read contiguously, so this streams memory); the partials are combined in chunk
// order, so the result does not depend on scheduling (only on the thread count).
void column_reduce_kernel(Reduce kind, const RowShape& rows, const float* x, float* out) {
  const int64_t chunks = std::min<int64_t>(
      num_chunks(rows.outer * rows.inner, kGrainCheap), std::max<int64_t>(1, rows.outer));
  const size_t width = static_cast<size_t>(rows.inner);
  std::vector<double> partial(static_cast<size_t>(chunks) * width);
  parallel_chunks(0, rows.outer, chunks, [&](int64_t c, int64_t lo, int64_t hi) {
    double* acc = partial.data() + static_cast<size_t>(c) * width;
    for (size_t j = 0; j < width; ++j)
      acc[j] = kind == Reduce::kMax ? -std::numeric_limits<double>::infinity() : 0.0;
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = x + r * rows.inner;
      if (kind == Reduce::kMax) {
        // std::max would drop a NaN; the reference propagates it.
        for (size_t j = 0; j < width; ++j)
          acc[j] = (row[j] > acc[j] || std::isnan(row[j])) ? row[j] : acc[j];
      } else {
        for (size_t j = 0; j < width; ++j) acc[j] += row[j];
      }
    }
  });
  const double scale = kind == Reduce::kMean ? 1.0 / static_cast<double>(rows.outer) : 1.0;
  for (size_t j = 0; j < width; ++j) {
    double result = partial[j];
    for (int64_t c = 1; c < chunks; ++c) {
      const double p = partial[static_cast<size_t>(c) * width + j];
      result = kind != Reduce::kMax ? result + p : (p > result || std::isnan(p)) ? p : result;
    }
    out[j] = static_cast<float>(result * scale);
  }
}

// Reduction of part of a row: the sum (kSum, kMean) or the max (kMax), as a double.
double reduce_part(Reduce kind, const float* x, int64_t n) {
  return kind == Reduce::kMax ? static_cast<double>(max_row(x, n)) : sum_row(x, n);
}

// Middle-kept reduction: per kept index m, its `outer` contiguous rows of `inner` elements, each
// reduced as a row and combined in row order (threads split the kept indices, so the result
// does not depend on scheduling).
void middle_reduce_kernel(Reduce kind, const BlockShape& b, const float* x, float* out) {
  const double scale = kind == Reduce::kMean ? 1.0 / static_cast<double>(b.outer * b.inner) : 1.0;
  parallel_for(0, b.mid, std::max<int64_t>(1, kGrainCheap / std::max<int64_t>(1, b.outer * b.inner)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t m = lo; m < hi; ++m) {
                   double result = kind == Reduce::kMax ? -std::numeric_limits<double>::infinity() : 0.0;
                   for (int64_t o = 0; o < b.outer; ++o) {
                     const double p = reduce_part(kind, x + (o * b.mid + m) * b.inner, b.inner);
                     // std::max would drop a NaN; the reference propagates it.
                     result = kind != Reduce::kMax ? result + p : (p > result || std::isnan(p)) ? p : result;
                   }
                   out[m] = static_cast<float>(result * scale);
                 }
               });
}

void reduce_kernel(Reduce kind, const KernelArgs& args) {
  const Tensor& in = args.inputs[0];
  const float* x = in.data<float>();
  float* out = args.outputs[0].data<float>();
  const std::vector<int64_t>& axes = args.attrs.ints("axes");
  const std::optional<RowShape> suffix = suffix_rows(in.shape(), axes);
  if (!suffix) {
    if (const std::optional<BlockShape> block = middle_kept(in.shape(), axes))
      return middle_reduce_kernel(kind, *block, x, out);
    return column_reduce_kernel(kind, *prefix_rows(in.shape(), axes), x, out);
  }
  const RowShape rows = *suffix;
  const double scale = kind == Reduce::kMean ? 1.0 / static_cast<double>(rows.inner) : 1.0;
  const int64_t threads = max_threads();
  if (rows.outer >= threads || rows.inner < 2 * kGrainCheap) {
    parallel_for(0, rows.outer, std::max<int64_t>(1, kGrainCheap / rows.inner),
                 [&](int64_t lo, int64_t hi) {
                   for (int64_t r = lo; r < hi; ++r)
                     out[r] = static_cast<float>(
                         reduce_part(kind, x + r * rows.inner, rows.inner) * scale);
                 });
    return;
  }
  for (int64_t r = 0; r < rows.outer; ++r) {
    const float* row = x + r * rows.inner;
    const int64_t chunks = num_chunks(rows.inner, kGrainCheap);
    std::vector<double> partial(static_cast<size_t>(chunks));
    parallel_chunks(0, rows.inner, chunks, [&](int64_t c, int64_t lo, int64_t hi) {
      partial[static_cast<size_t>(c)] = reduce_part(kind, row + lo, hi - lo);
    });
    double result = partial[0];
    for (size_t c = 1; c < partial.size(); ++c)
      result = kind == Reduce::kMax ? std::max(result, partial[c]) : result + partial[c];
    out[r] = static_cast<float>(result * scale);
  }
}

bool reduce_supported(const NodeView& node) {
  if (!all_dtype(node, DType::kF32) || node.input_types.size() != 1) return false;
  const Shape& shape = node.input_types[0].shape;
  // Empty inputs (mean of nothing, max of nothing) are the reference's to define.
  const std::vector<int64_t>& axes = node.node.attrs.ints("axes");
  return numel(shape) > 0 && (suffix_rows(shape, axes).has_value() || prefix_rows(shape, axes).has_value() ||
                              middle_kept(shape, axes).has_value());
}

void add_reduction(KernelRegistry& registry, Op op, Reduce kind) {
  registry.add(op, KernelImpl{"cpu", Device::kCpu, kFastPriority, reduce_supported,
                              [kind](const KernelArgs& args) { reduce_kernel(kind, args); }});
}

}  // namespace

void register_reduction_kernels(KernelRegistry& registry) {
  add_reduction(registry, Op::kSum, Reduce::kSum);
  add_reduction(registry, Op::kMean, Reduce::kMean);
  add_reduction(registry, Op::kMax, Reduce::kMax);
}

}  // namespace kiln::cpu
