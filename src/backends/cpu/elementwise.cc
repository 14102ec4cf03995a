// Dialect "cpu", elementwise ops in f32: the unary math ops and the binary arithmetic ops.
//
// Binary ops handle the layouts that cover nearly every use in a model, each as a flat loop:
//   same shape (up to leading 1s)           a[i] op b[i]
//   one operand a scalar (numel 1)          a[i] op s, s op b[i]
//   one operand the trailing dims of the    (B, T, C) op (C,), (B, T, C) op (T, C), either side:
//   output (a "row" broadcast)              a[r*C + j] op b[j]
// Any other broadcast (e.g. a column (B, T, 1)) is refused by supports() and served by the
// reference kernel.
//
// Each op is a struct with a static apply(); the loops are templates over it, so the op is
// inlined into a plain contiguous loop over __restrict__ pointers that g++ vectorizes (the
// transcendental ones through fast_math.h, which has no calls).
#include <cmath>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/fast_math.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

// ---- Unary ----------------------------------------------------------------------------------

struct ExpOp { static float apply(float x) { return exp_f32(x); } };
struct LogOp { static float apply(float x) { return std::log(x); } };
struct TanhOp { static float apply(float x) { return tanh_f32(x); } };
struct SigmoidOp { static float apply(float x) { return sigmoid_f32(x); } };
struct ReluOp { static float apply(float x) { return x > 0.0f ? x : 0.0f; } };
struct GeluErfOp { static float apply(float x) { return gelu_erf_f32(x); } };
struct GeluTanhOp { static float apply(float x) { return gelu_tanh_f32(x); } };
struct SiluOp { static float apply(float x) { return silu_f32(x); } };
struct NegOp { static float apply(float x) { return -x; } };
struct AbsOp { static float apply(float x) { return std::abs(x); } };
struct SqrtOp { static float apply(float x) { return std::sqrt(x); } };
struct RsqrtOp { static float apply(float x) { return 1.0f / std::sqrt(x); } };
struct ReciprocalOp { static float apply(float x) { return 1.0f / x; } };
struct SquareOp { static float apply(float x) { return x * x; } };

template <typename F>
void unary_loop(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::apply(in[i]);
}

template <typename F>
void unary_kernel(const KernelArgs& args, int64_t grain) {
  const float* in = args.inputs[0].data<float>();
  float* out = args.outputs[0].data<float>();
  parallel_for(0, args.outputs[0].numel(), grain,
               [&](int64_t lo, int64_t hi) { unary_loop<F>(in + lo, out + lo, hi - lo); });
}

// ---- Binary ---------------------------------------------------------------------------------

struct AddOp { static float apply(float a, float b) { return a + b; } };
struct SubOp { static float apply(float a, float b) { return a - b; } };
struct MulOp { static float apply(float a, float b) { return a * b; } };
struct DivOp { static float apply(float a, float b) { return a / b; } };
// NaN in either operand gives NaN, like the reference (a != a: a is NaN).
struct MaximumOp { static float apply(float a, float b) { return a > b || a != a ? a : b; } };
struct MinimumOp { static float apply(float a, float b) { return a < b || a != a ? a : b; } };

enum class BinaryLayout { kSame, kScalarA, kScalarB, kRowA, kRowB, kUnsupported };

struct BinaryPlan {
  BinaryLayout layout = BinaryLayout::kUnsupported;
  int64_t row = 0;  // for kRowA/kRowB: elements of the row operand
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

BinaryPlan plan_binary(const Shape& a, const Shape& b, const Shape& out) {
  const int64_t n = numel(out), na = numel(a), nb = numel(b);
  // An operand with as many elements as the output and broadcasting to it has its layout.
  if (na == n && nb == n) return {BinaryLayout::kSame, 0};
  if (na == n && nb == 1) return {BinaryLayout::kScalarB, 0};
  if (nb == n && na == 1) return {BinaryLayout::kScalarA, 0};
  if (na == n && is_trailing_of(b, out)) return {BinaryLayout::kRowB, nb};
  if (nb == n && is_trailing_of(a, out)) return {BinaryLayout::kRowA, na};
  return {};
}

template <typename F>
void binary_same_loop(const float* __restrict__ a, const float* __restrict__ b,
                      float* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::apply(a[i], b[i]);
}

template <typename F>
void binary_scalar_b_loop(const float* __restrict__ a, float b, float* __restrict__ out,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::apply(a[i], b);
}

template <typename F>
void binary_scalar_a_loop(float a, const float* __restrict__ b, float* __restrict__ out,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::apply(a, b[i]);
}

template <typename F>
void binary_kernel(const KernelArgs& args) {
  const Tensor& ta = args.inputs[0];
  const Tensor& tb = args.inputs[1];
  Tensor& tout = args.outputs[0];
  const BinaryPlan plan = plan_binary(ta.shape(), tb.shape(), tout.shape());
  const float* a = ta.data<float>();
  const float* b = tb.data<float>();
  float* out = tout.data<float>();
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
    case BinaryLayout::kUnsupported:
      break;
  }
  fail("cpu binary kernel: layout {} and {} -> {} is not supported (supports() should refuse it)",
       to_string(ta.shape()), to_string(tb.shape()), to_string(tout.shape()));
}

bool binary_supported(const NodeView& node) {
  return all_dtype(node, DType::kF32) && node.input_types.size() == 2 &&
         plan_binary(node.input_types[0].shape, node.input_types[1].shape,
                     node.output_types[0].shape)
                 .layout != BinaryLayout::kUnsupported;
}

bool f32_supported(const NodeView& node) { return all_dtype(node, DType::kF32); }

void add_unary(KernelRegistry& registry, Op op, KernelFn kernel) {
  registry.add(op, KernelImpl{"cpu", Device::kCpu, kFastPriority, f32_supported, std::move(kernel)});
}

template <typename F>
void add_binary(KernelRegistry& registry, Op op) {
  registry.add(op, KernelImpl{"cpu", Device::kCpu, kFastPriority, binary_supported,
                              binary_kernel<F>});
}

}  // namespace

void register_elementwise_kernels(KernelRegistry& registry) {
  add_unary(registry, Op::kExp, [](const KernelArgs& a) { unary_kernel<ExpOp>(a, kGrainExpensive); });
  add_unary(registry, Op::kLog, [](const KernelArgs& a) { unary_kernel<LogOp>(a, kGrainExpensive); });
  add_unary(registry, Op::kTanh, [](const KernelArgs& a) { unary_kernel<TanhOp>(a, kGrainExpensive); });
  add_unary(registry, Op::kSigmoid,
            [](const KernelArgs& a) { unary_kernel<SigmoidOp>(a, kGrainExpensive); });
  add_unary(registry, Op::kRelu, [](const KernelArgs& a) { unary_kernel<ReluOp>(a, kGrainCheap); });
  add_unary(registry, Op::kGelu, [](const KernelArgs& a) {
    if (a.attrs.s("approximate") == "tanh")
      unary_kernel<GeluTanhOp>(a, kGrainExpensive);
    else
      unary_kernel<GeluErfOp>(a, kGrainExpensive);
  });
  add_unary(registry, Op::kSilu, [](const KernelArgs& a) { unary_kernel<SiluOp>(a, kGrainExpensive); });
  add_unary(registry, Op::kNeg, [](const KernelArgs& a) { unary_kernel<NegOp>(a, kGrainCheap); });
  add_unary(registry, Op::kAbs, [](const KernelArgs& a) { unary_kernel<AbsOp>(a, kGrainCheap); });
  add_unary(registry, Op::kSqrt, [](const KernelArgs& a) { unary_kernel<SqrtOp>(a, kGrainCheap); });
  add_unary(registry, Op::kRsqrt, [](const KernelArgs& a) { unary_kernel<RsqrtOp>(a, kGrainCheap); });
  add_unary(registry, Op::kReciprocal,
            [](const KernelArgs& a) { unary_kernel<ReciprocalOp>(a, kGrainCheap); });
  add_unary(registry, Op::kSquare, [](const KernelArgs& a) { unary_kernel<SquareOp>(a, kGrainCheap); });

  add_binary<AddOp>(registry, Op::kAdd);
  add_binary<SubOp>(registry, Op::kSub);
  add_binary<MulOp>(registry, Op::kMul);
  add_binary<DivOp>(registry, Op::kDiv);
  add_binary<MaximumOp>(registry, Op::kMaximum);
  add_binary<MinimumOp>(registry, Op::kMinimum);
}

}  // namespace kiln::cpu
