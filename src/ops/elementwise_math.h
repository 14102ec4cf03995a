// THE math of the elementwise ops, written once: one line per op, a scalar expression that every
// backend evaluates through its own primitive functions (a "math policy" M: M::exp, M::erfc, ...).
//   the reference kernels (ops/elementwise.cc)        double, std:: functions
//   the CPU fast kernels (backends/cpu/elementwise.cc) f32, fast_math.h's vectorizable ones
//   the CUDA generic kernels (backends/cuda/generic.cu) CUDA's functions (device_math.cuh)
//   the generated fused kernels (backends/cuda/codegen.cc) the same, this file's text is
//                                                      embedded in every kernel NVRTC compiles
// So this header is plain C++17 that g++, nvcc and NVRTC all compile: no includes, no std::.
//
// Adding an elementwise op: its line in ir/ops.def (and the op count in ir/op.cc), its line
// below, its gradient rule (ops/elementwise.cc), its tests; a primitive that no policy has yet
// (as erf was for the CPU fast kernels) goes into each policy. Every backend picks the op up
// from here: the reference and CPU fast kernels, the CUDA generic kernels, generated code.
#pragma once

// The lines' functions: inline host functions for g++, device functions for nvcc and NVRTC (no
// .cu file evaluates a line on the host, and a host-device function could not call the
// device-only primitives of DeviceMath).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KILN_MATH_FN __device__ __forceinline__
#else
#define KILN_MATH_FN inline
#endif

// X(Name, arity, domain, expression): Name is the op's (Op::k<Name>); the expression computes in
// the compute type T (double, float; integers in i64) from x (one input) or a, b (two), with
// primitives from M. Domain: kFloat takes float dtypes; kArithmetic floats and integers (integer
// results wrap, division truncates); kCompare any dtype, bool output. Sorted by name.
#define KILN_ELEMENTWISE_OPS(X)                              \
  X(Abs, 1, kArithmetic, M::abs(x))                          \
  X(Acos, 1, kFloat, M::acos(x))                             \
  X(Add, 2, kArithmetic, a + b)                              \
  X(Asin, 1, kFloat, M::asin(x))                             \
  X(Atan, 1, kFloat, M::atan(x))                             \
  X(Cos, 1, kFloat, M::cos(x))                               \
  X(Div, 2, kArithmetic, a / b)                              \
  X(Eq, 2, kCompare, a == b)                                 \
  X(Erf, 1, kFloat, M::erf(x))                               \
  X(Exp, 1, kFloat, M::exp(x))                               \
  X(Fmod, 2, kArithmetic, M::fmod(a, b))                     \
  X(Ge, 2, kCompare, a >= b)                                 \
  X(Gt, 2, kCompare, a > b)                                  \
  X(Le, 2, kCompare, a <= b)                                 \
  X(Log, 1, kFloat, M::log(x))                               \
  X(Lt, 2, kCompare, a < b)                                  \
  X(Maximum, 2, kArithmetic, a > b || a != a ? a : b)        \
  X(Minimum, 2, kArithmetic, a < b || a != a ? a : b)        \
  X(Mod, 2, kArithmetic, floor_mod<M>(a, b))                 \
  X(Mul, 2, kArithmetic, a * b)                              \
  X(Ne, 2, kCompare, a != b)                                 \
  X(Neg, 1, kArithmetic, -x)                                 \
  X(Pow, 2, kFloat, M::pow(a, b))                            \
  X(Reciprocal, 1, kFloat, T(1) / x)                         \
  X(Relu, 1, kArithmetic, x < T(0) ? T(0) : x)               \
  X(Round, 1, kFloat, M::rint(x))                            \
  X(Rsqrt, 1, kFloat, M::rsqrt(x))                           \
  X(Sigmoid, 1, kFloat, T(1) / (T(1) + M::exp(-x)))          \
  X(Silu, 1, kFloat, x / (T(1) + M::exp(-x)))                \
  X(Sin, 1, kFloat, M::sin(x))                               \
  X(Sqrt, 1, kFloat, M::sqrt(x))                             \
  X(Square, 1, kArithmetic, x * x)                           \
  X(StopGradient, 1, kArithmetic, x)                         \
  X(Sub, 2, kArithmetic, a - b)                              \
  X(Tanh, 1, kFloat, M::tanh(x))
// NaN notes: relu is x < 0 rather than max(x, 0) so that NaN propagates; maximum and minimum
// propagate NaN from either operand (a != a: a is NaN), like numpy and torch.
// Remainders: fmod is C's (the sign of a; ONNX Mod fmod=1, torch.fmod), mod is Python's (the
// sign of b; ONNX Mod fmod=0, torch.remainder, numpy.mod). Integers: exact, a zero divisor is a
// data error (as for div). round is to nearest, halves to even (rint in the default rounding
// mode: ONNX Round, torch.round, numpy.round).

// Ops whose attribute picks one of several forms (ops::elementwise_fn says which): gelu and
// gelu_grad(a = x, b = dy) by `approximate`, "none" (erf) or "tanh" (GPT-2's). Each form is
// written where it does not cancel: Phi(x) = erfc(-x / sqrt 2) / 2 has no 1 - (nearly 1) for
// x < 0, and 0.5 x (1 + tanh u) = x sigmoid(2u) has none at large negative u.
#define KILN_ELEMENTWISE_FORMS(X)                                                        \
  X(GeluErf, 1, kFloat, T(0.5) * x * M::erfc(x * T(-0.70710678118654752440)))            \
  X(GeluTanh, 1, kFloat, x / (T(1) + M::exp(T(-2) * gelu_tanh_inner(x))))                \
  X(GeluGradErf, 2, kFloat, b * gelu_erf_derivative<M>(a))                               \
  X(GeluGradTanh, 2, kFloat, b * gelu_tanh_derivative<M>(a))

namespace kiln {
namespace math {

enum class Domain : int { kFloat, kArithmetic, kCompare };

// ---- helpers of the lines above -------------------------------------------------------------

// GPT-2's tanh form: gelu(x) ~ 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3).
template <class T>
KILN_MATH_FN T gelu_tanh_inner(T x) {
  return T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
}

// d gelu / dx, exact form: Phi(x) + x phi(x), phi(x) = e^(-x^2 / 2) / sqrt(2 pi).
template <class M, class T>
KILN_MATH_FN T gelu_erf_derivative(T x) {
  return T(0.5) * M::erfc(x * T(-0.70710678118654752440)) +
         x * (T(0.39894228040143267794) * M::exp(T(-0.5) * x * x));
}

// d gelu / dx, tanh form: 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'(x). Written with
// s = sigmoid(2u) = 0.5 (1 + tanh u) and 1 - tanh^2 u = 4 s (1 - s), both from e = e^(-2|u|)
// <= 1: s (1 - s) = e / (1 + e)^2 never cancels or overflows, where 1 + tanh u and 1 - tanh^2 u
// would lose every digit for large |u|.
template <class M, class T>
KILN_MATH_FN T gelu_tanh_derivative(T x) {
  const T u = gelu_tanh_inner(x);
  const T e = M::exp(T(-2) * M::abs(u));
  const T inv = T(1) / (T(1) + e);
  const T s = M::select(u < T(0), e * inv, inv);
  return s + T(2) * x * (e * inv * inv) * T(0.79788456080286535588) *
                 (T(1) + T(3) * T(0.044715) * x * x);
}

// Python's remainder: C's fmod moved by b where the two signs differ, so the result has b's
// sign (or is 0). Written with T's own operations so that it is exact for integers (the CUDA
// policy's Int) as for floats.
template <class M, class T>
KILN_MATH_FN T floor_mod(T a, T b) {
  const T r = M::fmod(a, b);
  return r != T(0) && (r < T(0)) != (b < T(0)) ? r + b : r;
}

// ---- one functor per line: Name::apply<M>(x) or Name::apply<M>(a, b) ------------------------

// Its facts are constexpr functions rather than static data members, which NVRTC would emit into
// every generated kernel's module as device globals.
#define KILN_MATH_PARAMS_1 T x
#define KILN_MATH_PARAMS_2 T a, T b
#define KILN_MATH_FUNCTOR(Name, Arity, Domain_, expression)                          \
  struct Name {                                                                      \
    static constexpr const char* name() { return #Name; }                            \
    static constexpr int arity() { return Arity; }                                   \
    static constexpr Domain domain() { return Domain::Domain_; }                     \
    template <class M, class T>                                                      \
    static KILN_MATH_FN auto apply(KILN_MATH_PARAMS_##Arity) {                       \
      return expression;                                                             \
    }                                                                                \
  };
KILN_ELEMENTWISE_OPS(KILN_MATH_FUNCTOR)
KILN_ELEMENTWISE_FORMS(KILN_MATH_FUNCTOR)
#undef KILN_MATH_FUNCTOR

// Each line as a run-time value, for the code that picks a line per node.
enum class Fn : int {
#define KILN_MATH_ENUM(Name, arity, domain, expression) k##Name,
  KILN_ELEMENTWISE_OPS(KILN_MATH_ENUM) KILN_ELEMENTWISE_FORMS(KILN_MATH_ENUM)
#undef KILN_MATH_ENUM
};

// Calls visitor(Functor{}) with the functor of `fn`: the one switch over the lines.
template <class Visitor>
decltype(auto) visit(Fn fn, Visitor&& visitor) {
  switch (fn) {
#define KILN_MATH_CASE(Name, arity, domain, expression) \
  case Fn::k##Name:                                     \
    return visitor(Name{});
    KILN_ELEMENTWISE_OPS(KILN_MATH_CASE)
    KILN_ELEMENTWISE_FORMS(KILN_MATH_CASE)
#undef KILN_MATH_CASE
  }
  return visitor(Abs{});  // unreachable: every Fn has its case
}

}  // namespace math
}  // namespace kiln
