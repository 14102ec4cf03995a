// Shape ops (src/ops/shape.cc): inference on good inputs, every error with its message, and the
// reference kernels on small cases whose expected values are written out by hand.
#include <functional>
#include <numeric>

#include "test_util.h"

namespace kiln {
namespace {

using testing::all_close;
using testing::error_of;
using testing::infer;
using testing::make;
using testing::run_reference;
using Ints = std::vector<int64_t>;



TensorType f32(Shape shape) { return {DType::kF32, std::move(shape)}; }
TensorType of(DType dtype, Shape shape) { return {dtype, std::move(shape)}; }

// 0, 1, 2, ... in `shape`: element value = its flat index, so expectations are closed forms.
Tensor iota(DType dtype, Shape shape) {
  std::vector<double> values(numel(shape));
  std::iota(values.begin(), values.end(), 0.0);
  return make(dtype, std::move(shape), values);
}

// ---------------------------------------------------------------- reshape

TEST(ShapeReshape, InfersShapesIncludingMinusOne) {
  EXPECT_EQ(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{4, 6}}})[0], f32({4, 6}));
  EXPECT_EQ(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{4, -1}}})[0], f32({4, 6}));
  EXPECT_EQ(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{-1}}})[0], f32({24}));
  EXPECT_EQ(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{2, -1, 2}}})[0],
            f32({2, 6, 2}));
  EXPECT_EQ(infer(Op::kReshape, {f32({1})}, {{"shape", Ints{}}})[0], f32({}));
  EXPECT_EQ(infer(Op::kReshape, {f32({0, 3})}, {{"shape", Ints{-1, 3}}})[0], f32({0, 3}));
  // Any dtype passes through.
  EXPECT_EQ(infer(Op::kReshape, {of(DType::kBool, {6})}, {{"shape", Ints{3, 2}}})[0],
            of(DType::kBool, {3, 2}));
}

TEST(ShapeReshape, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{5, 5}}}), "reshape",
                    "(2, 3, 4)", "(5, 5)", "24", "25");
  EXPECT_KILN_ERROR(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{5, -1}}}), "(2, 3, 4)",
                    "(5, -1)");
  EXPECT_KILN_ERROR(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{-1, -1}}}),
                    "more than one -1");
  EXPECT_KILN_ERROR(infer(Op::kReshape, {f32({2, 3, 4})}, {{"shape", Ints{-2, -12}}}), "-2",
                    "negative");
  EXPECT_KILN_ERROR(infer(Op::kReshape, {f32({2, 3, 4})}, {}), "shape", "missing");
  EXPECT_KILN_ERROR(infer(Op::kReshape, {f32({2, 3}), f32({2, 3})}, {{"shape", Ints{6}}}),
                    "2 inputs", "expected 1");
}

TEST(ShapeReshape, KernelKeepsRowMajorOrder) {
  Tensor x = make(DType::kI32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor y = run_reference(Op::kReshape, {x}, {{"shape", Ints{3, -1}}})[0];
  EXPECT_TRUE(all_close(y, make(DType::kI32, {3, 2}, {1, 2, 3, 4, 5, 6}), 0, 0));
}

// ---------------------------------------------------------------- transpose

TEST(ShapeTranspose, InfersShapes) {
  EXPECT_EQ(infer(Op::kTranspose, {f32({2, 3, 4})})[0], f32({4, 3, 2}));  // default: reverse
  EXPECT_EQ(infer(Op::kTranspose, {f32({2, 3, 4})}, {{"perm", Ints{1, 0, 2}}})[0],
            f32({3, 2, 4}));
  EXPECT_EQ(infer(Op::kTranspose, {f32({2, 3, 4})}, {{"perm", Ints{-1, 0, 1}}})[0],
            f32({4, 2, 3}));
  EXPECT_EQ(infer(Op::kTranspose, {of(DType::kI64, {})})[0], of(DType::kI64, {}));
}

TEST(ShapeTranspose, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kTranspose, {f32({2, 3, 4})}, {{"perm", Ints{0, 0, 1}}}),
                    "transpose", "[0, 0, 1]", "not a permutation", "twice");
  EXPECT_KILN_ERROR(infer(Op::kTranspose, {f32({2, 3, 4})}, {{"perm", Ints{0, 1}}}), "[0, 1]",
                    "2 entries", "expected 3");
  EXPECT_KILN_ERROR(infer(Op::kTranspose, {f32({2, 3, 4})}, {{"perm", Ints{0, 1, 3}}}),
                    "[0, 1, 3]", "3 is out of range");
  EXPECT_KILN_ERROR(infer(Op::kTranspose, {f32({2, 3})}, {{"perm", Ints{0, -3}}}), "-3",
                    "out of range");
}

TEST(ShapeTranspose, Kernel2D) {
  Tensor x = make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor y = run_reference(Op::kTranspose, {x})[0];
  EXPECT_TRUE(all_close(y, make(DType::kF32, {3, 2}, {1, 4, 2, 5, 3, 6}), 0, 0));
}

TEST(ShapeTranspose, Kernel3DMatchesClosedForm) {
  // x[a][b][c] = 12a + 4b + c; with perm [2, 0, 1], y[i][j][k] = x[j][k][i] = 12j + 4k + i.
  Tensor x = iota(DType::kBF16, {2, 3, 4});
  Tensor y = run_reference(Op::kTranspose, {x}, {{"perm", Ints{2, 0, 1}}})[0];
  std::vector<double> expected;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 3; ++k) expected.push_back(12 * j + 4 * k + i);
  EXPECT_TRUE(all_close(y, make(DType::kBF16, {4, 2, 3}, expected), 0, 0));
}

// ---------------------------------------------------------------- broadcast_to

TEST(ShapeBroadcastTo, InfersShapes) {
  EXPECT_EQ(infer(Op::kBroadcastTo, {f32({3})}, {{"shape", Ints{2, 3}}})[0], f32({2, 3}));
  EXPECT_EQ(infer(Op::kBroadcastTo, {f32({3, 1})}, {{"shape", Ints{2, 3, 4}}})[0],
            f32({2, 3, 4}));
  EXPECT_EQ(infer(Op::kBroadcastTo, {f32({})}, {{"shape", Ints{5}}})[0], f32({5}));
  EXPECT_EQ(infer(Op::kBroadcastTo, {f32({2, 3})}, {{"shape", Ints{2, 3}}})[0], f32({2, 3}));
}

TEST(ShapeBroadcastTo, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kBroadcastTo, {f32({3})}, {{"shape", Ints{2, 4}}}), "broadcast_to",
                    "cannot broadcast (3,) to (2, 4)");
  // Broadcasting never drops dims, and only size-1 dims stretch.
  EXPECT_KILN_ERROR(infer(Op::kBroadcastTo, {f32({2, 3})}, {{"shape", Ints{3}}}), "(2, 3)",
                    "(3,)");
  EXPECT_KILN_ERROR(infer(Op::kBroadcastTo, {f32({2, 1})}, {{"shape", Ints{1, 1}}}), "(2, 1)",
                    "(1, 1)");
  EXPECT_KILN_ERROR(infer(Op::kBroadcastTo, {f32({3})}, {{"shape", Ints{-1, 3}}}), "negative");
}

TEST(ShapeBroadcastTo, Kernel) {
  // x (3, 1) = [[1], [2], [3]] -> (2, 3, 2): y[a][b][c] = x[b].
  Tensor x = make(DType::kI64, {3, 1}, {1, 2, 3});
  Tensor y = run_reference(Op::kBroadcastTo, {x}, {{"shape", Ints{2, 3, 2}}})[0];
  EXPECT_TRUE(all_close(y, make(DType::kI64, {2, 3, 2}, {1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3}), 0, 0));
}

// ---------------------------------------------------------------- slice

Attributes slice_attrs(Ints starts, Ints ends, Ints steps = {}) {
  Attributes a{{"starts", std::move(starts)}, {"ends", std::move(ends)}};
  if (!steps.empty()) a.set("steps", std::move(steps));
  return a;
}

TEST(ShapeSlice, InfersShapes) {
  EXPECT_EQ(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({1, 0}, {3, 6}))[0], f32({2, 6}));
  EXPECT_EQ(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({1, 0}, {3, 6}, {1, 2}))[0],
            f32({2, 3}));
  EXPECT_EQ(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({0, 0}, {4, 6}, {3, 4}))[0],
            f32({2, 2}));  // ceil(4 / 3), ceil(6 / 4)
  // Negative start/end count from the end.
  EXPECT_EQ(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({-3, -6}, {-1, 6}))[0], f32({2, 6}));
  EXPECT_EQ(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({2, 0}, {2, 6}))[0], f32({0, 6}));
  EXPECT_EQ(infer(Op::kSlice, {of(DType::kU8, {})}, slice_attrs({}, {}))[0], of(DType::kU8, {}));
}

TEST(ShapeSlice, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({0}, {4, 6})), "slice",
                    "starts [0]", "1 entries", "(4, 6)");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({0, 0}, {4, 6}, {1, 1, 1})),
                    "steps [1, 1, 1]", "3 entries");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({5, 0}, {4, 6})), "axis 0",
                    "start 5", "dim 4");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({-5, 0}, {4, 6})), "axis 0",
                    "start -5", "dim 4");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({0, 0}, {4, -7})), "axis 1",
                    "end -7", "dim 6");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({0, 0}, {4, 7})), "axis 1",
                    "end 7", "dim 6");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({3, 0}, {1, 6})), "axis 0",
                    "start 3", "end 1", "dim 4");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, slice_attrs({0, 0}, {4, 6}, {1, 0})),
                    "axis 1", "step 0");
  EXPECT_KILN_ERROR(infer(Op::kSlice, {f32({4, 6})}, {{"starts", Ints{0, 0}}}), "ends",
                    "missing");
}

TEST(ShapeSlice, KernelWithSteps) {
  // x (3, 4) = 0..11; rows 0, 2 and cols 1, 3.
  Tensor y = run_reference(Op::kSlice, {iota(DType::kF32, {3, 4})},
                           slice_attrs({0, 1}, {3, 4}, {2, 2}))[0];
  EXPECT_TRUE(all_close(y, make(DType::kF32, {2, 2}, {1, 3, 9, 11}), 0, 0));
}

TEST(ShapeSlice, KernelWithNegativeIndices) {
  // Row -1 (= 2), cols -3..-1 (= 1..3).
  Tensor y = run_reference(Op::kSlice, {iota(DType::kI32, {3, 4})},
                           slice_attrs({-1, -3}, {3, -1}))[0];
  EXPECT_TRUE(all_close(y, make(DType::kI32, {1, 2}, {9, 10}), 0, 0));
}

// ---------------------------------------------------------------- concat

TEST(ShapeConcat, InfersShapes) {
  EXPECT_EQ(infer(Op::kConcat, {f32({2, 3}), f32({2, 5})}, {{"axis", int64_t{1}}})[0],
            f32({2, 8}));
  EXPECT_EQ(infer(Op::kConcat, {f32({2, 3}), f32({2, 5})}, {{"axis", int64_t{-1}}})[0],
            f32({2, 8}));
  EXPECT_EQ(infer(Op::kConcat, {f32({1, 3}), f32({2, 3}), f32({3, 3})})[0], f32({6, 3}));
  EXPECT_EQ(infer(Op::kConcat, {of(DType::kI64, {2, 3})})[0], of(DType::kI64, {2, 3}));
}

TEST(ShapeConcat, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kConcat, {f32({2, 3}), of(DType::kF64, {2, 3})}), "concat",
                    "input 1 is f64, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kConcat, {f32({2, 3}), f32({2, 3, 1})}), "input 1",
                    "(2, 3, 1)", "rank 2");
  EXPECT_KILN_ERROR(infer(Op::kConcat, {f32({2, 3}), f32({3, 4})}, {{"axis", int64_t{1}}}),
                    "input 1 has shape (3, 4)", "dim 0", "(2, 3)");
  EXPECT_KILN_ERROR(infer(Op::kConcat, {f32({2, 3}), f32({2, 3})}, {{"axis", int64_t{2}}}),
                    "axis 2", "rank 2");
  EXPECT_KILN_ERROR(infer(Op::kConcat, {f32({}), f32({})}), "()", "rank >= 1");
  EXPECT_KILN_ERROR(infer(Op::kConcat, {}), "0 inputs", "at least 1");
}

TEST(ShapeConcat, Kernel) {
  Tensor a = make(DType::kF32, {2, 2}, {1, 2, 3, 4});
  Tensor b = make(DType::kF32, {2, 1}, {5, 6});
  EXPECT_TRUE(all_close(run_reference(Op::kConcat, {a, b}, {{"axis", int64_t{1}}})[0],
                        make(DType::kF32, {2, 3}, {1, 2, 5, 3, 4, 6}), 0, 0));
  Tensor c = make(DType::kF32, {1, 2}, {7, 8});
  EXPECT_TRUE(all_close(run_reference(Op::kConcat, {c, a})[0],
                        make(DType::kF32, {3, 2}, {7, 8, 1, 2, 3, 4}), 0, 0));
}

// ---------------------------------------------------------------- split

TEST(ShapeSplit, InfersShapes) {
  auto outs = infer(Op::kSplit, {f32({5, 4})}, {{"sizes", Ints{2, 3}}});
  ASSERT_EQ(outs.size(), 2u);
  EXPECT_EQ(outs[0], f32({2, 4}));
  EXPECT_EQ(outs[1], f32({3, 4}));
  outs = infer(Op::kSplit, {f32({5, 4})}, {{"axis", int64_t{-1}}, {"sizes", Ints{1, 0, 3}}});
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_EQ(outs[0], f32({5, 1}));
  EXPECT_EQ(outs[1], f32({5, 0}));
  EXPECT_EQ(outs[2], f32({5, 3}));
}

TEST(ShapeSplit, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kSplit, {f32({5, 4})}, {{"sizes", Ints{2, 2}}}), "split",
                    "[2, 2]", "sum to 4", "expected 5");
  EXPECT_KILN_ERROR(infer(Op::kSplit, {f32({5, 4})}, {{"sizes", Ints{6, -1}}}), "[6, -1]",
                    "negative");
  EXPECT_KILN_ERROR(infer(Op::kSplit, {f32({5, 4})}, {{"sizes", Ints{}}}), "sizes",
                    "at least one");
  EXPECT_KILN_ERROR(infer(Op::kSplit, {f32({5, 4})}), "sizes", "missing");
  EXPECT_KILN_ERROR(infer(Op::kSplit, {f32({5, 4})}, {{"axis", int64_t{3}}, {"sizes", Ints{5}}}),
                    "axis 3");
}

TEST(ShapeSplit, Kernel) {
  auto outs = run_reference(Op::kSplit, {make(DType::kF64, {2, 3}, {1, 2, 3, 4, 5, 6})},
                            {{"axis", int64_t{1}}, {"sizes", Ints{1, 2}}});
  ASSERT_EQ(outs.size(), 2u);
  EXPECT_TRUE(all_close(outs[0], make(DType::kF64, {2, 1}, {1, 4}), 0, 0));
  EXPECT_TRUE(all_close(outs[1], make(DType::kF64, {2, 2}, {2, 3, 5, 6}), 0, 0));
}

TEST(ShapeSplit, ConcatUndoesSplitOnRandomInput) {
  Tensor x = testing::rand(DType::kF32, {3, 7, 2}, 11);
  auto parts = run_reference(Op::kSplit, {x}, {{"axis", int64_t{1}}, {"sizes", Ints{3, 0, 4}}});
  Tensor y = run_reference(Op::kConcat, parts, {{"axis", int64_t{1}}})[0];
  EXPECT_TRUE(all_close(y, x, 0, 0));
}

// ---------------------------------------------------------------- gather

TEST(ShapeGather, InfersShapes) {
  EXPECT_EQ(infer(Op::kGather, {f32({10, 4}), of(DType::kI64, {2, 3})})[0], f32({2, 3, 4}));
  EXPECT_EQ(infer(Op::kGather, {f32({2, 5, 3}), of(DType::kI32, {4})}, {{"axis", int64_t{1}}})[0],
            f32({2, 4, 3}));
  EXPECT_EQ(infer(Op::kGather, {of(DType::kBF16, {10, 4}), of(DType::kI32, {})})[0],
            of(DType::kBF16, {4}));
}

TEST(ShapeGather, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kGather, {f32({10, 4}), f32({3})}), "gather",
                    "indices are f32, expected i32 or i64");
  EXPECT_KILN_ERROR(infer(Op::kGather, {f32({10, 4}), of(DType::kI32, {3})},
                          {{"axis", int64_t{2}}}),
                    "axis 2", "rank 2");
  EXPECT_KILN_ERROR(infer(Op::kGather, {f32({}), of(DType::kI32, {3})}), "table", "rank >= 1");
}

TEST(ShapeGather, KernelAxis0) {
  Tensor table = make(DType::kF32, {3, 2}, {1, 2, 3, 4, 5, 6});
  Tensor indices = make(DType::kI64, {3}, {2, 0, 2});
  EXPECT_TRUE(all_close(run_reference(Op::kGather, {table, indices})[0],
                        make(DType::kF32, {3, 2}, {5, 6, 1, 2, 5, 6}), 0, 0));
}

TEST(ShapeGather, KernelAxis1) {
  // y[o][p][0] = table[o][indices[p][0]]
  Tensor table = make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor indices = make(DType::kI32, {2, 1}, {2, 0});
  EXPECT_TRUE(all_close(run_reference(Op::kGather, {table, indices}, {{"axis", int64_t{1}}})[0],
                        make(DType::kF32, {2, 2, 1}, {3, 1, 6, 4}), 0, 0));
}

TEST(ShapeGather, OutOfRangeIndexThrows) {
  Tensor table = make(DType::kF32, {3, 2}, {1, 2, 3, 4, 5, 6});
  EXPECT_KILN_ERROR(run_reference(Op::kGather, {table, make(DType::kI64, {2}, {0, 3})}), "gather",
                    "index 3", "dim 3");
  EXPECT_KILN_ERROR(run_reference(Op::kGather, {table, make(DType::kI32, {1}, {-1})}),
                    "index -1", "dim 3");
}

// ---------------------------------------------------------------- scatter_add

TEST(ShapeScatterAdd, InfersShapes) {
  EXPECT_EQ(infer(Op::kScatterAdd, {f32({5, 4}), of(DType::kI32, {2, 3}), f32({2, 3, 4})})[0],
            f32({5, 4}));
  EXPECT_EQ(infer(Op::kScatterAdd, {f32({2, 5, 3}), of(DType::kI64, {4}), f32({2, 4, 3})},
                  {{"axis", int64_t{1}}})[0],
            f32({2, 5, 3}));
}

TEST(ShapeScatterAdd, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kScatterAdd, {f32({5, 4}), of(DType::kI32, {2, 3}), f32({2, 4})}),
                    "scatter_add", "updates have shape (2, 4), expected (2, 3, 4)");
  EXPECT_KILN_ERROR(infer(Op::kScatterAdd, {f32({5, 4}), of(DType::kI32, {2}),
                                            of(DType::kF64, {2, 4})}),
                    "updates are f64, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kScatterAdd, {f32({5, 4}), f32({2}), f32({2, 4})}),
                    "indices are f32");
}

TEST(ShapeScatterAdd, KernelAxis0AccumulatesRepeatedIndices) {
  Tensor base = make(DType::kF32, {3, 2}, {1, 1, 1, 1, 1, 1});
  Tensor indices = make(DType::kI32, {3}, {0, 2, 0});
  Tensor updates = make(DType::kF32, {3, 2}, {1, 2, 3, 4, 5, 6});
  // Row 0: 1 + 1 + 5, 1 + 2 + 6; row 1 untouched; row 2: 1 + 3, 1 + 4.
  EXPECT_TRUE(all_close(run_reference(Op::kScatterAdd, {base, indices, updates})[0],
                        make(DType::kF32, {3, 2}, {7, 9, 1, 1, 4, 5}), 0, 0));
}

TEST(ShapeScatterAdd, KernelAxis1) {
  Tensor base = make(DType::kF64, {2, 3}, {0, 0, 0, 0, 0, 0});
  Tensor indices = make(DType::kI64, {2}, {1, 1});
  Tensor updates = make(DType::kF64, {2, 2}, {1, 2, 3, 4});
  EXPECT_TRUE(all_close(
      run_reference(Op::kScatterAdd, {base, indices, updates}, {{"axis", int64_t{1}}})[0],
      make(DType::kF64, {2, 3}, {0, 3, 0, 0, 7, 0}), 0, 0));
}

TEST(ShapeScatterAdd, OutOfRangeIndexThrows) {
  Tensor base = make(DType::kF32, {3, 2}, {1, 1, 1, 1, 1, 1});
  Tensor updates = make(DType::kF32, {1, 2}, {1, 1});
  EXPECT_KILN_ERROR(run_reference(Op::kScatterAdd, {base, make(DType::kI32, {1}, {5}), updates}),
                    "scatter_add", "index 5", "dim 3");
  EXPECT_KILN_ERROR(run_reference(Op::kScatterAdd, {base, make(DType::kI64, {1}, {-2}), updates}),
                    "index -2");
}

TEST(ShapeScatterAdd, IsTheTransposeOfGather) {
  // <gather(x, idx), u> == <x, scatter_add(0, idx, u)> for any x, u: scatter_add is gather's
  // gradient.
  Tensor x = testing::rand(DType::kF64, {3, 5, 2}, 1);
  Tensor indices = make(DType::kI64, {2, 2}, {4, 0, 4, 2});
  Tensor u = testing::rand(DType::kF64, {3, 2, 2, 2}, 2);
  Attributes axis1{{"axis", int64_t{1}}};
  Tensor gathered = run_reference(Op::kGather, {x, indices}, axis1)[0];
  Tensor zeros(TensorType{DType::kF64, {3, 5, 2}});
  Tensor scattered = run_reference(Op::kScatterAdd, {zeros, indices, u}, axis1)[0];
  double lhs = 0, rhs = 0;
  for (int64_t i = 0; i < u.numel(); ++i) lhs += gathered.get(i) * u.get(i);
  for (int64_t i = 0; i < x.numel(); ++i) rhs += x.get(i) * scattered.get(i);
  EXPECT_NEAR(lhs, rhs, 1e-12);
  EXPECT_NE(lhs, 0.0);
}

// ---------------------------------------------------------------- one_hot

TEST(ShapeOneHot, InfersShapes) {
  EXPECT_EQ(infer(Op::kOneHot, {of(DType::kI32, {2, 3})}, {{"depth", int64_t{5}}})[0],
            f32({2, 3, 5}));
  EXPECT_EQ(infer(Op::kOneHot, {of(DType::kI64, {4})},
                  {{"depth", int64_t{3}}, {"dtype", DType::kBF16}})[0],
            of(DType::kBF16, {4, 3}));
}

TEST(ShapeOneHot, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kOneHot, {of(DType::kI32, {2})}, {{"depth", int64_t{0}}}),
                    "one_hot", "depth is 0", "> 0");
  EXPECT_KILN_ERROR(infer(Op::kOneHot, {f32({2})}, {{"depth", int64_t{3}}}), "indices are f32",
                    "integer");
  EXPECT_KILN_ERROR(infer(Op::kOneHot, {of(DType::kI32, {2})}), "depth", "missing");
}

TEST(ShapeOneHot, KernelOutOfRangeGivesZeroRow) {
  Tensor indices = make(DType::kI64, {4}, {1, 0, 3, -100});
  Tensor y = run_reference(Op::kOneHot, {indices}, {{"depth", int64_t{3}}})[0];
  EXPECT_TRUE(all_close(y, make(DType::kF32, {4, 3}, {0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0}), 0, 0));
}

}  // namespace
}  // namespace kiln
