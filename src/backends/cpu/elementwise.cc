// Dialect "cpu", elementwise ops in f32: every op that is a line of ops/elementwise_math.h
// (unary, binary, gelu and gelu_grad's forms; comparisons of f32 operands into bool outputs),
// the line evaluated through FastMath (fast_math.h).
//
// Binary ops handle the layouts that cover nearly every use in a model, each as a flat loop:
//   same shape (up to leading 1s)           a[i] op b[i]
//   one operand a scalar (numel 1)          a[i] op s, s op b[i]
//   one operand the trailing dims of the    (B, T, C) op (C,), (B, T, C) op (T, C), either side:
//   output (a "row" broadcast)              a[r*C + j] op b[j]
//   one operand a block of the output's     (N, C, H, W) op (1, C, 1, 1), (B, T, C) op (B, T, 1),
//   dims, 1 elsewhere (a per-channel or     either side: runs of H * W (or 1) elements against
//   column broadcast)                       one element, a[(n*C + c)*HW + i] op b[c]
// Any other broadcast (e.g. (B, 1, C) against (B, T, C)) is refused by supports() and served by
// the reference kernel.
//
// The loops are templates over the line, so its expression is inlined into a plain contiguous
// loop over __restrict__ pointers that g++ vectorizes (the transcendental primitives through
// fast_math.h, which has no calls; log and pow stay scalar libm calls).
#include <cmath>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/fast_math.h"
#include "ir/op_def.h"
#include "ops/elementwise.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

// ---- Unary ----------------------------------------------------------------------------------

template <typename F>
void unary_loop(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::template apply<FastMath>(in[i]);
}

template <typename F>
void unary_kernel(const KernelArgs& args) {
  // Float-only lines are transcendental or a division: worth splitting across threads sooner.
  constexpr int64_t grain = F::domain() == math::Domain::kFloat ? kGrainExpensive : kGrainCheap;
  const float* in = args.inputs[0].data<float>();
  float* out = args.outputs[0].data<float>();
  parallel_for(0, args.outputs[0].numel(), grain,
               [&](int64_t lo, int64_t hi) { unary_loop<F>(in + lo, out + lo, hi - lo); });
}

// ---- Binary ---------------------------------------------------------------------------------

enum class BinaryLayout { kSame, kScalarA, kScalarB, kRowA, kRowB, kBlockA, kBlockB, kUnsupported };

struct BinaryPlan {
  BinaryLayout layout = BinaryLayout::kUnsupported;
  int64_t row = 0;    // kRowA/kRowB: elements of the row operand; kBlock*: the operand's
  int64_t inner = 0;  // kBlock*: output elements per operand element in a run
};

// True when `small`, without its leading 1s, equals the trailing dims of `out`.
bool is_trailing_of(const Shape& small, const Shape& out) {
  size_t first = 0;
  while (first < small.size() && small[first] == 1) ++first;
  const size_t len = small.size() - first;
  if (len > out.size()) return false;
  return std::equal(small.begin() + static_cast<std::ptrdiff_t>(first), small.end(),
                    out.end() - static_cast<std::ptrdiff_t>(len));
}

// When `small` is 1 except on one contiguous block of dims where it equals `out` (a
// per-channel (1, C, 1, 1) against (N, C, H, W)), the output elements per small element in a
// run: out is (outer, numel(small), inner) and small is indexed by the middle index alone.
// 0 otherwise.
int64_t inner_of_block(const Shape& small, const Shape& out) {
  if (small.size() > out.size()) return 0;
  const size_t offset = out.size() - small.size();
  size_t first = small.size(), last = 0;  // the dims of small that are not 1: [first, last)
  for (size_t d = 0; d < small.size(); ++d)
    if (small[d] != 1) {
      first = std::min(first, d);
      last = d + 1;
    }
  if (first >= last) return 0;
  for (size_t d = first; d < last; ++d)
    if (small[d] != out[offset + d]) return 0;
  int64_t inner = 1;
  for (size_t d = offset + last; d < out.size(); ++d) inner *= out[d];
  return inner;
}

BinaryPlan plan_binary(const Shape& a, const Shape& b, const Shape& out) {
  const int64_t n = numel(out), na = numel(a), nb = numel(b);
  // An operand with as many elements as the output and broadcasting to it has its layout.
  if (na == n && nb == n) return {BinaryLayout::kSame, 0};
  if (na == n && nb == 1) return {BinaryLayout::kScalarB, 0};
  if (nb == n && na == 1) return {BinaryLayout::kScalarA, 0};
  if (na == n && is_trailing_of(b, out)) return {BinaryLayout::kRowB, nb};
  if (nb == n && is_trailing_of(a, out)) return {BinaryLayout::kRowA, na};
  if (na == n)
    if (const int64_t inner = inner_of_block(b, out)) return {BinaryLayout::kBlockB, nb, inner};
  if (nb == n)
    if (const int64_t inner = inner_of_block(a, out)) return {BinaryLayout::kBlockA, na, inner};
  return {};
}

// Out is float, or bool for comparisons.
template <typename F, typename Out>
void binary_same_loop(const float* __restrict__ a, const float* __restrict__ b,
                      Out* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::template apply<FastMath>(a[i], b[i]);
}

template <typename F, typename Out>
void binary_scalar_b_loop(const float* __restrict__ a, float b, Out* __restrict__ out,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::template apply<FastMath>(a[i], b);
}

template <typename F, typename Out>
void binary_scalar_a_loop(float a, const float* __restrict__ b, Out* __restrict__ out,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::template apply<FastMath>(a, b[i]);
}

template <typename F, typename Out>
void binary_kernel(const KernelArgs& args) {
  const Tensor& ta = args.inputs[0];
  const Tensor& tb = args.inputs[1];
  Tensor& tout = args.outputs[0];
  const BinaryPlan plan = plan_binary(ta.shape(), tb.shape(), tout.shape());
  const float* a = ta.data<float>();
  const float* b = tb.data<float>();
  Out* out = tout.data<Out>();
  const int64_t n = tout.numel();
  switch (plan.layout) {
    case BinaryLayout::kSame:
      parallel_for(0, n, kGrainCheap, [&](int64_t lo, int64_t hi) {
        binary_same_loop<F>(a + lo, b + lo, out + lo, hi - lo);
      });
      return;
    case BinaryLayout::kScalarB:
      parallel_for(0, n, kGrainCheap, [&](int64_t lo, int64_t hi) {
        binary_scalar_b_loop<F>(a + lo, b[0], out + lo, hi - lo);
      });
      return;
    case BinaryLayout::kScalarA:
      parallel_for(0, n, kGrainCheap, [&](int64_t lo, int64_t hi) {
        binary_scalar_a_loop<F>(a[0], b + lo, out + lo, hi - lo);
      });
      return;
    case BinaryLayout::kRowB:
    case BinaryLayout::kRowA: {
      const int64_t row = plan.row, rows = n / row;
      const bool row_is_b = plan.layout == BinaryLayout::kRowB;
      parallel_for(0, rows, std::max<int64_t>(1, kGrainCheap / row), [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          if (row_is_b)
            binary_same_loop<F>(a + r * row, b, out + r * row, row);
          else
            binary_same_loop<F>(a, b + r * row, out + r * row, row);
        }
      });
      return;
    }
    case BinaryLayout::kBlockB:
    case BinaryLayout::kBlockA: {
      // Runs of `inner` elements, each against one element of the block operand.
      const int64_t inner = plan.inner, runs = n / inner, block = plan.row;
      const bool block_is_b = plan.layout == BinaryLayout::kBlockB;
      parallel_for(0, runs, std::max<int64_t>(1, kGrainCheap / inner), [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          const int64_t at = r * inner;
          if (block_is_b)
            binary_scalar_b_loop<F>(a + at, b[r % block], out + at, inner);
          else
            binary_scalar_a_loop<F>(a[r % block], b + at, out + at, inner);
        }
      });
      return;
    }
    case BinaryLayout::kUnsupported:
      break;
  }
  fail("cpu binary kernel: layout {} and {} -> {} is not supported (supports() should refuse it)",
       to_string(ta.shape()), to_string(tb.shape()), to_string(tout.shape()));
}

// f32 operands (a bool output for comparisons, f32 otherwise) in a layout above.
bool binary_supported(const NodeView& node, bool compare) {
  if (node.input_types.size() != 2 || node.input_types[0].dtype != DType::kF32 ||
      node.input_types[1].dtype != DType::kF32 ||
      node.output_types[0].dtype != (compare ? DType::kBool : DType::kF32))
    return false;
  return plan_binary(node.input_types[0].shape, node.input_types[1].shape,
                     node.output_types[0].shape)
             .layout != BinaryLayout::kUnsupported;
}

bool f32_supported(const NodeView& node) { return all_dtype(node, DType::kF32); }

// Runs the line of the node (ops::elementwise_fn picks gelu's form).
void line_kernel(Op op, const KernelArgs& args) {
  math::visit(*ops::elementwise_fn(op, args.attrs), [&](auto line) {
    using F = decltype(line);
    if constexpr (F::domain() == math::Domain::kCompare) {
      binary_kernel<F, bool>(args);
    } else if constexpr (F::arity() == 1) {
      unary_kernel<F>(args);
    } else {
      binary_kernel<F, float>(args);
    }
  });
}

}  // namespace

void register_elementwise_kernels(KernelRegistry& registry) {
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (!ops::is_math_op(op)) continue;
    // Comparisons of f32 operands write bool outputs (a ReLU6's or a max's gradient masks).
    bool compare = false;
    math::visit(*ops::elementwise_fn(op, normalize_attributes(op, {})),
                [&](auto line) { compare = decltype(line)::domain() == math::Domain::kCompare; });
    std::function<bool(const NodeView&)> supports = f32_supported;
    if (op_info(op).min_inputs != 1)
      supports = [compare](const NodeView& node) { return binary_supported(node, compare); };
    registry.add(op, KernelImpl{"cpu", Device::kCpu, kFastPriority, std::move(supports),
                                [op](const KernelArgs& args) { line_kernel(op, args); }});
  }
}

}  // namespace kiln::cpu
