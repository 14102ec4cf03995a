#include "ops/fp8.h"

#include <algorithm>
#include <cmath>

#include "ir/attribute.h"
#include "support/error.h"

namespace kiln {

Fp8Format fp8_format(const std::string& name) {
  if (name.empty()) return Fp8Format::kNone;
  if (name == "e4m3") return Fp8Format::kE4M3;
  if (name == "e5m2") return Fp8Format::kE5M2;
  fail("fp8 format '{}' is not known, expected e4m3 or e5m2 (or empty: no fp8)", name);
}

const char* fp8_name(Fp8Format f) {
  switch (f) {
    case Fp8Format::kNone: return "";
    case Fp8Format::kE4M3: return "e4m3";
    case Fp8Format::kE5M2: return "e5m2";
  }
  return "?";
}

double fp8_round(double x, Fp8Format f) {
  KILN_CHECK(f != Fp8Format::kNone, "fp8_round: no format given");
  if (std::isnan(x)) return x;
  const int mantissa_bits = f == Fp8Format::kE4M3 ? 3 : 2;
  const int min_exponent = f == Fp8Format::kE4M3 ? -6 : -14;  // of the smallest normal, 1 - bias
  const double max = fp8_max(f);
  const double a = std::fabs(x);
  if (a >= max) return std::copysign(max, x);
  if (a == 0.0) return x;
  int e = 0;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): the leading bit is 2^(e-1)
  const int exponent = std::max(e - 1, min_exponent);  // subnormals share the smallest quantum
  const double quantum = std::ldexp(1.0, exponent - mantissa_bits);
  // a / quantum is exact (a power of two); nearbyint rounds half to even in the default mode.
  const double r = std::nearbyint(a / quantum) * quantum;
  return std::copysign(std::min(r, max), x);
}

MatmulFp8 matmul_fp8(const Attributes& attrs) {
  MatmulFp8 m;
  if (attrs.has("fp8_a")) m.a = fp8_format(attrs.s("fp8_a"));
  if (attrs.has("fp8_b")) m.b = fp8_format(attrs.s("fp8_b"));
  if (attrs.has("fp8_grad")) m.grad = fp8_format(attrs.s("fp8_grad"));
  else if (m.on()) m.grad = kFp8GradDefault;
  m.fast_accum = attrs.has("fp8_fast_accum") && attrs.b("fp8_fast_accum");
  return m;
}

}  // namespace kiln
