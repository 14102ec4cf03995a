// FP8 matmuls: what `matmul{fp8_a, fp8_b}` computes, stated once for every kernel that runs one
// (the f64 reference, the CPU BLAS kernel, cuBLASLt).
//
// A matmul with fp8_a and fp8_b set ("e4m3" or "e5m2", both or neither, not both e5m2) computes
//   C = (Aq Bq) * (1 / s_a) * (1 / s_b)
// where, for each operand X of format F with largest finite value F_max (e4m3 448, e5m2 57344):
//   amax = max |X| over the whole tensor (f32), s = fp8_scale(amax, F_max) (f32),
//   Xq   = fp8_round(f32(X) * s, F)   (round to nearest even, saturating at +-F_max).
// The products are summed exactly in the reference (f32 or better in the kernels), and C has the
// inputs' dtype (bf16 under --amp fp8). This is per-tensor dynamic ("tensorwise") scaling: the
// scale maps the tensor's largest magnitude onto the format's largest value.
//
// Why an attribute and not an fp8 dtype: the quantized operands live only inside the GEMM that
// reads them (the kernel quantizes into scratch), so no other op, pass or memory plan needs to
// know fp8 exists; the graph stays in bf16, and an fp8 matmul is a matmul that rounds its
// operands harder. E4M3 (more mantissa) serves activations and weights; the incoming gradient of
// the backward's matmuls takes the node's fp8_grad format (MatmulFp8::grad): e4m3 by default, as
// torchao's tensorwise recipe (a per-tensor dynamic scale already gives the range), or E5M2 (more
// range, one mantissa bit less), the older split.
//
// Included by CUDA files: C++17, and fp8_scale is callable on the device.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <string>

#if defined(__CUDACC__)
#define KILN_FP8_HOST_DEVICE __host__ __device__
#else
#define KILN_FP8_HOST_DEVICE
#endif

namespace kiln {

class Attributes;

enum class Fp8Format : unsigned char { kNone, kE4M3, kE5M2 };

// The largest finite value of a format (0 for kNone).
KILN_FP8_HOST_DEVICE inline float fp8_max(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? 448.0f : f == Fp8Format::kE5M2 ? 57344.0f : 0.0f;
}

// The scale that maps amax onto `max`, in f32 arithmetic (every kernel computes it so, to the
// bit): 1 for an all-zero tensor, capped at FLT_MAX for a tiny amax (x * s stays finite and then
// saturates). A NaN amax gives a NaN scale: a NaN operand makes a NaN product, never a number.
KILN_FP8_HOST_DEVICE inline float fp8_scale(float amax, float max) {
  if (amax == 0.0f) return 1.0f;
  const float s = max / amax;
  return s > FLT_MAX ? FLT_MAX : s;
}

// Parses an attribute value: "" (off), "e4m3", "e5m2"; anything else throws kiln::Error naming it.
Fp8Format fp8_format(const std::string& name);
const char* fp8_name(Fp8Format f);  // "", "e4m3", "e5m2"

// x rounded to the format's nearest value (ties to an even mantissa), saturating at +-max; NaN
// stays NaN. Written from the formats' definitions (bias 7 / 15, 3 / 2 mantissa bits, subnormals
// below 2^-6 / 2^-14): the oracle the kernels' hardware conversions are tested against.
double fp8_round(double x, Fp8Format f);

// Quantizes n operand values in place (as X above: amax, scale, round) and returns the inverse
// scale 1 / s (f32), which the product is multiplied by. The host kernels' quantization.
template <class T>
float fp8_quantize(T* values, size_t n, Fp8Format f) {
  float amax = 0.0f;
  bool nan = false;
  for (size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(values[i]);
    nan = nan || std::isnan(x);
    amax = std::fmax(amax, std::fabs(x));
  }
  const float s = fp8_scale(nan ? NAN : amax, fp8_max(f));
  for (size_t i = 0; i < n; ++i)
    values[i] = static_cast<T>(fp8_round(static_cast<float>(values[i]) * s, f));
  return 1.0f / s;
}

// The two operands' formats of a matmul node (kNone, kNone when it is not an fp8 matmul).
// `grad` is the format of the incoming gradient in the node's two gradient products (attribute
// fp8_grad, only on an fp8 matmul): e4m3 unless given, as torchao's tensorwise recipe (with a
// per-tensor dynamic scale the gradient needs e4m3's precision more than e5m2's range).
// `fast_accum` (attribute fp8_fast_accum, only on an fp8 matmul) lets a kernel sum in its fast,
// reduced-precision mode (cuBLASLt's FP8 fast accumulation); the reference sums exactly either way.
// The fp8-linear pass sets it on the forward products only, as torchao: over the backward's long
// sums (dW's k is the token count) it costs loss.
struct MatmulFp8 {
  Fp8Format a = Fp8Format::kNone, b = Fp8Format::kNone, grad = Fp8Format::kNone;
  bool fast_accum = false;
  bool on() const { return a != Fp8Format::kNone; }
};
inline constexpr Fp8Format kFp8GradDefault = Fp8Format::kE4M3;
MatmulFp8 matmul_fp8(const Attributes& attrs);

}  // namespace kiln
