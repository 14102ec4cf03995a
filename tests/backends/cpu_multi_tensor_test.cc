// The CPU kernels of the multi-tensor fused nodes (backends/cpu/multi_tensor.cc) and the
// run-order planning they share with the GPU (backends/multi_tensor.h):
//   - plan_run_order on made-up regions: no overlap, a chain, a cycle, a partial self-overlap;
//   - multi-tensor AdamW / SGD on odd sizes: bit for bit the per-tensor "cpu" kernel, and the
//     fused reference within f32 rounding (atol 1e-6, rtol 1e-5: f32 arithmetic against f64);
//   - results written over other members' operands (a cycle, read from copies) give the same;
//   - global norm, f32 and bf16 terms, odd sizes up to 100003: bit for bit the ungrouped nodes
//     on the executor's CPU kernels, and the fused reference within rtol 1e-5 (f32 blocked sums
//     against f64);
//   - multi-tensor cast, f32 -> bf16 and f16, odd sizes up to 100003 and special values (ties,
//     NaNs, infinities, f16 overflow and subnormals; expected bits worked out by hand): bit for
//     bit the fused reference and the ungrouped casts; cast_body's refusals;
//   - gpt2-tiny training on the CPU with and without the pass: identical without clipping,
//     within atol 1e-6 / rtol 1e-5 with --grad-clip (the norm's f32 rounding may move one ulp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "backends/multi_tensor.h"
#include "ir/text.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln {
namespace {

using multi_tensor::MemberRegions;
using multi_tensor::Region;
using testing::rand;

// ---- plan_run_order -------------------------------------------------------------------------

TEST(MultiTensorRunOrder, NoOverlapIsOneWave) {
  std::vector<std::byte> memory(64);
  const std::byte* m = memory.data();
  // Each member writes over its own operand (exactly), as the executor's in-place updates do.
  std::vector<MemberRegions> members = {{{{m, 8}, {m + 8, 8}}, {{m, 8}}}, {{{m + 16, 8}}, {{m + 16, 8}, {m + 24, 8}}}};
  const multi_tensor::RunOrder order = multi_tensor::plan_run_order(members);
  ASSERT_EQ(order.waves.size(), 1u);
  EXPECT_EQ(order.waves[0], (std::vector<int>{0, 1}));
  EXPECT_TRUE(order.copies.empty());
}

TEST(MultiTensorRunOrder, AMemberWhoseOperandIsOverwrittenRunsFirst) {
  std::vector<std::byte> memory(64);
  const std::byte* m = memory.data();
  // 0 writes over 1's operand, 1 over 2's: 2, then 1, then 0.
  std::vector<MemberRegions> members = {{{{m, 8}}, {{m + 8, 8}}},
                                        {{{m + 8, 8}}, {{m + 16, 8}}},
                                        {{{m + 16, 8}}, {{m + 32, 8}}}};
  const multi_tensor::RunOrder order = multi_tensor::plan_run_order(members);
  EXPECT_EQ(order.waves, (std::vector<std::vector<int>>{{2}, {1}, {0}}));
  EXPECT_TRUE(order.copies.empty());
}

TEST(MultiTensorRunOrder, ACycleReadsCopies) {
  std::vector<std::byte> memory(64);
  const std::byte* m = memory.data();
  // 0 writes over 1's second operand and 1 over 0's first; 2's result only partly covers its
  // own operand (not elementwise-safe: read from a copy).
  std::vector<MemberRegions> members = {{{{m, 8}, {m + 40, 4}}, {{m + 12, 4}}},
                                        {{{m + 8, 4}, {m + 12, 4}}, {{m, 8}}},
                                        {{{m + 48, 8}}, {{m + 52, 8}}}};
  const multi_tensor::RunOrder order = multi_tensor::plan_run_order(members);
  // 2 first (nothing overwrites what it reads once it reads a copy), then the cycle at once.
  EXPECT_EQ(order.waves, (std::vector<std::vector<int>>{{2}, {0, 1}}));
  EXPECT_EQ(order.copies, (std::vector<std::pair<int, int>>{{0, 0}, {1, 1}, {2, 0}}));
}

// ---- the update kernels ---------------------------------------------------------------------

struct FusedRun {
  Graph body;
  std::vector<Tensor> inputs;
};

// The body of a multi-tensor update node over params of `shapes`: (param, grad, state..., then
// the scalars once).
FusedRun update_group(const std::string& optimizer, const std::vector<Shape>& shapes, uint64_t seed) {
  FusedRun run;
  Graph& body = run.body;
  body.name = "group";
  const bool adamw = optimizer == "adamw";
  const int states = adamw ? 2 : 1;
  std::vector<std::vector<ValueId>> operands;
  std::vector<Tensor> scalars_values;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const TensorType t{DType::kF32, shapes[k]};
    std::vector<ValueId> ids;
    ids.push_back(body.add_input(fmt::format("p{}", k), t, Role::kData));
    run.inputs.push_back(rand(DType::kF32, shapes[k], seed++));
    ids.push_back(body.add_input(fmt::format("g{}", k), t, Role::kData));
    run.inputs.push_back(rand(DType::kF32, shapes[k], seed++));
    for (int s = 0; s < states; ++s) {
      ids.push_back(body.add_input(fmt::format("s{}_{}", k, s), t, Role::kData));
      // v must be >= 0; m and buf any sign.
      const bool second_moment = adamw && s == 1;
      run.inputs.push_back(rand(DType::kF32, shapes[k], seed++, second_moment ? 0.01 : -1.0, 1.0));
    }
    operands.push_back(ids);
  }
  std::vector<ValueId> scalars = {body.add_input("lr", {DType::kF32, {}}, Role::kData)};
  run.inputs.push_back(testing::make(DType::kF32, {}, {0.01}));
  scalars.push_back(body.add_input("step", {DType::kF32, {}}, Role::kData));
  run.inputs.push_back(testing::make(DType::kF32, {}, {3}));
  // Body inputs in member order then the scalars: reorder so members read them where they are.
  const Attributes attrs = adamw                  ? Attributes{{"optimizer", optimizer}, {"weight_decay", 0.1}}
                           : optimizer == "sgd" ? Attributes{{"optimizer", optimizer}, {"momentum", 0.9}, {"weight_decay", 0.01}}
                                                : Attributes{{"optimizer", optimizer}, {"weight_decay", 0.1}};
  for (auto& ids : operands) {
    ids.insert(ids.end(), scalars.begin(), scalars.end());
    for (ValueId out : body.add_node(Op::kOptimizerUpdate, ids, attrs)) body.outputs.push_back(out);
  }
  return run;
}

std::vector<Tensor> outputs_of(const Graph& body) {
  std::vector<Tensor> out;
  for (ValueId id : body.outputs) out.emplace_back(body.type(id));
  return out;
}

const KernelImpl& fused_kernel(const Node& node, const Graph& body, const std::vector<Tensor>& inputs) {
  std::vector<TensorType> in, out;
  for (const Tensor& t : inputs) in.push_back(t.type());
  for (ValueId id : body.outputs) out.push_back(body.type(id));
  return kernel_registry().select(NodeView{node, in, out}, Device::kCpu, {"cpu"});
}

void check_updates(const std::string& optimizer) {
  const std::vector<Shape> shapes = {{7, 13}, {1}, {1031}, {3}, {64, 257}};
  FusedRun run = update_group(optimizer, shapes, 40);
  auto body = std::make_shared<const Graph>(run.body);
  const Attributes attrs{{"kind", std::string("multi-tensor-update")}};
  const Node node{Op::kFused, {}, {}, attrs, body};
  const KernelImpl& impl = fused_kernel(node, *body, run.inputs);
  EXPECT_EQ(impl.dialect, "cpu");
  EXPECT_TRUE(impl.in_place_ok);
  std::vector<Tensor> got = outputs_of(*body), expected = outputs_of(*body);
  impl.kernel(KernelArgs{attrs, run.inputs, got, nullptr, body.get()});
  op_def(Op::kFused).reference(KernelArgs{attrs, run.inputs, expected, nullptr, body.get()});
  // Per member: the per-tensor fast kernel, bit for bit.
  size_t result = 0;
  for (const Node& member : body->nodes) {
    std::vector<Tensor> ins;
    for (ValueId id : member.inputs) ins.push_back(run.inputs[static_cast<size_t>(body->input_index(id))]);
    const std::vector<Tensor> alone = testing::run_dialect("cpu", Op::kOptimizerUpdate, ins, member.attrs);
    for (const Tensor& t : alone) {
      EXPECT_EQ(std::memcmp(t.raw(), got[result].raw(), t.bytes()), 0) << "result " << result;
      EXPECT_TRUE(testing::all_close(got[result], expected[result], 1e-6, 1e-5)) << "result " << result;
      ++result;
    }
  }
  EXPECT_EQ(result, got.size());

  // Results written over other members' operands: member 0's first result over member 1's
  // grad is impossible (shapes differ), so two same-shaped members: 1 ({1}) and 3 ({3}) differ
  // too; use a fresh group of equal shapes, with each member's param result over the other's
  // grad (a cycle) and its state results over its own state (in place).
  FusedRun pair = update_group(optimizer, {{5, 9}, {5, 9}}, 90);
  auto pair_body = std::make_shared<const Graph>(pair.body);
  const Node pair_node{Op::kFused, {}, {}, attrs, pair_body};
  std::vector<Tensor> clean = outputs_of(*pair_body);
  std::vector<Tensor> fresh;
  for (const Tensor& t : pair.inputs) fresh.push_back(t.clone());
  fused_kernel(pair_node, *pair_body, fresh).kernel(KernelArgs{attrs, fresh, clean, nullptr, pair_body.get()});
  const int per = optimizer == "adamw" ? 4 : 3;  // tensor operands per member
  const int results = optimizer == "adamw" ? 3 : 2;
  std::vector<Tensor> aliased(static_cast<size_t>(2 * results));
  for (int k = 0; k < 2; ++k) {
    aliased[static_cast<size_t>(k * results)] = fresh[static_cast<size_t>((1 - k) * per + 1)];  // over the other's grad
    for (int s = 1; s < results; ++s)
      aliased[static_cast<size_t>(k * results + s)] = fresh[static_cast<size_t>(k * per + 1 + s)];  // own state
  }
  fused_kernel(pair_node, *pair_body, pair.inputs)
      .kernel(KernelArgs{attrs, fresh, aliased, nullptr, pair_body.get()});
  for (size_t i = 0; i < clean.size(); ++i)
    EXPECT_EQ(std::memcmp(aliased[i].raw(), clean[i].raw(), clean[i].bytes()), 0) << "aliased result " << i;
}

TEST(CpuMultiTensor, AdamwMatchesThePerTensorKernelAndTheReference) { check_updates("adamw"); }

TEST(CpuMultiTensor, SgdMatchesThePerTensorKernelAndTheReference) { check_updates("sgd"); }

TEST(CpuMultiTensor, LionMatchesThePerTensorKernelAndTheReference) { check_updates("lion"); }

TEST(CpuMultiTensor, GlobalNormMatchesTheReference) {
  const Graph body = parse(
      "graph @norm(%a: f32[7,13] data, %b: f32[1] data, %c: bf16[1031] data, %d: f32[100003] data) {\n"
      "  %0 = square(%a) : f32[7,13]\n"
      "  %1 = sum(%0) : f32[]\n"
      "  %2 = square(%b) : f32[1]\n"
      "  %3 = sum(%2) : f32[]\n"
      "  %4 = cast(%c) {dtype=f32} : f32[1031]\n"
      "  %5 = square(%4) : f32[1031]\n"
      "  %6 = sum(%5) : f32[]\n"
      "  %7 = square(%d) : f32[100003]\n"
      "  %8 = sum(%7) : f32[]\n"
      "  %9 = add(%3, %1) : f32[]\n"
      "  %10 = add(%6, %8) : f32[]\n"
      "  %11 = add(%9, %10) : f32[]\n"
      "  return %11\n"
      "}\n");
  auto shared = std::make_shared<const Graph>(body);
  std::vector<Tensor> inputs;
  uint64_t seed = 60;
  for (const GraphInput& in : body.inputs) inputs.push_back(rand(body.type(in.value).dtype, body.type(in.value).shape, seed++));
  const Attributes attrs{{"kind", std::string("global-norm")}};
  const Node node{Op::kFused, {}, {}, attrs, shared};
  const KernelImpl& impl = fused_kernel(node, body, inputs);
  EXPECT_EQ(impl.dialect, "cpu");
  std::vector<Tensor> got = outputs_of(body), expected = outputs_of(body);
  impl.kernel(KernelArgs{attrs, inputs, got, nullptr, shared.get()});
  op_def(Op::kFused).reference(KernelArgs{attrs, inputs, expected, nullptr, shared.get()});
  EXPECT_TRUE(testing::all_close(got[0], expected[0], 0.0, 1e-5))
      << got[0].get(0) << " vs " << expected[0].get(0);
  // The same nodes, ungrouped, through the executor's choice of CPU kernels: the same bits.
  Executor executor(body);
  const std::vector<Tensor> ungrouped = executor.run(inputs);
  EXPECT_EQ(got[0].get(0), ungrouped[0].get(0));
  // About a third of the elements' mean square (1/3 for uniform [-1, 1)): a real sum.
  EXPECT_GT(expected[0].get(0), 30000.0);
}

TEST(CpuMultiTensor, SupportsOnlyItsOwnBodies) {
  // A multi-tensor kind over a body of another shape falls back to the other fused kernels.
  const Graph body = parse(
      "graph @b(%x: f32[4] data) {\n  %0 = exp(%x) : f32[4]\n  %1 = neg(%0) : f32[4]\n  return %1\n}\n");
  auto shared = std::make_shared<const Graph>(body);
  for (const char* kind : {"multi-tensor-update", "global-norm"}) {
    const Node node{Op::kFused, {}, {}, Attributes{{"kind", std::string(kind)}}, shared};
    const std::vector<TensorType> in = {{DType::kF32, {4}}}, out = in;
    const KernelImpl& impl = kernel_registry().select(NodeView{node, in, out}, Device::kCpu, {});
    EXPECT_FALSE(impl.in_place_ok) << kind;  // not the multi-tensor kernel
  }
}

// ---- casts -----------------------------------------------------------------------------------

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t bits16(const Tensor& t, int64_t i) {
  uint16_t b;
  std::memcpy(&b, t.raw() + 2 * i, 2);
  return b;
}

// Inputs of a cast group: random f32 in [-1, 1), and in the first tensor the special values
// below at its start.
struct Special {
  float x;
  uint16_t bf16, f16;  // worked out by hand from the bit patterns
};
const std::vector<Special> kSpecials = {
    {1.0f + 0x1p-8f, 0x3F80, 0x3C04},          // 0x3F808000. bf16: a tie, to even (down); f16: exact
    {from_bits(0x3F818000u), 0x3F82, 0x3C0C},  // bf16: a tie, to even (up); f16: exact (1.01171875)
    {-0.0f, 0x8000, 0x8000},
    {65504.0f, 0x4780, 0x7BFF},             // 0x477FE000: f16's largest finite; bf16 up to 65536
    {65520.0f, 0x4780, 0x7C00},             // 0x477FF000. f16: halfway to 65536, to even: infinity
    {0x1p-24f, 0x3380, 0x0001},             // f16's smallest subnormal
    {0x1p-25f, 0x3300, 0x0000},             // f16: a tie between 0 and 2^-24, to even: 0
    {3.0f * 0x1p-25f, 0x33C0, 0x0002},      // 0x33C00000. f16: 1.5 * 2^-24, a tie, to even: 2
    {from_bits(0x7F7FFFFFu), 0x7F80, 0x7C00},  // FLT_MAX: infinity in both
    {-std::numeric_limits<float>::infinity(), 0xFF80, 0xFC00},
    {from_bits(0x7FC00000u), 0x7FC0, 0x7E00},  // the quiet NaN
    {from_bits(0xFFA12345u), 0xFFE1, 0xFE00},  // a signalling NaN, negative: quieted, sign kept
};

TEST(CpuMultiTensor, CastMatchesTheReferenceAndTheUngroupedCasts) {
  // Five f32 inputs; the first is cast both to bf16 and to f16.
  const std::vector<Shape> shapes = {{7, 13}, {1}, {1031}, {3}, {100003}};
  const std::vector<DType> to = {DType::kBF16, DType::kF16, DType::kBF16, DType::kF16, DType::kBF16};
  auto body = std::make_shared<Graph>();
  body->name = "casts";
  std::vector<Tensor> inputs;
  std::vector<ValueId> xs;
  for (size_t k = 0; k < shapes.size(); ++k) {
    xs.push_back(body->add_input(fmt::format("x{}", k), {DType::kF32, shapes[k]}, Role::kData));
    inputs.push_back(rand(DType::kF32, shapes[k], 200 + k));
    body->outputs.push_back(body->add(Op::kCast, {xs.back()}, {{"dtype", to[k]}}));
  }
  body->outputs.push_back(body->add(Op::kCast, {xs[0]}, {{"dtype", DType::kF16}}));
  for (size_t i = 0; i < kSpecials.size(); ++i) inputs[0].data<float>()[i] = kSpecials[i].x;
  const Attributes attrs{{"kind", std::string("multi-tensor-cast")}};
  const Node node{Op::kFused, {}, {}, attrs, body};
  const KernelImpl& impl = fused_kernel(node, *body, inputs);
  EXPECT_EQ(impl.dialect, "cpu");
  EXPECT_FALSE(impl.in_place_ok);
  std::vector<Tensor> got = outputs_of(*body), expected = outputs_of(*body);
  impl.kernel(KernelArgs{attrs, inputs, got, nullptr, body.get()});
  op_def(Op::kFused).reference(KernelArgs{attrs, inputs, expected, nullptr, body.get()});
  Executor executor(*body);
  const std::vector<Tensor> ungrouped = executor.run(inputs);
  ASSERT_EQ(got.size(), 6u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(std::memcmp(got[i].raw(), expected[i].raw(), got[i].bytes()), 0) << "result " << i;
    EXPECT_EQ(std::memcmp(got[i].raw(), ungrouped[i].raw(), got[i].bytes()), 0) << "result " << i;
  }
  for (size_t i = 0; i < kSpecials.size(); ++i) {
    EXPECT_EQ(bits16(got[0], static_cast<int64_t>(i)), kSpecials[i].bf16) << "bf16 of special " << i;
    EXPECT_EQ(bits16(got[5], static_cast<int64_t>(i)), kSpecials[i].f16) << "f16 of special " << i;
  }
  // The random part is really rounded: |bf16(x) - x| <= 2^-8 |x| (half an ulp of an 8-bit
  // significand), and most x are not exact.
  int inexact = 0;
  for (int64_t i = 0; i < got[4].numel(); ++i) {
    const double x = inputs[4].get(i), y = got[4].get(i);
    EXPECT_LE(std::abs(y - x), std::abs(x) * 0x1p-8) << i;
    inexact += y != x;
  }
  EXPECT_GT(inexact, 90000);
}

TEST(CpuMultiTensor, CastBodyRefusesOtherBodies) {
  auto why_not = [](const std::string& text) {
    std::string why;
    EXPECT_FALSE(multi_tensor::cast_body(parse(text), &why).has_value()) << text;
    return why;
  };
  auto contains = [](const std::string& why, const std::string& fragment) {
    return ::testing::AssertionResult(why.find(fragment) != std::string::npos) << why;
  };
  EXPECT_TRUE(contains(why_not("graph @b(%x: f32[4] data) {\n  %0 = exp(%x) : f32[4]\n  return %0\n}\n"),
                                "exp"));
  EXPECT_TRUE(contains(
      why_not("graph @b(%x: bf16[4] data) {\n  %0 = cast(%x) {dtype=f32} : f32[4]\n  return %0\n}\n"),
      "a cast of a bf16 input, expected f32"));
  EXPECT_TRUE(contains(
      why_not("graph @b(%x: f32[4] data) {\n  %0 = cast(%x) {dtype=f64} : f64[4]\n  return %0\n}\n"),
      "a cast to f64, expected bf16 or f16"));
  EXPECT_TRUE(contains(
      why_not("graph @b(%x: f32[4] data) {\n  %0 = cast(%x) {dtype=bf16} : bf16[4]\n"
              "  %1 = cast(%0) {dtype=f16} : f16[4]\n  return %0, %1\n}\n"),
      "not a body input"));
  EXPECT_TRUE(contains(
      why_not("graph @b(%x: f32[4] data) {\n  %0 = cast(%x) {dtype=bf16} : bf16[4]\n"
              "  %1 = cast(%x) {dtype=f16} : f16[4]\n  return %0\n}\n"),
      "1 body outputs for 2 casts"));
  std::string why;
  const auto ok = multi_tensor::cast_body(
      parse("graph @b(%x: f32[4] data, %y: f32[2] data) {\n  %0 = cast(%y) {dtype=f16} : f16[2]\n"
            "  %1 = cast(%x) {dtype=bf16} : bf16[4]\n  return %1, %0\n}\n"),
      &why);
  ASSERT_TRUE(ok.has_value()) << why;
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[0].input, 1);
  EXPECT_EQ((*ok)[0].output, 1);
  EXPECT_EQ((*ok)[0].to, DType::kF16);
  EXPECT_EQ((*ok)[1].input, 0);
  EXPECT_EQ((*ok)[1].output, 0);
  EXPECT_EQ((*ok)[1].to, DType::kBF16);
}

// ---- training -------------------------------------------------------------------------------

std::vector<Tensor> train_steps(const Graph& forward, double clip, bool pass) {
  OptimizerConfig config;
  config.grad_clip = clip;
  config.hyper["weight_decay"] = 0.1;
  PassOptions passes;
  if (!pass) passes.disabled = {"multi-tensor"};
  train::Trainer trainer(forward, config, models::init_params(forward, 3, 1), {}, passes);
  std::vector<Tensor> out;
  for (int s = 0; s < 3; ++s)
    out.push_back(trainer.step({rand(DType::kI64, {4, 64}, 70 + s, 0, 256),
                                rand(DType::kI64, {4, 64}, 80 + s, 0, 256)})[0]);
  for (const auto& [name, t] : trainer.named_tensors()) out.push_back(t);
  return out;
}

TEST(CpuMultiTensor, Gpt2TinyTrainsTheSameWithAndWithoutThePass) {
  const Graph forward = models::by_name("gpt2-tiny", 4, 0);
  for (double clip : {0.0, 0.5}) {
    SCOPED_TRACE(fmt::format("grad clip {}", clip));
    const std::vector<Tensor> with = train_steps(forward, clip, true);
    const std::vector<Tensor> without = train_steps(forward, clip, false);
    ASSERT_EQ(with.size(), without.size());
    for (size_t i = 0; i < with.size(); ++i) {
      if (clip == 0.0)
        EXPECT_EQ(std::memcmp(with[i].raw(), without[i].raw(), with[i].bytes()), 0) << "tensor " << i;
      else
        EXPECT_TRUE(testing::all_close(with[i], without[i], 1e-6, 1e-5)) << "tensor " << i;
    }
  }
}

}  // namespace
}  // namespace kiln
