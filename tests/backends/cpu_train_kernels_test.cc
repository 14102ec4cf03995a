// The training-step fast kernels (src/backends/cpu/train_kernels.cc) against the reference
// kernels: adamw_update, sgd_update, reshape, transpose ("cpu") and attention,
// attention_grad, attention_qkv, attention_qkv_grad ("openblas"). Random inputs (never zeros),
// odd sizes, sizes that parallel_for splits, a few hand-checked values, and the cases supports()
// refuses.
//
// Tolerances (f32 kernels against the f64 reference rounded to f32):
//   reshape, transpose: exact (they copy).
//   sgd_update, adamw_update: a few f32 roundings per element: rtol 1e-6, atol 1e-7 where
//     m' = b1 m + (1-b1) g may cancel to near 0, and 1e-6 with a large lr, where
//     p' = p - lr * step (|p| <= 2, |lr * step| ~ 1) may cancel: a few ulps of 2 are 5e-7.
//   attention, attention_grad: sums over D and Tk of products of values in [-1, 1] in f32
//     (OpenBLAS) plus an f32 softmax: atol 1e-5, rtol 1e-4 (the same for lse, whose f32 scores
//     carry the same rounding). attention_grad gets out and lse from the reference forward.
//   attention_qkv, attention_qkv_grad: the same kernels reading q, k, v in place from the packed
//     (..., T, 3, H, D) tensor: the same atol 1e-5, rtol 1e-4. The packed kernels are also
//     compared with attention{bthd}'s openblas kernel on the three parts: the same sgemms on the
//     same values, so within 1e-6 (OpenBLAS may block differently for other strides).
#include <cmath>

#include "test_util.h"

namespace kiln {
namespace {

using testing::all_close;
using testing::expect_matches_reference;
using testing::selected_dialect;
using testing::Tolerance;
using testing::make;
using testing::rand;
using testing::run_dialect;
using testing::run_reference;




Tensor scalar(DType dtype, double value) { return make(dtype, {}, {value}); }

// Tiny, odd (not a multiple of 4 or 8 lanes, nor of the 256-element update block), and one
// that parallel_for splits.
const std::vector<Shape> kShapes = {{1}, {7}, {257}, {3, 5, 33}, {301, 517}};

// ---- optimizer updates ----

TEST(CpuTrainKernels, AdamwMatchesReference) {
  const Tolerance tol{1e-7, 1e-6};
  const std::vector<Attributes> attr_sets = {
      {},  // defaults: beta1 0.9, beta2 0.999, epsilon 1e-8, weight_decay 0.01
      {{"beta1", 0.8}, {"beta2", 0.95}, {"epsilon", 1e-6}, {"weight_decay", 0.1}},
      {{"weight_decay", 0.0}},
  };
  uint64_t seed = 100;
  for (const Shape& shape : kShapes) {
    for (const Attributes& attrs : attr_sets) {
      for (double step : {1.0, 7.0, 1000.0}) {
        const Tensor p = rand(DType::kF32, shape, ++seed, -2, 2);
        const Tensor g = rand(DType::kF32, shape, ++seed, -1, 1);
        const Tensor m = rand(DType::kF32, shape, ++seed, -0.5, 0.5);
        const Tensor v = rand(DType::kF32, shape, ++seed, 1e-4, 0.5);  // v >= 0, as AdamW keeps
        // lr and step as f32 or f64 scalars; a large lr makes the update term dominate p'.
        for (const auto& [lr, lr_dtype] : {std::pair{1e-3, DType::kF32}, {0.3, DType::kF64}}) {
          expect_matches_reference(
              "cpu", Op::kAdamwUpdate,
              {p, g, m, v, scalar(lr_dtype, lr), scalar(DType::kF32, step)}, attrs,
              {lr > 0.1 ? 1e-6 : tol.atol, tol.rtol});
        }
      }
    }
  }
}

// First step from zero state, worked out by hand: m' = (1 - 0.9) 0.5 = 0.05,
// v' = (1 - 0.999) 0.25 = 2.5e-4, m'/(1 - 0.9) = 0.5, v'/(1 - 0.999) = 0.25, so the step is
// 0.5 / (0.5 + 1e-8) ~ 1 and p' = 1 - 0.1 = 0.9 (weight decay 0). For g = -2 likewise
// m' = -0.2, v' = 4e-3, step -1, p' = 3 + 0.1 = 3.1.
TEST(CpuTrainKernels, AdamwFirstStepHandChecked) {
  const std::vector<Tensor> out = run_dialect(
      "cpu", Op::kAdamwUpdate,
      {make(DType::kF32, {2}, {1.0, 3.0}), make(DType::kF32, {2}, {0.5, -2.0}),
       make(DType::kF32, {2}, {0.0, 0.0}), make(DType::kF32, {2}, {0.0, 0.0}),
       scalar(DType::kF32, 0.1), scalar(DType::kF32, 1.0)},
      {{"weight_decay", 0.0}});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(all_close(out[0], make(DType::kF32, {2}, {0.9, 3.1}), 1e-6, 0));
  EXPECT_TRUE(all_close(out[1], make(DType::kF32, {2}, {0.05, -0.2}), 1e-8, 1e-6));
  EXPECT_TRUE(all_close(out[2], make(DType::kF32, {2}, {2.5e-4, 4e-3}), 1e-10, 1e-6));
}

TEST(CpuTrainKernels, SgdMatchesReference) {
  const std::vector<Attributes> attr_sets = {
      {},
      {{"weight_decay", 0.05}},
      {{"momentum", 0.9}},
      {{"momentum", 0.9}, {"weight_decay", 0.01}},
      {{"momentum", 0.8}, {"nesterov", true}, {"weight_decay", 0.02}},
  };
  uint64_t seed = 200;
  for (const Shape& shape : kShapes) {
    for (const Attributes& attrs : attr_sets) {
      const Tensor p = rand(DType::kF32, shape, ++seed, -2, 2);
      const Tensor g = rand(DType::kF32, shape, ++seed, -1, 1);
      const Tensor buf = rand(DType::kF32, shape, ++seed, -1, 1);
      for (const auto& [lr, lr_dtype] : {std::pair{0.01, DType::kF32}, {0.5, DType::kF64}})
        expect_matches_reference("cpu", Op::kSgdUpdate, {p, g, buf, scalar(lr_dtype, lr)}, attrs,
                                 {lr > 0.1 ? 1e-6 : 1e-7, 1e-6});
    }
  }
}

// Nesterov by hand: g = 1 + 0.5 * 2 = 2, buf' = 0.9 * 1 + 2 = 2.9,
// p' = 2 - 0.1 * (2 + 0.9 * 2.9) = 2 - 0.461 = 1.539.
TEST(CpuTrainKernels, SgdNesterovHandChecked) {
  const std::vector<Tensor> out = run_dialect(
      "cpu", Op::kSgdUpdate,
      {make(DType::kF32, {1}, {2.0}), make(DType::kF32, {1}, {1.0}), make(DType::kF32, {1}, {1.0}),
       scalar(DType::kF32, 0.1)},
      {{"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.5}});
  EXPECT_TRUE(all_close(out[0], make(DType::kF32, {1}, {1.539}), 0, 1e-6));
  EXPECT_TRUE(all_close(out[1], make(DType::kF32, {1}, {2.9}), 0, 1e-6));
}

// ---- reshape, transpose ----

TEST(CpuTrainKernels, ReshapeCopiesEveryDtype) {
  uint64_t seed = 400;
  for (DType dtype : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16, DType::kI32,
                      DType::kI64, DType::kBool, DType::kU8}) {
    const Tensor x = rand(dtype, {3, 7, 11}, ++seed, 1, 100);
    expect_matches_reference("cpu", Op::kReshape, {x}, {{"shape", std::vector<int64_t>{21, -1}}},
                             {0, 0});
  }
  const Tensor big = rand(DType::kF32, {1024, 1031}, ++seed);  // split into several copies
  expect_matches_reference("cpu", Op::kReshape, {big}, {{"shape", std::vector<int64_t>{-1}}},
                           {0, 0});
}

TEST(CpuTrainKernels, TransposeMatchesReference) {
  struct Case {
    Shape shape;
    std::vector<int64_t> perm;  // empty: the default (reverse)
  };
  const std::vector<Case> cases = {
      {{2, 5, 3, 7}, {0, 2, 1, 3}},     // (B, T, H, D) -> (B, H, T, D): runs of D
      {{4, 64, 4, 16}, {0, 2, 1, 3}},   // gpt2-tiny's head split
      {{3, 37, 41}, {0, 2, 1}},         // last two axes: batched 2-D tiles, partial tiles
      {{2, 3, 33, 65}, {0, 1, 3, 2}},
      {{301, 517}, {1, 0}},             // one big 2-D transpose, split across threads
      {{5, 6, 7}, {}},                  // default perm reverses
      {{2, 3, 4, 5}, {2, 3, 0, 1}},     // merges to a (6, 20) transpose
      {{1, 5, 1, 3}, {3, 2, 0, 1}},     // size-1 axes dropped
      {{2, 3, 4, 5, 6}, {2, 0, 4, 1, 3}},
      {{2, 3, 4, 5, 6}, {4, 3, 2, 1, 0}},
      {{2, 3, 4}, {-1, 0, 1}},          // negative axes
      {{6, 9}, {0, 1}},                 // identity
      {{3, 0, 2}, {2, 1, 0}},           // empty
      {{7}, {0}},
  };
  uint64_t seed = 500;
  for (const Case& c : cases) {
    for (DType dtype : {DType::kF32, DType::kF64, DType::kBF16, DType::kI32, DType::kBool}) {
      const Tensor x = rand(dtype, c.shape, ++seed, 1, 100);
      expect_matches_reference("cpu", Op::kTranspose, {x}, {{"perm", c.perm}}, {0, 0});
    }
  }
}

// A (2, 3) matrix: rows (1 2 3) and (4 5 6) become columns.
TEST(CpuTrainKernels, TransposeHandChecked) {
  const Tensor x = make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_TRUE(all_close(run_dialect("cpu", Op::kTranspose, {x})[0],
                        make(DType::kF32, {3, 2}, {1, 4, 2, 5, 3, 6}), 0, 0));
  // (1, 2, 2, 2) with perm (0, 2, 1, 3): the two middle axes swap, the pairs stay whole.
  const Tensor y = make(DType::kF32, {1, 2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_TRUE(all_close(
      run_dialect("cpu", Op::kTranspose, {y}, {{"perm", std::vector<int64_t>{0, 2, 1, 3}}})[0],
      make(DType::kF32, {1, 2, 2, 2}, {1, 2, 5, 6, 3, 4, 7, 8}), 0, 0));
}

// ---- attention ----

struct AttentionCase {
  Shape q, k, v;
  bool causal;
  double scale;  // <= 0: the default 1/sqrt(D)
  bool bthd = false;  // layout "bthd": q (..., Tq, H, D), problems H rows apart
};

const std::vector<AttentionCase> kAttentionCases = {
    {{2, 3, 7, 5}, {2, 3, 7, 5}, {2, 3, 7, 6}, false, 0},
    {{2, 3, 7, 5}, {2, 3, 7, 5}, {2, 3, 7, 6}, true, 0},
    {{2, 5, 4}, {2, 9, 4}, {2, 9, 3}, false, 0},   // Tq < Tk
    {{2, 9, 4}, {2, 5, 4}, {2, 5, 3}, false, 0},   // Tq > Tk
    {{2, 5, 4}, {2, 9, 4}, {2, 9, 3}, true, 0},    // causal, top-left: query i sees keys <= i
    {{2, 9, 4}, {2, 5, 4}, {2, 5, 3}, true, 0},    // later queries see every key
    {{13, 8}, {11, 8}, {11, 1}, false, 0.3},       // no batch dims, explicit scale
    {{1, 2, 17, 3}, {1, 2, 17, 3}, {1, 2, 17, 3}, true, 2.5},
    {{4, 4, 64, 16}, {4, 4, 64, 16}, {4, 4, 64, 16}, true, 0},  // gpt2-tiny's attention
    {{1, 1, 129, 33}, {1, 1, 129, 33}, {1, 1, 129, 35}, true, 0},
    {{1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}, true, 0},
    {{2, 7, 3, 5}, {2, 7, 3, 5}, {2, 7, 3, 6}, true, 0, true},    // bthd, H = 3
    {{2, 5, 4, 4}, {2, 9, 4, 4}, {2, 9, 4, 3}, false, 0, true},   // bthd, Tq < Tk
    {{4, 64, 4, 16}, {4, 64, 4, 16}, {4, 64, 4, 16}, true, 0, true},  // gpt2-tiny, simplified
    {{9, 2, 4}, {5, 2, 4}, {5, 2, 3}, true, 0.7, true},           // bthd, no batch dims
};

Attributes attention_attrs(const AttentionCase& c) {
  Attributes attrs{{"causal", c.causal}};
  if (c.scale > 0) attrs.set("scale", c.scale);
  if (c.bthd) attrs.set("layout", std::string("bthd"));
  return attrs;
}

TEST(CpuTrainKernels, AttentionMatchesReference) {
  uint64_t seed = 600;
  for (const AttentionCase& c : kAttentionCases) {
    const Tensor q = rand(DType::kF32, c.q, ++seed);
    const Tensor k = rand(DType::kF32, c.k, ++seed);
    const Tensor v = rand(DType::kF32, c.v, ++seed);
    expect_matches_reference("openblas", Op::kAttention, {q, k, v}, attention_attrs(c),
                             {1e-5, 1e-4});
  }
}

TEST(CpuTrainKernels, AttentionGradMatchesReference) {
  uint64_t seed = 700;
  for (const AttentionCase& c : kAttentionCases) {
    const Tensor q = rand(DType::kF32, c.q, ++seed);
    const Tensor k = rand(DType::kF32, c.k, ++seed);
    const Tensor v = rand(DType::kF32, c.v, ++seed);
    Shape out_shape = c.q;
    out_shape.back() = c.v.back();
    const Tensor dout = rand(DType::kF32, out_shape, ++seed);
    const std::vector<Tensor> fwd = run_reference(Op::kAttention, {q, k, v}, attention_attrs(c));
    expect_matches_reference("openblas", Op::kAttentionGrad, {q, k, v, fwd[0], dout, fwd[1]},
                             attention_attrs(c), {1e-5, 1e-4});
  }
}

// The backward follows the op's formulas on the GIVEN out and lse (it recomputes neither): an
// lse raised by ln 2 halves every P (so dv), and D comes from the out passed in, whatever it is.
TEST(CpuTrainKernels, AttentionGradUsesTheGivenOutAndLse) {
  const Tensor q = rand(DType::kF32, {2, 7, 5}, 901), k = rand(DType::kF32, {2, 7, 5}, 902);
  const Tensor v = rand(DType::kF32, {2, 7, 6}, 903), dout = rand(DType::kF32, {2, 7, 6}, 904);
  const Attributes attrs{{"causal", true}};
  const std::vector<Tensor> fwd = run_reference(Op::kAttention, {q, k, v}, attrs);
  Tensor lse = fwd[1].clone();
  for (int64_t i = 0; i < lse.numel(); ++i) lse.set(i, lse.get(i) + std::log(2.0));
  const Tensor other_out = rand(DType::kF32, {2, 7, 6}, 905);
  expect_matches_reference("openblas", Op::kAttentionGrad, {q, k, v, other_out, dout, lse},
                           attrs, {1e-5, 1e-4});
  const Tensor dv_half = run_dialect("openblas", Op::kAttentionGrad,
                                     {q, k, v, other_out, dout, lse}, attrs)[2];
  const Tensor dv = run_dialect("openblas", Op::kAttentionGrad,
                                {q, k, v, fwd[0], dout, fwd[1]}, attrs)[2];
  for (int64_t i = 0; i < dv.numel(); ++i) EXPECT_NEAR(dv_half.get(i), dv.get(i) / 2, 1e-6);
}

// Large scores: a stable softmax must not overflow (scores up to 8 * 8 * 4 = 256).
TEST(CpuTrainKernels, AttentionLargeScoresStayFinite) {
  const Tensor q = rand(DType::kF32, {2, 6, 8}, 801, -8, 8);
  const Tensor k = rand(DType::kF32, {2, 6, 8}, 802, -8, 8);
  const Tensor v = rand(DType::kF32, {2, 6, 8}, 803);
  const Attributes attrs{{"causal", true}, {"scale", 4.0}};
  // lse is up to about 256 here: rtol 1e-4 of it bounds the f32 rounding of the scores.
  expect_matches_reference("openblas", Op::kAttention, {q, k, v}, attrs, {1e-5, 1e-4});
  const std::vector<Tensor> fwd = run_reference(Op::kAttention, {q, k, v}, attrs);
  expect_matches_reference("openblas", Op::kAttentionGrad,
                           {q, k, v, fwd[0], rand(DType::kF32, {2, 6, 8}, 804), fwd[1]}, attrs,
                           {1e-4, 1e-4});
}

// q (1, 2) against keys (0, 1) and (0, -1): both scores are 0, so each key gets 1/2 and the
// output is the mean of the values, lse = log(e^0 + e^0) = ln 2; with the causal mask query 0
// sees only key 0 (its value exactly, lse = log(e^0) = 0) and query 1 both.
TEST(CpuTrainKernels, AttentionHandChecked) {
  const Tensor q = make(DType::kF32, {2, 2}, {1, 0, 1, 0});
  const Tensor k = make(DType::kF32, {2, 2}, {0, 1, 0, -1});
  const Tensor v = make(DType::kF32, {2, 3}, {1, 2, 3, 5, 6, 7});
  const float ln2 = static_cast<float>(std::log(2.0));
  std::vector<Tensor> full = run_dialect("openblas", Op::kAttention, {q, k, v});
  EXPECT_TRUE(all_close(full[0], make(DType::kF32, {2, 3}, {3, 4, 5, 3, 4, 5}), 0, 1e-6));
  EXPECT_TRUE(all_close(full[1], make(DType::kF32, {2}, {ln2, ln2}), 1e-7, 1e-6));
  std::vector<Tensor> causal =
      run_dialect("openblas", Op::kAttention, {q, k, v}, {{"causal", true}});
  EXPECT_TRUE(all_close(causal[0], make(DType::kF32, {2, 3}, {1, 2, 3, 3, 4, 5}), 0, 1e-6));
  EXPECT_TRUE(all_close(causal[1], make(DType::kF32, {2}, {0, ln2}), 1e-7, 1e-6));
}

// ---- attention_qkv, attention_qkv_grad ----

struct PackedCase {
  Shape qkv;  // (..., T, 3, H, D)
  bool causal;
  double scale;  // <= 0: the default 1/sqrt(D)
};

const std::vector<PackedCase> kPackedCases = {
    {{2, 7, 3, 3, 5}, false, 0},        // odd T and D, H = 3
    {{2, 7, 3, 3, 5}, true, 0},
    {{9, 3, 2, 4}, true, 0.7},          // rank 4: no batch dims
    {{13, 3, 1, 6}, false, 0},          // one head
    {{2, 3, 11, 3, 2, 3}, true, 0},     // rank 6: two batch dims
    {{2, 3, 11, 3, 2, 3}, false, 1.7},
    {{1, 1, 3, 1, 1}, true, 0},         // T = H = D = 1
    {{2, 64, 3, 4, 16}, true, 0},       // gpt2-tiny's packed projection
    {{1, 33, 3, 5, 7}, false, 0.4},
};

Attributes packed_attrs(const PackedCase& c) {
  Attributes attrs{{"causal", c.causal}};
  if (c.scale > 0) attrs.set("scale", c.scale);
  return attrs;
}

// (..., T, H, D): attention_qkv's output shape for qkv.
Shape unpacked_shape(const Shape& qkv) {
  Shape out = qkv;
  out.erase(out.end() - 3);
  return out;
}

// qkv[..., which, :, :] copied out.
Tensor part_of(const Tensor& qkv, int which) {
  Tensor out(TensorType{qkv.dtype(), unpacked_shape(qkv.shape())});
  const int64_t hd = qkv.shape().back() * qkv.shape()[qkv.shape().size() - 2];
  for (int64_t i = 0; i < out.numel(); ++i)
    out.set(i, qkv.get((i / hd * 3 + which) * hd + i % hd));
  return out;
}

TEST(CpuTrainKernels, AttentionQkvMatchesReference) {
  uint64_t seed = 1100;
  for (const PackedCase& c : kPackedCases) {
    const Tensor qkv = rand(DType::kF32, c.qkv, ++seed);
    expect_matches_reference("openblas", Op::kAttentionQkv, {qkv}, packed_attrs(c),
                             {1e-5, 1e-4});
  }
}

TEST(CpuTrainKernels, AttentionQkvGradMatchesReference) {
  uint64_t seed = 1200;
  for (const PackedCase& c : kPackedCases) {
    const Tensor qkv = rand(DType::kF32, c.qkv, ++seed);
    const Tensor dout = rand(DType::kF32, unpacked_shape(c.qkv), ++seed);
    const std::vector<Tensor> fwd = run_reference(Op::kAttentionQkv, {qkv}, packed_attrs(c));
    expect_matches_reference("openblas", Op::kAttentionQkvGrad, {qkv, fwd[0], dout, fwd[1]},
                             packed_attrs(c), {1e-5, 1e-4});
  }
}

// The packed kernels are attention{bthd}'s kernels with other strides: on the parts, the bthd
// kernels give the same out, lse and (packed) dq, dk, dv.
TEST(CpuTrainKernels, AttentionQkvMatchesBthdKernelOnTheParts) {
  uint64_t seed = 1300;
  for (const PackedCase& c : kPackedCases) {
    SCOPED_TRACE(to_string(c.qkv));
    const Tensor qkv = rand(DType::kF32, c.qkv, ++seed);
    const Tensor dout = rand(DType::kF32, unpacked_shape(c.qkv), ++seed);
    Attributes bthd = packed_attrs(c);
    bthd.set("layout", std::string("bthd"));
    const std::vector<Tensor> parts{part_of(qkv, 0), part_of(qkv, 1), part_of(qkv, 2)};
    const std::vector<Tensor> packed = run_dialect("openblas", Op::kAttentionQkv, {qkv},
                                                   packed_attrs(c));
    const std::vector<Tensor> split = run_dialect("openblas", Op::kAttention, parts, bthd);
    EXPECT_TRUE(all_close(packed[0], split[0], 1e-6, 1e-6));
    EXPECT_TRUE(all_close(packed[1], split[1], 1e-6, 1e-6));
    const Tensor dqkv = run_dialect("openblas", Op::kAttentionQkvGrad,
                                    {qkv, packed[0], dout, packed[1]}, packed_attrs(c))[0];
    const std::vector<Tensor> grads = run_dialect(
        "openblas", Op::kAttentionGrad,
        {parts[0], parts[1], parts[2], packed[0], dout, packed[1]}, bthd);
    for (int which = 0; which < 3; ++which)
      EXPECT_TRUE(all_close(part_of(dqkv, which), grads[which], 1e-6, 1e-6)) << which;
  }
}

// dq, dk, dv together overwrite every element of dqkv: a NaN-filled output buffer comes back
// with no NaN (the executor hands kernels uninitialized buffers).
TEST(CpuTrainKernels, AttentionQkvGradWritesEveryElement) {
  const Tensor qkv = rand(DType::kF32, {2, 5, 3, 3, 4}, 1401);
  const Tensor dout = rand(DType::kF32, {2, 5, 3, 4}, 1402);
  const Attributes attrs = normalize_attributes(Op::kAttentionQkvGrad, {{"causal", true}});
  const std::vector<Tensor> fwd = run_reference(Op::kAttentionQkv, {qkv}, attrs);
  const std::vector<Tensor> inputs{qkv, fwd[0], dout, fwd[1]};
  std::vector<TensorType> in_types;
  for (const Tensor& t : inputs) in_types.push_back(t.type());
  const std::vector<TensorType> out_types = infer_types(Op::kAttentionQkvGrad, in_types, attrs);
  Node node{Op::kAttentionQkvGrad, {}, {}, attrs};
  const KernelImpl& impl = kernel_registry().select(NodeView{node, in_types, out_types},
                                                    Device::kCpu, {"openblas"});
  std::vector<Tensor> outputs{Tensor(out_types[0])};
  for (int64_t i = 0; i < outputs[0].numel(); ++i) outputs[0].set(i, std::nan(""));
  impl.kernel(KernelArgs{attrs, inputs, outputs});
  const Tensor want = run_reference(Op::kAttentionQkvGrad, inputs, attrs)[0];
  EXPECT_TRUE(all_close(outputs[0], want, 1e-5, 1e-4));
  for (int64_t i = 0; i < outputs[0].numel(); ++i)
    ASSERT_FALSE(std::isnan(outputs[0].get(i))) << "element " << i << " not written";
}

// ---- what supports() refuses ----

TEST(CpuTrainKernels, RefusesOtherDtypesAndEmptyAttention) {
  const TensorType f32{DType::kF32, {4, 3}}, f64{DType::kF64, {4, 3}};
  const TensorType lr{DType::kF32, {}}, step{DType::kF32, {}};
  EXPECT_EQ(selected_dialect(Op::kAdamwUpdate, {f32, f32, f32, f32, lr, step}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kAdamwUpdate, {f32, f32, f32, f32, {DType::kF64, {}}, step}),
            "cpu");  // any float scalar lr
  EXPECT_EQ(selected_dialect(Op::kAdamwUpdate, {f64, f64, f64, f64, lr, step}), "reference");
  EXPECT_EQ(selected_dialect(Op::kAdamwUpdate, {f32, f64, f32, f32, lr, step}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSgdUpdate, {f32, f32, f32, lr}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kSgdUpdate, {f64, f64, f64, lr}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSgdUpdate, {f32, {DType::kF16, {4, 3}}, f32, lr}),
            "reference");
  // reshape and transpose copy bytes: every dtype.
  EXPECT_EQ(selected_dialect(Op::kReshape, {f64}, {{"shape", std::vector<int64_t>{-1}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kTranspose, {{DType::kBool, {2, 3}}}), "cpu");

  const TensorType q{DType::kF32, {2, 5, 4}}, lse{DType::kF32, {2, 5}};
  EXPECT_EQ(selected_dialect(Op::kAttention, {q, q, q}), "openblas");
  EXPECT_EQ(selected_dialect(Op::kAttentionGrad, {q, q, q, q, q, lse}), "openblas");
  const TensorType q64{DType::kF64, {2, 5, 4}}, lse64{DType::kF64, {2, 5}};
  EXPECT_EQ(selected_dialect(Op::kAttention, {q64, q64, q64}), "reference");
  EXPECT_EQ(selected_dialect(Op::kAttentionGrad, {q64, q64, q64, q64, q64, lse64}),
            "reference");
  // Empty lengths (no keys, zero head dim) are left to the reference.
  const TensorType no_keys{DType::kF32, {2, 0, 4}};
  EXPECT_EQ(selected_dialect(Op::kAttention, {q, no_keys, no_keys}), "reference");
  const TensorType no_dim{DType::kF32, {2, 5, 0}};
  EXPECT_EQ(selected_dialect(Op::kAttention, {no_dim, no_dim, q}), "reference");

  // attention_qkv, attention_qkv_grad: f32 only, and every length at least 1.
  const TensorType qkv{DType::kF32, {2, 5, 3, 2, 4}}, out{DType::kF32, {2, 5, 2, 4}};
  const TensorType qkv_lse{DType::kF32, {2, 5, 2}};
  EXPECT_EQ(selected_dialect(Op::kAttentionQkv, {qkv}), "openblas");
  EXPECT_EQ(selected_dialect(Op::kAttentionQkvGrad, {qkv, out, out, qkv_lse}), "openblas");
  const TensorType qkv64{DType::kF64, {2, 5, 3, 2, 4}}, out64{DType::kF64, {2, 5, 2, 4}};
  EXPECT_EQ(selected_dialect(Op::kAttentionQkv, {qkv64}), "reference");
  EXPECT_EQ(selected_dialect(Op::kAttentionQkvGrad,
                             {qkv64, out64, out64, {DType::kF64, {2, 5, 2}}}),
            "reference");
  EXPECT_EQ(selected_dialect(Op::kAttentionQkv, {{DType::kBF16, {2, 5, 3, 2, 4}}}),
            "reference");
  EXPECT_EQ(selected_dialect(Op::kAttentionQkv, {{DType::kF32, {2, 0, 3, 2, 4}}}),
            "reference");  // no tokens
  EXPECT_EQ(selected_dialect(Op::kAttentionQkv, {{DType::kF32, {2, 5, 3, 2, 0}}}),
            "reference");  // zero head dim
  EXPECT_EQ(selected_dialect(Op::kAttentionQkv, {{DType::kF32, {2, 5, 3, 0, 4}}}),
            "reference");  // no heads
}

}  // namespace
}  // namespace kiln
