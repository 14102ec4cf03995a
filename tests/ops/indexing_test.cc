// gather_elements, scatter_elements, cumsum, topk (src/ops/indexing.cc) and prod
// (src/ops/reduction.cc): inference and its errors, the reference kernels on small cases whose
// expected values are written out by hand (ONNX's examples among them), integers exact beyond
// 2^53, and every gradient rule against float64 central differences.
#include "gradcheck.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::all_close;
using testing::expect_op_gradients;
using testing::infer;
using testing::make;
using testing::run_reference;
using Ints = std::vector<int64_t>;

constexpr int64_t kBig = int64_t{1} << 60;  // integers near it are not doubles

Tensor i64(Shape shape, const Ints& values) {
  Tensor t(TensorType{DType::kI64, std::move(shape)});
  std::copy(values.begin(), values.end(), t.data<int64_t>());
  return t;
}
Ints i64_values(const Tensor& t) {
  return Ints(t.data<int64_t>(), t.data<int64_t>() + t.numel());
}
Tensor f32(Shape shape, std::vector<double> values) { return make(DType::kF32, std::move(shape), values); }
Tensor rand64(Shape shape, uint64_t seed, double low = -1.0, double high = 1.0) {
  return testing::rand(DType::kF64, std::move(shape), seed, low, high);
}

void expect_values(const Tensor& t, const std::vector<double>& expected) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(expected.size()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (std::isnan(expected[i])) {
      EXPECT_TRUE(std::isnan(t.get(i))) << "element " << i;
    } else {
      EXPECT_NEAR(t.get(i), expected[i], 1e-6 * (1 + std::abs(expected[i]))) << "element " << i;
    }
  }
}

// ---------------------------------------------------------------- gather_elements

TEST(GatherElements, OnnxExamples) {
  // ONNX's GatherElements examples: axis 1, then axis 0.
  expect_values(run_reference(Op::kGatherElements, {f32({2, 2}, {1, 2, 3, 4}), i64({2, 2}, {0, 0, 1, 0})},
                              {{"axis", 1}})[0],
                {1, 1, 4, 3});
  expect_values(run_reference(Op::kGatherElements,
                              {f32({3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9}), i64({2, 3}, {1, 2, 0, 2, 0, 0})})[0],
                {4, 8, 3, 7, 2, 3});
}

TEST(GatherElements, InferenceAndErrors) {
  EXPECT_EQ(infer(Op::kGatherElements, {{DType::kF16, {4, 5}}, {DType::kI32, {2, 7}}}, {{"axis", 1}})[0],
            (TensorType{DType::kF16, {2, 7}}));
  EXPECT_KILN_ERROR(infer(Op::kGatherElements, {{DType::kF32, {4, 5}}, {DType::kI64, {5}}}), "gather_elements",
                    "rank");
  EXPECT_KILN_ERROR(infer(Op::kGatherElements, {{DType::kF32, {4, 5}}, {DType::kI64, {2, 6}}}), "larger",
                    "axis 1");
  EXPECT_KILN_ERROR(infer(Op::kGatherElements, {{DType::kF32, {4, 5}}, {DType::kF32, {2, 2}}}), "i32 or i64");
  EXPECT_KILN_ERROR(run_reference(Op::kGatherElements, {f32({2, 2}, {1, 2, 3, 4}), i64({1, 2}, {0, 2})}, {{"axis", 1}}),
                    "gather_elements", "index 2", "position 1", "dim 2");
}

TEST(GatherElements, CopiesIntegersExactly) {
  const Tensor out = run_reference(Op::kGatherElements, {i64({3}, {kBig + 1, kBig + 2, kBig + 3}), i64({2}, {2, 0})})[0];
  EXPECT_EQ(i64_values(out), (Ints{kBig + 3, kBig + 1}));
}

// ---------------------------------------------------------------- scatter_elements

Tensor scatter(Tensor data, Tensor indices, Tensor updates, const std::string& reduction, int64_t axis = 1) {
  return run_reference(Op::kScatterElements, {std::move(data), std::move(indices), std::move(updates)},
                       {{"axis", axis}, {"reduction", reduction}})[0];
}

TEST(ScatterElements, EachReduction) {
  const Tensor data = f32({1, 5}, {1, 2, 3, 4, 5});
  // ONNX's example (axis 1).
  expect_values(scatter(data, i64({1, 2}, {1, 3}), f32({1, 2}, {1.1, 2.1}), "none"), {1, 1.1, 3, 2.1, 5});
  // A repeated position: the reductions fold every update into it, in order; none keeps the last.
  const Tensor twice = i64({1, 2}, {1, 1});
  const Tensor updates = f32({1, 2}, {1.5, 3.0});
  expect_values(scatter(data, twice, updates, "none"), {1, 3.0, 3, 4, 5});
  expect_values(scatter(data, twice, updates, "add"), {1, 6.5, 3, 4, 5});
  expect_values(scatter(data, twice, updates, "mul"), {1, 9.0, 3, 4, 5});
  expect_values(scatter(data, twice, updates, "max"), {1, 3.0, 3, 4, 5});
  expect_values(scatter(data, twice, updates, "min"), {1, 1.5, 3, 4, 5});
  // Axis 0 over a (3, 3): ONNX's ScatterElements example without axis.
  expect_values(scatter(f32({3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9}), i64({2, 3}, {1, 0, 2, 0, 2, 1}),
                        f32({2, 3}, {1.0, 1.1, 1.2, 2.0, 2.1, 2.2}), "none", 0),
                {2.0, 1.1, 3, 1.0, 5, 2.2, 7, 2.1, 1.2});
}

TEST(ScatterElements, NanPropagatesThroughMaxAndMin) {
  const double nan = std::nan("");
  expect_values(scatter(f32({1, 2}, {nan, 1}), i64({1, 2}, {0, 1}), f32({1, 2}, {5, nan}), "max"), {nan, nan});
  expect_values(scatter(f32({1, 2}, {nan, 1}), i64({1, 2}, {0, 1}), f32({1, 2}, {5, nan}), "min"), {nan, nan});
}

TEST(ScatterElements, IntegersAreExact) {
  const Tensor data = i64({1, 3}, {kBig + 1, 7, -kBig});
  EXPECT_EQ(i64_values(scatter(data, i64({1, 2}, {0, 0}), i64({1, 2}, {1, 2}), "add")), (Ints{kBig + 4, 7, -kBig}));
  EXPECT_EQ(i64_values(scatter(data, i64({1, 1}, {1}), i64({1, 1}, {kBig + 5}), "max")), (Ints{kBig + 1, kBig + 5, -kBig}));
  EXPECT_EQ(i64_values(scatter(data, i64({1, 1}, {2}), i64({1, 1}, {3}), "mul")), (Ints{kBig + 1, 7, -3 * kBig}));
  EXPECT_EQ(i64_values(scatter(data, i64({1, 1}, {2}), i64({1, 1}, {kBig + 9}), "none")), (Ints{kBig + 1, 7, kBig + 9}));
}

TEST(ScatterElements, InferenceAndErrors) {
  const TensorType data{DType::kF32, {4, 5}}, indices{DType::kI64, {2, 5}}, updates{DType::kF32, {2, 5}};
  EXPECT_EQ(infer(Op::kScatterElements, {data, indices, updates})[0], data);
  EXPECT_KILN_ERROR(infer(Op::kScatterElements, {data, indices, {DType::kF32, {2, 4}}}), "scatter_elements",
                    "updates", "(2, 5)");
  EXPECT_KILN_ERROR(infer(Op::kScatterElements, {data, indices, {DType::kF64, {2, 5}}}), "updates", "f32");
  EXPECT_KILN_ERROR(infer(Op::kScatterElements, {data, indices, updates}, {{"reduction", std::string("sum")}}),
                    "reduction", "\"sum\"", "add");
  EXPECT_KILN_ERROR(infer(Op::kScatterElements, {{DType::kBool, {4}}, {DType::kI64, {2}}, {DType::kBool, {2}}},
                          {{"reduction", std::string("add")}}),
                    "bool");
  // bool data takes reduction none (a plain write).
  EXPECT_EQ(infer(Op::kScatterElements, {{DType::kBool, {4}}, {DType::kI64, {2}}, {DType::kBool, {2}}})[0],
            (TensorType{DType::kBool, {4}}));
  EXPECT_KILN_ERROR(scatter(f32({1, 2}, {1, 2}), i64({1, 1}, {-1}), f32({1, 1}, {3}), "add"), "scatter_elements",
                    "index -1", "dim 2");
}

// ---------------------------------------------------------------- cumsum

Tensor cumsum(Tensor x, int64_t axis, bool exclusive = false, bool reverse = false) {
  return run_reference(Op::kCumsum, {std::move(x)}, {{"axis", axis}, {"exclusive", exclusive}, {"reverse", reverse}})[0];
}

TEST(Cumsum, EveryDirection) {
  const Tensor x = f32({4}, {1, 2, 3, 4});
  expect_values(cumsum(x, 0), {1, 3, 6, 10});
  expect_values(cumsum(x, 0, /*exclusive=*/true), {0, 1, 3, 6});
  expect_values(cumsum(x, 0, false, /*reverse=*/true), {10, 9, 7, 4});
  expect_values(cumsum(x, 0, true, true), {9, 7, 4, 0});
  const Tensor m = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  expect_values(cumsum(m, 0), {1, 2, 3, 5, 7, 9});
  expect_values(cumsum(m, -1), {1, 3, 6, 4, 9, 15});
}

TEST(Cumsum, IntegersAreExact) {
  EXPECT_EQ(i64_values(cumsum(i64({3}, {kBig, 1, 1}), 0)), (Ints{kBig, kBig + 1, kBig + 2}));
  EXPECT_EQ(i64_values(cumsum(i64({3}, {kBig, 1, 1}), 0, true, true)), (Ints{2, 1, 0}));
}

TEST(Cumsum, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kCumsum, {{DType::kF32, {3}}}), "cumsum", "axis", "missing");
  EXPECT_KILN_ERROR(infer(Op::kCumsum, {{DType::kBool, {3}}}, {{"axis", 0}}), "cumsum", "bool");
  EXPECT_KILN_ERROR(infer(Op::kCumsum, {{DType::kF32, {3}}}, {{"axis", 1}}), "cumsum");
}

// ---------------------------------------------------------------- topk

std::vector<Tensor> topk(Tensor x, int64_t k, int64_t axis = -1, bool largest = true) {
  return run_reference(Op::kTopk, {std::move(x)}, {{"k", k}, {"axis", axis}, {"largest", largest}});
}

TEST(Topk, OrderTiesAndNan) {
  const double nan = std::nan("");
  const Tensor x = f32({5}, {3, 1, 3, nan, 2});
  std::vector<Tensor> largest = topk(x, 3);
  expect_values(largest[0], {nan, 3, 3});
  EXPECT_EQ(i64_values(largest[1]), (Ints{3, 0, 2}));  // NaN first, then the tie by index
  std::vector<Tensor> smallest = topk(x, 5, 0, false);
  expect_values(smallest[0], {1, 2, 3, 3, nan});
  EXPECT_EQ(i64_values(smallest[1]), (Ints{1, 4, 0, 2, 3}));
  // ONNX's example: (3, 4), k 3 along axis 1.
  std::vector<Tensor> rows = topk(f32({3, 4}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}), 3, 1);
  expect_values(rows[0], {3, 2, 1, 7, 6, 5, 11, 10, 9});
  EXPECT_EQ(i64_values(rows[1]), (Ints{3, 2, 1, 3, 2, 1, 3, 2, 1}));
  // Along the first axis of a (3, 2).
  std::vector<Tensor> columns = topk(f32({3, 2}, {5, 0, 1, 4, 3, 9}), 2, 0);
  expect_values(columns[0], {5, 9, 3, 4});
  EXPECT_EQ(i64_values(columns[1]), (Ints{0, 2, 2, 1}));
}

TEST(Topk, IntegersCompareExactly) {
  // Through double the three would tie.
  std::vector<Tensor> out = topk(i64({3}, {kBig + 1, kBig, kBig + 2}), 2);
  EXPECT_EQ(i64_values(out[0]), (Ints{kBig + 2, kBig + 1}));
  EXPECT_EQ(i64_values(out[1]), (Ints{2, 0}));
}

TEST(Topk, InferenceAndErrors) {
  const std::vector<TensorType> out = infer(Op::kTopk, {{DType::kBF16, {4, 9}}}, {{"k", 2}, {"axis", 0}});
  EXPECT_EQ(out[0], (TensorType{DType::kBF16, {2, 9}}));
  EXPECT_EQ(out[1], (TensorType{DType::kI64, {2, 9}}));
  EXPECT_KILN_ERROR(infer(Op::kTopk, {{DType::kF32, {4, 9}}}, {{"k", 10}}), "topk", "k is 10", "0..9");
  EXPECT_KILN_ERROR(infer(Op::kTopk, {{DType::kF32, {}}}, {{"k", 1}}), "topk", "rank");
}

// ---------------------------------------------------------------- prod

TEST(Prod, ReducesAndKeepsIntegersExact) {
  const Tensor x = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  expect_values(run_reference(Op::kProd, {x}, {{"axes", Ints{1}}})[0], {6, 120});
  expect_values(run_reference(Op::kProd, {x}, {{"axes", Ints{0}}, {"keepdims", true}})[0], {4, 10, 18});
  expect_values(run_reference(Op::kProd, {x})[0], {720});
  expect_values(run_reference(Op::kProd, {f32({2, 0}, {})}, {{"axes", Ints{1}}})[0], {1, 1});
  // (2^31 + 1)^2 = 2^62 + 2^32 + 1, which no double holds.
  const int64_t a = (int64_t{1} << 31) + 1;
  EXPECT_EQ(i64_values(run_reference(Op::kProd, {i64({2}, {a, a})})[0]),
            (Ints{(int64_t{1} << 62) + (int64_t{1} << 32) + 1}));
}

// ---------------------------------------------------------------- gradients

TEST(IndexingGrad, GatherElementsAddsRepeatedReads) {
  expect_op_gradients(Op::kGatherElements, {rand64({3, 4}, 1), i64({2, 4}, {0, 2, 2, 1, 0, 2, 1, 1})});
  expect_op_gradients(Op::kGatherElements, {rand64({3, 4}, 2), i64({3, 5}, {0, 3, 3, 1, 2, 2, 1, 0, 0, 3, 1, 1, 1, 1, 0})},
                      {{"axis", 1}});
}

TEST(IndexingGrad, ScatterElementsNoneAndAdd) {
  // none: distinct positions per column (repeated ones have no single derivative).
  expect_op_gradients(Op::kScatterElements, {rand64({4, 3}, 3), i64({2, 3}, {1, 0, 3, 2, 3, 0}), rand64({2, 3}, 4)},
                      {{"reduction", std::string("none")}});
  // add: repeated positions too.
  expect_op_gradients(Op::kScatterElements, {rand64({4, 3}, 5), i64({3, 3}, {1, 0, 3, 1, 0, 3, 2, 2, 3}), rand64({3, 3}, 6)},
                      {{"reduction", std::string("add")}});
  expect_op_gradients(Op::kScatterElements, {rand64({2, 5}, 7), i64({2, 2}, {4, 0, 1, 1}), rand64({2, 2}, 8)},
                      {{"axis", 1}, {"reduction", std::string("add")}});
}

TEST(IndexingGrad, ScatterElementsRefusesTheOtherReductions) {
  EXPECT_KILN_ERROR(expect_op_gradients(Op::kScatterElements, {rand64({4}, 9), i64({2}, {0, 1}), rand64({2}, 10)},
                                        {{"reduction", std::string("max")}}),
                    "scatter_elements", "\"max\"", "no gradient");
}

TEST(IndexingGrad, Cumsum) {
  for (bool exclusive : {false, true})
    for (bool reverse : {false, true}) {
      expect_op_gradients(Op::kCumsum, {rand64({5}, 11)}, {{"axis", 0}, {"exclusive", exclusive}, {"reverse", reverse}});
      expect_op_gradients(Op::kCumsum, {rand64({3, 4, 2}, 12)},
                          {{"axis", 1}, {"exclusive", exclusive}, {"reverse", reverse}});
    }
}

TEST(IndexingGrad, Topk) {
  expect_op_gradients(Op::kTopk, {rand64({3, 6}, 13)}, {{"k", 3}});
  expect_op_gradients(Op::kTopk, {rand64({5, 2}, 14)}, {{"k", 5}, {"axis", 0}, {"largest", false}});
}

TEST(IndexingGrad, ProdWithAndWithoutZeros) {
  expect_op_gradients(Op::kProd, {rand64({3, 4}, 15, 0.5, 1.5)}, {{"axes", Ints{1}}});
  expect_op_gradients(Op::kProd, {rand64({2, 3, 2}, 16, -1.5, -0.5)}, {{"axes", Ints{0, 2}}, {"keepdims", true}});
  // The product is linear in each element, so central differences are exact at zeros too: rows
  // with no zero, one zero and two zeros.
  expect_op_gradients(Op::kProd, {make(DType::kF64, {3, 3}, {0.5, -2, 3, 1.5, 0, 2, 0, 4, 0})}, {{"axes", Ints{1}}});
  expect_op_gradients(Op::kProd, {make(DType::kF64, {4}, {0.5, 0, -1.25, 2})});
}

}  // namespace
}  // namespace kiln
