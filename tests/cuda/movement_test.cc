// The "cuda-movement" dialect (backends/cuda/movement/movement.{cu,cc}) against the CPU reference kernels
// on random inputs: reshape, transpose (rows path and tiled path), slice, concat, split,
// broadcast_to, cast and sum, for f32/bf16/f16 and the other element sizes (u8, i64) where the
// op takes any dtype; odd shapes (sizes not multiples of 8, runs that are not 16-byte multiples,
// size-1 axes, empty tensors), views that start misaligned (the narrower access paths) and the
// GPT-2 (B=32, T=1024) shapes. Every run asserts that "cuda-movement" was the kernel chosen, and
// outputs are poisoned with 0xFF bytes first, so an element left unwritten shows.
//
// Copies and casts must be bit-exact (casts: every 16-bit pattern but signaling NaNs, and f32
// ties, subnormals, overflow, NaNs). Sums accumulate in f32 in chains of a few hundred additions
// at most, so |sum - reference| <= 4e-5 * sum(|x|) (the f32 error bound n * 2^-24 * sum|x| for
// n <= 670) plus one rounding step of the storage type relative to the result (2^-23 f32,
// 2^-10 f16, 2^-7 bf16: the f32 sum and the f64 sum may round to neighbouring values).
// Fallbacks (the generic "cuda" dialect chosen) are asserted for what the dialect refuses.
// (GB/s of the generic and the movement kernels at GPT-2 shapes: bench/gpu_memory_bench.cc.)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/memory.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {


using testing::rand;

constexpr const char* kDialect = "cuda-movement";

const KernelImpl& select_kernel(Op op, const std::vector<TensorType>& in_types,
                                const Attributes& attrs, const std::vector<std::string>& dialects) {
  const std::vector<TensorType> out_types = infer_types(op, in_types, attrs);
  Node node{op, {}, {}, attrs, nullptr};
  return kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCuda, dialects);
}

// The dialect chosen for the node among all CUDA dialects.
std::string chosen(Op op, const std::vector<TensorType>& in_types, Attributes attrs = {}) {
  attrs = normalize_attributes(op, std::move(attrs));
  return select_kernel(op, in_types, attrs, {}).dialect;
}

// A device copy of `host` that starts `offset` bytes into its allocation.
Tensor device_at(const Tensor& host, size_t offset) {
  auto storage = cuda::allocate(host.bytes() + 16);
  Tensor view(host.type(), storage, offset, Device::kCuda);
  if (host.bytes() > 0)
    KILN_CUDA_CHECK(cudaMemcpy(view.raw(), host.raw(), host.bytes(), cudaMemcpyHostToDevice));
  return view;
}

// Runs `op` through "cuda-movement" (it must be the one chosen) on device copies of `inputs`
// placed `in_offset` bytes into their allocations, outputs `out_offset` bytes into theirs and
// poisoned with 0xFF; returns the outputs on the host.
std::vector<Tensor> run_movement(Op op, const std::vector<Tensor>& inputs, Attributes attrs,
                                 size_t in_offset = 0, size_t out_offset = 0) {
  attrs = normalize_attributes(op, std::move(attrs));
  std::vector<TensorType> in_types;
  for (const Tensor& t : inputs) in_types.push_back(t.type());
  const KernelImpl& impl = select_kernel(op, in_types, attrs, {kDialect});
  EXPECT_EQ(impl.dialect, kDialect);
  std::vector<Tensor> device_inputs, outputs;
  for (const Tensor& t : inputs) device_inputs.push_back(device_at(t, in_offset));
  for (const TensorType& t : infer_types(op, in_types, attrs)) {
    auto storage = cuda::allocate(t.bytes() + 16);
    KILN_CUDA_CHECK(cudaMemset(storage.get(), 0xFF, t.bytes() + 16));
    outputs.emplace_back(t, storage, out_offset, Device::kCuda);
  }
  cuda::Stream stream;
  impl.kernel(KernelArgs{attrs, device_inputs, outputs, stream.handle()});
  stream.synchronize();
  std::vector<Tensor> host;
  for (const Tensor& t : outputs) host.push_back(cuda::to_host(t));
  return host;
}

void expect_same_bits(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.type(), expected.type()) << what;
  if (actual.bytes() == 0 || std::memcmp(actual.raw(), expected.raw(), actual.bytes()) == 0)
    return;
  const size_t e = dtype_size(actual.dtype());
  for (int64_t i = 0; i < actual.numel(); ++i) {
    if (std::memcmp(actual.raw() + i * e, expected.raw() + i * e, e) != 0) {
      ADD_FAILURE() << what << ": element " << i << " of " << actual.numel() << " is "
                    << actual.get(i) << ", expected " << expected.get(i);
      return;
    }
  }
}

// The op through "cuda-movement" and through the reference: every output bit-identical.
void expect_exact(Op op, const std::vector<Tensor>& inputs, const Attributes& attrs,
                  const std::string& what, size_t in_offset = 0, size_t out_offset = 0) {
  SCOPED_TRACE(what);
  const std::vector<Tensor> expected = testing::run_reference(op, inputs, attrs);
  const std::vector<Tensor> actual = run_movement(op, inputs, attrs, in_offset, out_offset);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i)
    expect_same_bits(actual[i], expected[i], fmt::format("{}: output {}", what, i));
}

// Random values that are never zero for every dtype (integers drawn from a wide range).
Tensor random_of(DType d, Shape shape, uint64_t seed) {
  if (d == DType::kU8) return rand(d, std::move(shape), seed, 1.0, 250.0);
  if (is_integer(d)) return rand(d, std::move(shape), seed, -1e6, 1e6);
  return rand(d, std::move(shape), seed, -3.0, 3.0);
}

std::string describe(DType d, const Shape& shape, const std::string& rest = "") {
  return fmt::format("{}{} {}", dtype_name(d), to_string(shape), rest);
}

// Floats and one dtype of each other element size (1 and 8 bytes).
constexpr DType kAllSizes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kU8, DType::kI64};
constexpr DType kFloats[] = {DType::kF32, DType::kBF16, DType::kF16};

Attributes ints_attr(const char* name, std::vector<int64_t> values) {
  return Attributes{{name, std::move(values)}};
}

// ---- reshape and transpose --------------------------------------------------------------------

TEST(CudaMovement, Reshape) {
  KILN_REQUIRE_GPU();
  for (DType d : kAllSizes) {
    expect_exact(Op::kReshape, {random_of(d, {3, 5, 7}, 1)}, ints_attr("shape", {7, 15}),
                 describe(d, {3, 5, 7}));
  }
  expect_exact(Op::kReshape, {random_of(DType::kF32, {0, 4}, 2)}, ints_attr("shape", {4, 0}),
               "empty");
  expect_exact(Op::kReshape, {random_of(DType::kBF16, {32, 1024, 768}, 3)},
               ints_attr("shape", {32768, 768}), "GPT-2 bf16 (32,1024,768)");
}

struct TransposeCase {
  Shape shape;
  std::vector<int64_t> perm;
};

TEST(CudaMovement, TransposeAllPathsAndSizes) {
  KILN_REQUIRE_GPU();
  const TransposeCase cases[] = {
      {{2, 3, 4, 5}, {0, 2, 1, 3}},    // last axis stays: runs of 5 elements (misaligned)
      {{8, 16, 4}, {1, 0, 2}},         // runs of 4 elements (16 bytes in f32)
      {{3, 1, 7, 9}, {2, 1, 0, 3}},    // a size-1 axis dropped
      {{4, 6, 8, 16}, {2, 0, 1, 3}},   // merged leading axes
      {{33, 65}, {1, 0}},              // tiled, partial tiles both ways
      {{130, 200}, {1, 0}},            // tiled, several tiles each way
      {{2, 37, 70}, {0, 2, 1}},        // tiled, batched
      {{5, 6, 7}, {}},                 // [] reverses: tiled with a batch axis in the middle
      {{3, 4, 5, 6}, {3, 1, 2, 0}},    // tiled, two batch axes
      {{4, 1, 6}, {2, 1, 0}},          // tiled after dropping the size-1 axis
      {{1, 1, 5}, {2, 0, 1}},          // only one real axis: a flat copy
      {{6, 5}, {-1, -2}},              // negative perm entries
      {{7}, {0}},                      // rank 1
      {{}, {}},                        // a scalar
      {{0, 3}, {1, 0}},                // empty
  };
  for (DType d : kAllSizes) {
    uint64_t seed = 10;
    for (const TransposeCase& c : cases) {
      expect_exact(Op::kTranspose, {random_of(d, c.shape, seed++)}, ints_attr("perm", c.perm),
                   describe(d, c.shape, fmt::format("perm {}", to_string(c.perm))));
    }
  }
}

TEST(CudaMovement, TransposeMisalignedViews) {
  KILN_REQUIRE_GPU();
  // Input and output 2 (bf16) or 4 (f32) bytes into their allocations: narrower accesses.
  for (DType d : {DType::kF32, DType::kBF16}) {
    const size_t e = dtype_size(d);
    expect_exact(Op::kTranspose, {random_of(d, {6, 10, 4, 16}, 30)},
                 ints_attr("perm", {0, 2, 1, 3}), describe(d, {6, 10, 4, 16}, "rows, misaligned"),
                 e, 3 * e);
    expect_exact(Op::kTranspose, {random_of(d, {3, 40, 50}, 31)}, ints_attr("perm", {0, 2, 1}),
                 describe(d, {3, 40, 50}, "tiled, misaligned"), e, e);
  }
}

TEST(CudaMovement, TransposeGpt2Heads) {
  KILN_REQUIRE_GPU();
  // (B, T, H, D) -> (B, H, T, D) and back: the attention head split and merge.
  const Shape btnd{32, 1024, 12, 64};
  expect_exact(Op::kTranspose, {random_of(DType::kBF16, btnd, 40)}, ints_attr("perm", {0, 2, 1, 3}),
               "GPT-2 bf16 (32,1024,12,64) perm (0,2,1,3)");
  expect_exact(Op::kTranspose, {random_of(DType::kF32, {32, 12, 1024, 64}, 41)},
               ints_attr("perm", {0, 2, 1, 3}), "GPT-2 f32 (32,12,1024,64) perm (0,2,1,3)");
  // A weight-sized matrix transpose (tiled).
  expect_exact(Op::kTranspose, {random_of(DType::kBF16, {768, 2304}, 42)},
               ints_attr("perm", {1, 0}), "bf16 (768,2304) perm (1,0)");
  EXPECT_EQ(chosen(Op::kTranspose, {{DType::kBF16, btnd}}, ints_attr("perm", {0, 2, 1, 3})),
            kDialect);
}

// ---- slice, concat, split, broadcast_to ----------------------------------------------------------

TEST(CudaMovement, Slice) {
  KILN_REQUIRE_GPU();
  struct Case {
    Shape shape;
    std::vector<int64_t> starts, ends, steps;
  };
  const Case cases[] = {
      {{7, 9, 11}, {1, 2, 3}, {6, 9, 10}, {}},       // every axis sliced
      {{7, 9, 11}, {0, 0, 1}, {7, 9, 11}, {}},       // last axis only: rows start misaligned
      {{7, 9, 11}, {-5, 1, 0}, {-1, -2, 11}, {}},    // negative starts and ends
      {{10, 6, 8}, {1, 0, 0}, {10, 6, 8}, {3, 2, 1}},  // steps on outer axes
      {{5, 4}, {2, 0}, {2, 4}, {}},                  // empty result
      {{32, 1024, 2304}, {0, 0, 768}, {32, 1024, 1536}, {}},  // GPT-2: the K block of QKV
  };
  for (DType d : kAllSizes) {
    uint64_t seed = 50;
    for (const Case& c : cases) {
      if (numel(c.shape) > 1'000'000 && d != DType::kBF16) continue;
      Attributes attrs{{"starts", c.starts}, {"ends", c.ends}, {"steps", c.steps}};
      expect_exact(Op::kSlice, {random_of(d, c.shape, seed++)}, attrs,
                   describe(d, c.shape, fmt::format("starts {}", to_string(c.starts))));
    }
  }
}

TEST(CudaMovement, ConcatAndSplit) {
  KILN_REQUIRE_GPU();
  for (DType d : kAllSizes) {
    // Along the last axis (odd widths), the middle one and the first one.
    for (int64_t axis : {-1, 1, 0}) {
      std::vector<Tensor> parts;
      std::vector<int64_t> sizes;
      uint64_t seed = 60;
      for (int64_t width : {7, 2, 1, 0, 9}) {
        Shape shape{3, 5, 4};
        shape[axis < 0 ? 2 : axis] = width;
        parts.push_back(random_of(d, shape, seed++));
        sizes.push_back(width);
      }
      const Attributes axis_attr{{"axis", axis}};
      expect_exact(Op::kConcat, parts, axis_attr, describe(d, {3, 5, 4}, fmt::format("concat axis {}", axis)));
      const Tensor whole = testing::run_reference(Op::kConcat, parts, axis_attr)[0];
      expect_exact(Op::kSplit, {whole}, Attributes{{"axis", axis}, {"sizes", sizes}},
                   describe(d, whole.shape(), fmt::format("split axis {}", axis)));
    }
  }
  // Misaligned: 2-byte offsets on bf16 with odd widths.
  expect_exact(Op::kConcat, {random_of(DType::kBF16, {4, 3}, 70), random_of(DType::kBF16, {4, 5}, 71)},
               Attributes{{"axis", int64_t{1}}}, "bf16 concat misaligned", 2, 2);
  expect_exact(Op::kSplit, {random_of(DType::kBF16, {4, 9}, 72)},
               Attributes{{"axis", int64_t{1}}, {"sizes", std::vector<int64_t>{3, 6}}},
               "bf16 split misaligned", 2, 2);
}

TEST(CudaMovement, ConcatAndSplitGpt2Qkv) {
  KILN_REQUIRE_GPU();
  const Shape qkv{32, 1024, 2304};
  const Attributes split_attrs{{"axis", int64_t{-1}}, {"sizes", std::vector<int64_t>{768, 768, 768}}};
  const Tensor x = random_of(DType::kBF16, qkv, 80);
  expect_exact(Op::kSplit, {x}, split_attrs, "GPT-2 bf16 split (32,1024,2304) into 3x768");
  const std::vector<Tensor> parts = testing::run_reference(Op::kSplit, {x}, split_attrs);
  expect_exact(Op::kConcat, parts, Attributes{{"axis", int64_t{-1}}},
               "GPT-2 bf16 concat 3x(32,1024,768)");
  EXPECT_EQ(chosen(Op::kSplit, {{DType::kBF16, qkv}}, split_attrs), kDialect);
}

TEST(CudaMovement, BroadcastTo) {
  KILN_REQUIRE_GPU();
  struct Case {
    Shape from, to;
  };
  const Case cases[] = {
      {{7}, {5, 7}},              // leading axis (row broadcast)
      {{5, 1}, {5, 7}},           // innermost axis (column broadcast): one element per row
      {{3, 1, 4}, {2, 3, 5, 4}},  // leading and middle axes, last kept
      {{1, 3, 1}, {4, 3, 6}},     // outer and innermost
      {{1}, {9}},                 // a single element everywhere
      {{}, {2, 3}},               // a scalar
      {{2, 3}, {2, 3}},           // nothing to broadcast
      {{3, 1}, {3, 0}},           // empty
  };
  for (DType d : kAllSizes) {
    uint64_t seed = 90;
    for (const Case& c : cases) {
      expect_exact(Op::kBroadcastTo, {random_of(d, c.from, seed++)}, ints_attr("shape", c.to),
                   describe(d, c.from, fmt::format("to {}", to_string(c.to))));
    }
  }
  // Misaligned: the column broadcast with a narrower access, the row one with odd rows.
  expect_exact(Op::kBroadcastTo, {random_of(DType::kF32, {6, 1}, 99)}, ints_attr("shape", {6, 10}),
               "f32 column broadcast misaligned", 4, 4);
  expect_exact(Op::kBroadcastTo, {random_of(DType::kBF16, {5}, 98)}, ints_attr("shape", {3, 5}),
               "bf16 row broadcast misaligned", 2, 2);
  // GPT-2: a bias over (B, T, C).
  expect_exact(Op::kBroadcastTo, {random_of(DType::kBF16, {768}, 97)},
               ints_attr("shape", {32, 1024, 768}), "GPT-2 bf16 (768) -> (32,1024,768)");
}

TEST(CudaMovement, FallsBackWhereItShould) {
  KILN_REQUIRE_GPU();
  // A step on the innermost axis: no contiguous rows.
  EXPECT_EQ(chosen(Op::kSlice, {{DType::kF32, {4, 8}}},
                   Attributes{{"starts", std::vector<int64_t>{0, 0}},
                              {"ends", std::vector<int64_t>{4, 8}},
                              {"steps", std::vector<int64_t>{1, 2}}}),
            "cuda");
  // Casts outside f32/bf16/f16, and an identity cast.
  EXPECT_EQ(chosen(Op::kCast, {{DType::kF64, {8}}}, Attributes{{"dtype", DType::kF32}}), "cuda");
  EXPECT_EQ(chosen(Op::kCast, {{DType::kF32, {8}}}, Attributes{{"dtype", DType::kI32}}), "cuda");
  EXPECT_EQ(chosen(Op::kCast, {{DType::kF32, {8}}}, Attributes{{"dtype", DType::kF32}}), "cuda");
  // Sums over axes that are not one middle block, and integer sums.
  EXPECT_EQ(chosen(Op::kSum, {{DType::kF32, {4, 5, 6}}}, ints_attr("axes", {0, 2})), "cuda");
  EXPECT_EQ(chosen(Op::kSum, {{DType::kI32, {4, 5}}}, ints_attr("axes", {0})), "cuda");
  // And the fast ones are chosen.
  EXPECT_EQ(chosen(Op::kCast, {{DType::kF32, {8}}}, Attributes{{"dtype", DType::kBF16}}), kDialect);
  EXPECT_EQ(chosen(Op::kSum, {{DType::kF32, {32768, 2304}}}, ints_attr("axes", {0})), kDialect);
  EXPECT_EQ(chosen(Op::kReshape, {{DType::kBF16, {4, 6}}}, ints_attr("shape", {24})), kDialect);
}

// ---- cast ------------------------------------------------------------------------------------------

// A host tensor of `dtype` whose element bits are `bits` (16-bit or 32-bit patterns).
template <typename Bits>
Tensor from_bits(DType dtype, const std::vector<Bits>& bits) {
  Tensor t(TensorType{dtype, {static_cast<int64_t>(bits.size())}});
  std::memcpy(t.raw(), bits.data(), bits.size() * sizeof(Bits));
  return t;
}

TEST(CudaMovement, CastRandomOddSizesAndMisaligned) {
  KILN_REQUIRE_GPU();
  for (DType from : kFloats) {
    for (DType to : kFloats) {
      if (from == to) continue;
      uint64_t seed = 100;
      for (int64_t n : {1, 7, 8, 9, 1000, 1001, 65543}) {
        const Attributes attrs{{"dtype", to}};
        const Tensor x = rand(from, {n}, seed++, -70000.0, 70000.0);  // beyond f16's range too
        const std::string what = fmt::format("{} -> {} n={}", dtype_name(from), dtype_name(to), n);
        expect_exact(Op::kCast, {x}, attrs, what);
        expect_exact(Op::kCast, {x}, attrs, what + " misaligned", dtype_size(from),
                     dtype_size(to));
      }
    }
  }
}

TEST(CudaMovement, CastEverySixteenBitPattern) {
  KILN_REQUIRE_GPU();
  // All 65536 patterns of f16 and bf16 (zeros, subnormals, infinities, quiet NaNs with
  // payloads) to the other two types. Signaling NaNs are left out: the reference quiets them
  // in its f32 -> f64 conversion, which the compiler may fold away.
  for (DType from : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> bits;
    for (uint32_t b = 0; b < 65536; ++b) {
      const bool f16 = from == DType::kF16;
      const uint32_t exp_mask = f16 ? 0x7c00u : 0x7f80u, man_mask = f16 ? 0x3ffu : 0x7fu;
      const uint32_t quiet = f16 ? 0x200u : 0x40u;
      const bool nan = (b & exp_mask) == exp_mask && (b & man_mask) != 0;
      if (nan && (b & quiet) == 0) continue;
      bits.push_back(static_cast<uint16_t>(b));
    }
    const Tensor x = from_bits(from, bits);
    for (DType to : kFloats) {
      if (to == from) continue;
      expect_exact(Op::kCast, {x}, Attributes{{"dtype", to}},
                   fmt::format("every {} pattern -> {}", dtype_name(from), dtype_name(to)));
    }
  }
}

TEST(CudaMovement, CastF32SpecialValuesAndRandomBits) {
  KILN_REQUIRE_GPU();
  std::vector<uint32_t> bits = {
      0x00000000u, 0x80000000u,  // signed zeros
      0x7f800000u, 0xff800000u,  // infinities
      0x7fc00000u, 0xffc12345u,  // quiet NaNs with payloads
      0x3f808000u, 0x3f818000u,  // bf16 ties: to even down, to even up
      0x3f801000u, 0x3f803000u,  // f16 ties
      0x477fe000u, 0x477ff000u, 0x477fefffu,  // f16: 65504, 65520 (ties to inf), just below
      0x33000000u, 0x33000001u, 0x387fc000u,  // f16 subnormal rounding
      0x00000001u, 0x807fffffu,               // f32 subnormals
      0x7f7fffffu, 0xff7fffffu,               // f32 max (bf16 rounds it to inf)
  };
  uint64_t state = 0x9e3779b97f4a7c15ull;  // splitmix64: every exponent, sign and mantissa
  for (int i = 0; i < 200000; ++i) {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    bits.push_back(static_cast<uint32_t>(z ^ (z >> 31)));
  }
  const Tensor x = from_bits(DType::kF32, bits);
  for (DType to : {DType::kBF16, DType::kF16})
    expect_exact(Op::kCast, {x}, Attributes{{"dtype", to}},
                 fmt::format("f32 special values and random bits -> {}", dtype_name(to)));
}

TEST(CudaMovement, CastGpt2Activations) {
  KILN_REQUIRE_GPU();
  const Tensor x = rand(DType::kF32, {32, 1024, 768}, 110, -4.0, 4.0);
  expect_exact(Op::kCast, {x}, Attributes{{"dtype", DType::kBF16}}, "GPT-2 f32 -> bf16");
  const Tensor y = rand(DType::kBF16, {32, 1024, 768}, 111, -4.0, 4.0);
  expect_exact(Op::kCast, {y}, Attributes{{"dtype", DType::kF32}}, "GPT-2 bf16 -> f32");
}

// ---- sum -------------------------------------------------------------------------------------------

double storage_step(DType d) {
  switch (d) {
    case DType::kBF16: return std::ldexp(1.0, -7);
    case DType::kF16: return std::ldexp(1.0, -10);
    default: return std::ldexp(1.0, -23);
  }
}

void expect_sum_close(const Tensor& x, const Attributes& attrs, const std::string& what,
                      size_t in_offset = 0) {
  SCOPED_TRACE(what);
  const Tensor expected = testing::run_reference(Op::kSum, {x}, attrs)[0];
  // sum(|x|) per output, in f64.
  Tensor abs_x(TensorType{DType::kF64, x.shape()});
  for (int64_t i = 0; i < x.numel(); ++i) abs_x.set(i, std::fabs(x.get(i)));
  const Tensor magnitude = testing::run_reference(Op::kSum, {abs_x}, attrs)[0];
  const Tensor actual = run_movement(Op::kSum, {x}, attrs, in_offset)[0];
  ASSERT_EQ(actual.type(), expected.type());
  const double step = storage_step(x.dtype());
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double a = actual.get(i), e = expected.get(i);
    const double bound = 4e-5 * magnitude.get(i) + step * std::fabs(e) + 1e-30;
    if (!(std::fabs(a - e) <= bound)) {
      ADD_FAILURE() << "output " << i << " of " << actual.numel() << " is " << a << ", expected "
                    << e << " (bound " << bound << ")";
      return;
    }
  }
}

TEST(CudaMovement, SumShapes) {
  KILN_REQUIRE_GPU();
  struct Case {
    Shape shape;
    std::vector<int64_t> axes;
    bool keepdims;
  };
  const Case cases[] = {
      {{37, 129}, {0}, false},        // column sum, odd width: scalar loads
      {{1000, 256}, {0}, false},      // column sum, vector loads, several splits
      {{3, 5000, 64}, {-2}, true},    // (outer, reduced, inner)
      {{2, 3, 7, 40}, {0, 1}, false}, // leading axes merged
      {{300, 70}, {1}, false},        // row sums
      {{5, 4097}, {-1}, false},       // long odd rows: scalar loads, several segments
      {{4, 8192}, {1}, true},         // long rows, vector loads
      {{100003}, {}, false},          // everything
      {{7, 1, 5}, {1}, false},        // only a size-1 axis: nothing summed
      {{1, 6, 1}, {0, 2}, true},      // size-1 axes around a kept one
      {{6, 0, 3}, {1}, false},        // over an empty axis: zeros
      {{0, 4}, {1}, false},           // an empty result
  };
  for (DType d : kFloats) {
    uint64_t seed = 120;
    for (const Case& c : cases) {
      const Attributes attrs{{"axes", c.axes}, {"keepdims", c.keepdims}};
      expect_sum_close(rand(d, c.shape, seed++, -1.0, 1.0), attrs,
                       describe(d, c.shape, fmt::format("axes {}", to_string(c.axes))));
    }
    // A misaligned input (scalar loads).
    expect_sum_close(rand(d, {64, 256}, 140, -1.0, 1.0), Attributes{{"axes", std::vector<int64_t>{0}}},
                     describe(d, {64, 256}, "misaligned column sum"), dtype_size(d));
    expect_sum_close(rand(d, {8, 4096}, 141, -1.0, 1.0), Attributes{{"axes", std::vector<int64_t>{1}}},
                     describe(d, {8, 4096}, "misaligned row sum"), dtype_size(d));
  }
}

TEST(CudaMovement, SumGpt2ShapesAndDeterminism) {
  KILN_REQUIRE_GPU();
  // The bias gradients: f32 (B*T, 3C) over rows, bf16 (B, T, C) over (B, T).
  const Tensor qkv = rand(DType::kF32, {32768, 2304}, 150, -1.0, 1.0);
  const Attributes rows{{"axes", std::vector<int64_t>{0}}};
  expect_sum_close(qkv, rows, "GPT-2 f32 (32768,2304) axes [0]");
  expect_sum_close(rand(DType::kBF16, {32, 1024, 768}, 151, -1.0, 1.0),
                   Attributes{{"axes", std::vector<int64_t>{0, 1}}},
                   "GPT-2 bf16 (32,1024,768) axes [0,1]");
  // The same input twice: the same bits.
  const Tensor first = run_movement(Op::kSum, {qkv}, rows)[0];
  const Tensor second = run_movement(Op::kSum, {qkv}, rows)[0];
  expect_same_bits(second, first, "second run of the same sum");
}

}  // namespace
}  // namespace kiln
