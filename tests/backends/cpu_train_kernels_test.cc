// The training-step fast kernels (src/backends/cpu/train_kernels.cc) beyond the conformance
// sweep, which runs optimizer_update, gelu_grad, reshape, transpose ("cpu") and
// attention, attention_grad, attention_qkv, attention_qkv_grad ("openblas") against the
// reference kernels on random inputs of odd sizes and sizes parallel_for splits, with the
// tolerances these kernels hold (tests/conformance_cases.cc): hand-checked values, attention_grad
// on a given out and lse (not recomputed), the packed kernels bit-close to the "bthd" ones on
// the unpacked parts (the same sgemms on the same values, so within 1e-6: OpenBLAS may block
// differently for other strides), and the cases supports() refuses.
#include <cmath>

#include "test_util.h"

namespace kiln {
namespace {

using testing::all_close;
using testing::expect_matches_reference;
using testing::selected_dialect;
using testing::make;
using testing::rand;
using testing::run_dialect;
using testing::run_reference;

Tensor scalar(DType dtype, double value) { return make(dtype, {}, {value}); }

// ---- optimizer updates ----

// First step from zero state, worked out by hand: m' = (1 - 0.9) 0.5 = 0.05,
// v' = (1 - 0.999) 0.25 = 2.5e-4, m'/(1 - 0.9) = 0.5, v'/(1 - 0.999) = 0.25, so the step is
// 0.5 / (0.5 + 1e-8) ~ 1 and p' = 1 - 0.1 = 0.9 (weight decay 0). For g = -2 likewise
// m' = -0.2, v' = 4e-3, step -1, p' = 3 + 0.1 = 3.1.
TEST(CpuTrainKernels, AdamwFirstStepHandChecked) {
  const std::vector<Tensor> out = run_dialect(
      "cpu", Op::kOptimizerUpdate,
      {make(DType::kF32, {2}, {1.0, 3.0}), make(DType::kF32, {2}, {0.5, -2.0}),
       make(DType::kF32, {2}, {0.0, 0.0}), make(DType::kF32, {2}, {0.0, 0.0}),
       scalar(DType::kF32, 0.1), scalar(DType::kF32, 1.0)},
      {{"optimizer", "adamw"}, {"weight_decay", 0.0}});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(all_close(out[0], make(DType::kF32, {2}, {0.9, 3.1}), 1e-6, 0));
  EXPECT_TRUE(all_close(out[1], make(DType::kF32, {2}, {0.05, -0.2}), 1e-8, 1e-6));
  EXPECT_TRUE(all_close(out[2], make(DType::kF32, {2}, {2.5e-4, 4e-3}), 1e-10, 1e-6));
}

// Nesterov by hand: g = 1 + 0.5 * 2 = 2, buf' = 0.9 * 1 + 2 = 2.9,
// p' = 2 - 0.1 * (2 + 0.9 * 2.9) = 2 - 0.461 = 1.539.
TEST(CpuTrainKernels, SgdNesterovHandChecked) {
  const std::vector<Tensor> out = run_dialect(
      "cpu", Op::kOptimizerUpdate,
      {make(DType::kF32, {1}, {2.0}), make(DType::kF32, {1}, {1.0}), make(DType::kF32, {1}, {1.0}),
       scalar(DType::kF32, 0.1), scalar(DType::kF32, 1.0)},
      {{"optimizer", "sgd"}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.5}});
  EXPECT_TRUE(all_close(out[0], make(DType::kF32, {1}, {1.539}), 0, 1e-6));
  EXPECT_TRUE(all_close(out[1], make(DType::kF32, {1}, {2.9}), 0, 1e-6));
}

// ---- gelu_grad ----

// gelu'(0) = 1/2 in both forms; exact gelu'(1) = Phi(1) + phi(1) = 0.8413447461 + 0.2419707245;
// tanh form at 1 (the closed form evaluated on a calculator): u = sqrt(2/pi) 1.044715 =
// 0.83356197, t = tanh(u) = 0.68238398, 0.5 (1 + t) + 0.5 (1 - t^2) sqrt(2/pi) (1 + 0.134145)
// = 0.84119199 + 0.24177209 = 1.08296408.
TEST(CpuTrainKernels, GeluGradHandChecked) {
  const Tensor x = make(DType::kF32, {2}, {0.0, 1.0});
  const Tensor dy = make(DType::kF32, {2}, {3.0, 2.0});
  EXPECT_TRUE(all_close(
      run_dialect("cpu", Op::kGeluGrad, {x, dy}, {{"approximate", std::string("none")}})[0],
      make(DType::kF32, {2}, {1.5, 2.0 * 1.0833154706}), 0, 2e-6));
  EXPECT_TRUE(all_close(
      run_dialect("cpu", Op::kGeluGrad, {x, dy}, {{"approximate", std::string("tanh")}})[0],
      make(DType::kF32, {2}, {1.5, 2.0 * 1.08296408}), 0, 2e-6));
}

// ---- reshape, transpose ----

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

// ---- what supports() refuses ----

TEST(CpuTrainKernels, RefusesOtherDtypesAndEmptyAttention) {
  const TensorType f32{DType::kF32, {4, 3}}, f64{DType::kF64, {4, 3}};
  const TensorType lr{DType::kF32, {}}, step{DType::kF32, {}};
  const Attributes adamw{{"optimizer", "adamw"}}, sgd{{"optimizer", "sgd"}};
  const Op update = Op::kOptimizerUpdate;
  EXPECT_EQ(selected_dialect(update, {f32, f32, f32, f32, lr, step}, adamw), "cpu");
  EXPECT_EQ(selected_dialect(update, {f32, f32, f32, f32, {DType::kF64, {}}, step}, adamw),
            "cpu");  // any float scalar lr
  EXPECT_EQ(selected_dialect(update, {f64, f64, f64, f64, lr, step}, adamw), "reference");
  EXPECT_EQ(selected_dialect(update, {f32, f64, f32, f32, lr, step}, adamw), "reference");
  EXPECT_EQ(selected_dialect(update, {f32, f32, f32, lr, step}, sgd), "cpu");
  EXPECT_EQ(selected_dialect(update, {f64, f64, f64, lr, step}, sgd), "reference");
  EXPECT_EQ(selected_dialect(update, {f32, {DType::kF16, {4, 3}}, f32, lr, step}, sgd), "reference");
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
