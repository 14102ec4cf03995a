// THE per-element updates of the elementwise optimizers, written once: each rule is a struct
// with its hyperparameters (names, defaults, ranges), its state slots and its update of one
// element, which every kernel that applies it evaluates:
//   the reference kernel of optimizer_update (ops/optimizer.cc)      T = double
//   the CPU fast kernels (backends/cpu/train_kernels.cc, multi_tensor.cc) T = float
//   the CUDA kernels (backends/cuda/generic/generic.cu, nn.cu, multi_tensor.cu)   T = float
// So this header is plain C++17 that g++ and nvcc both compile (host and device functions).
// The registry (ops/optimizer/optimizers.h) makes an optimizer entry of each rule; optimizers
// whose update is not per element (Adafactor's factored moments) are graph builders there.
//
// Adding an elementwise optimizer: its struct below and its line in KILN_OPTIMIZER_RULES, and its
// test against an independent reference (tests/ops/optimizer_rules_test.cc). Everything else
// (the op's verifier, every kernel, the training graph's state, checkpoint names, ZeRO sharding,
// offload, the memory estimate, the CLI flags and the Python class) follows from the entry.
//
// A rule:
//   kName, kHelp; kHyper[]: its hyperparameters, in the order of the values h a rule reads;
//   kSlots, kSlotNames[]: its state, each a tensor like the param, zero at the start
//     (checkpointed as "opt.<slot>.<param>");
//   Constants<T> prepare<T>(h, lr, t): what a step computes once (t >= 1 is this update's
//     number; bias corrections in double, since 1 - 0.999^t loses digits in f32);
//   T apply(c, p, g, s): the new param from param p and gradient g, updating slots s[] in place.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define KILN_RULE_FN __host__ __device__ __forceinline__
#else
#define KILN_RULE_FN inline
#endif

namespace kiln::optim {

// A hyperparameter: the attribute of optimizer_update, the CLI flag (--name, '_' as '-') and the
// Python keyword. A boolean one is 0 or 1; a float one lies in [low, high] (open ends where
// low_open / high_open).
struct HyperSpec {
  const char* name;
  double default_value;
  bool boolean;
  double low, high;
  bool low_open, high_open;
  const char* help;
};
inline constexpr double kUnbounded = 1e308;
inline constexpr int kMaxHyperparameters = 8;
inline constexpr int kMaxSlots = 2;  // the CUDA multi-tensor table's width
// The hyperparameter values a kernel reads, in the rule's kHyper order.
struct HyperValues {
  double v[kMaxHyperparameters];
};

// a * b that the compiler may not fuse into a neighbouring addition: in `a b + c d` a device
// compiler may fuse either product into an FMA, and which one can differ between two kernels
// that evaluate the same rule, so that their states differ in the last bit.
template <class T>
KILN_RULE_FN T unfused_product(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == sizeof(float)) return __fmul_rn(a, b);
  else return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

template <class T>
KILN_RULE_FN T sign_of(T x) {
  return x > T(0) ? T(1) : x < T(0) ? T(-1) : T(0);
}

// torch.optim.SGD with dampening 0: g += weight_decay p; buf = momentum buf + g (a zero buf
// gives torch's first-step buf = g); step = nesterov ? g + momentum buf : (momentum ? buf : g).
struct Sgd {
  static constexpr const char* kName = "sgd";
  static constexpr const char* kHelp = "SGD with momentum and Nesterov momentum (torch.optim.SGD, dampening 0)";
  enum { kMomentum, kNesterov, kWeightDecay, kNumHyper };
  static constexpr HyperSpec kHyper[kNumHyper] = {
      {"momentum", 0.0, false, 0.0, kUnbounded, false, false, "momentum factor"},
      {"nesterov", 0.0, true, 0, 1, false, false, "Nesterov momentum (needs momentum > 0)"},
      {"weight_decay", 0.0, false, 0.0, kUnbounded, false, false, "L2 penalty added to the gradient"},
  };
  static constexpr int kSlots = 1;
  static constexpr const char* kSlotNames[kSlots] = {"buf"};
  template <class T>
  struct Constants {
    T lr, momentum, weight_decay;
    bool nesterov, use_buf;
  };
  template <class T>
  KILN_RULE_FN static Constants<T> prepare(const HyperValues& h, double lr, double) {
    return {T(lr), T(h.v[kMomentum]), T(h.v[kWeightDecay]), h.v[kNesterov] != 0, h.v[kMomentum] > 0};
  }
  template <class T>
  KILN_RULE_FN static T apply(const Constants<T>& c, T p, T g, T* s) {
    g += c.weight_decay * p;
    s[0] = c.momentum * s[0] + g;
    const T step = c.nesterov ? g + c.momentum * s[0] : (c.use_buf ? s[0] : g);
    return p - c.lr * step;
  }
};

// torch.optim.AdamW: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay p) (decoupled decay).
struct Adamw {
  static constexpr const char* kName = "adamw";
  static constexpr const char* kHelp = "Adam with decoupled weight decay (torch.optim.AdamW)";
  enum { kBeta1, kBeta2, kEpsilon, kWeightDecay, kNumHyper };
  static constexpr HyperSpec kHyper[kNumHyper] = {
      {"beta1", 0.9, false, 0.0, 1.0, false, true, "decay of the first moment"},
      {"beta2", 0.999, false, 0.0, 1.0, false, true, "decay of the second moment"},
      {"epsilon", 1e-8, false, 0.0, kUnbounded, true, false, "added to the second moment's root"},
      {"weight_decay", 0.01, false, 0.0, kUnbounded, false, false, "decoupled weight decay"},
  };
  static constexpr int kSlots = 2;
  static constexpr const char* kSlotNames[kSlots] = {"m", "v"};
  template <class T>
  struct Constants {
    T lr, b1, one_minus_b1, b2, one_minus_b2, epsilon, weight_decay, inv_correction1, inv_correction2;
  };
  template <class T>
  KILN_RULE_FN static Constants<T> prepare(const HyperValues& h, double lr, double t) {
    const double b1 = h.v[kBeta1], b2 = h.v[kBeta2];
    return {T(lr),
            T(b1),
            T(1.0 - b1),
            T(b2),
            T(1.0 - b2),
            T(h.v[kEpsilon]),
            T(h.v[kWeightDecay]),
            T(1.0 / (1.0 - std::pow(b1, t))),
            T(1.0 / (1.0 - std::pow(b2, t)))};
  }
  template <class T>
  KILN_RULE_FN static T apply(const Constants<T>& c, T p, T g, T* s) {
    s[0] = c.b1 * s[0] + c.one_minus_b1 * g;
    s[1] = c.b2 * s[1] + c.one_minus_b2 * g * g;
    const T u = (s[0] * c.inv_correction1) / (std::sqrt(s[1] * c.inv_correction2) + c.epsilon) + c.weight_decay * p;
    return p - c.lr * u;
  }
};

// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2):
// u = sign(b1 m + (1 - b1) g); p = p (1 - lr weight_decay) - lr u; m = b2 m + (1 - b2) g.
struct Lion {
  static constexpr const char* kName = "lion";
  static constexpr const char* kHelp = "Lion: the sign of an interpolated momentum (Chen et al. 2023)";
  enum { kBeta1, kBeta2, kWeightDecay, kNumHyper };
  static constexpr HyperSpec kHyper[kNumHyper] = {
      {"beta1", 0.9, false, 0.0, 1.0, false, true, "interpolation of the update's momentum"},
      {"beta2", 0.99, false, 0.0, 1.0, false, true, "decay of the momentum"},
      {"weight_decay", 0.0, false, 0.0, kUnbounded, false, false, "decoupled weight decay"},
  };
  static constexpr int kSlots = 1;
  static constexpr const char* kSlotNames[kSlots] = {"m"};
  template <class T>
  struct Constants {
    T lr, b1, one_minus_b1, b2, one_minus_b2, decay;
  };
  template <class T>
  KILN_RULE_FN static Constants<T> prepare(const HyperValues& h, double lr, double) {
    const double b1 = h.v[kBeta1], b2 = h.v[kBeta2];
    return {T(lr), T(b1), T(1.0 - b1), T(b2), T(1.0 - b2), T(1.0 - lr * h.v[kWeightDecay])};
  }
  template <class T>
  KILN_RULE_FN static T apply(const Constants<T>& c, T p, T g, T* s) {
    const T u = sign_of(c.b1 * s[0] + unfused_product(c.one_minus_b1, g));
    s[0] = c.b2 * s[0] + unfused_product(c.one_minus_b2, g);
    return p * c.decay - c.lr * u;
  }
};

// X(Rule): every elementwise rule.
#define KILN_OPTIMIZER_RULES(X) \
  X(Sgd)                        \
  X(Adamw)                      \
  X(Lion)

// Calls fn(Rule{}) for the rule named `name`; false when none is.
template <class Fn>
bool visit_rule(const char* name, Fn&& fn) {
  auto same = [](const char* a, const char* b) {
    while (*a && *a == *b) ++a, ++b;
    return *a == *b;
  };
#define KILN_VISIT_RULE(Rule)          \
  if (same(name, Rule::kName)) {       \
    static_assert(Rule::kNumHyper <= kMaxHyperparameters && Rule::kSlots <= kMaxSlots, #Rule); \
    fn(Rule{});                        \
    return true;                       \
  }
  KILN_OPTIMIZER_RULES(KILN_VISIT_RULE)
#undef KILN_VISIT_RULE
  return false;
}

}  // namespace kiln::optim
