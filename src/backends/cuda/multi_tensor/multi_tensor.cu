// Kernels and launchers of the multi-tensor ops (declared in multi_tensor.cuh): optimizer
// updates (every elementwise rule of ops/optimizer/rules.h) over a table of tensors, the global
// sum of squares, and f32 -> bf16/f16 casts. See the header for the table layout.
//
// Updates: 256 threads per block, kChunk elements of one tensor per block, in 4-element chunks
// (16 bytes of f32; the per-tensor kernels of nn.cu use the same 4-element chunks, since a
// group may mix 16- and 32-bit operands) when every pointer of the tensor is aligned to its
// chunk, else element by element; the tensor's last < 4 elements element by element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/common/float_bits.cuh"
#include "backends/cuda/common/elements.cuh"
#include "backends/cuda/multi_tensor/multi_tensor.cuh"
#include "backends/cuda/common/scratch.cuh"

namespace kiln::cuda::multi_tensor {
namespace {

using bf16 = __nv_bfloat16;
using f16 = __half;

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;  // elements per block: 16 four-element chunks per thread
constexpr int kVec = 4;
constexpr int kWarp = 32;

// to_f / from_f / load / store: elements.cuh.

__device__ __forceinline__ double load_scalar(const void* p, DType t) {
  switch (t) {
    case DType::kF64:
      return *static_cast<const double*>(p);
    case DType::kF16:
      return __half2float(*static_cast<const f16*>(p));
    case DType::kBF16:
      return __bfloat162float(*static_cast<const bf16*>(p));
    default:
      return *static_cast<const float*>(p);
  }
}

// ---- the tensor table -----------------------------------------------------------------------

template <int kIn, int kOut>
struct Table {
  const void* in[kMaxTensorsPerLaunch][kIn];
  void* out[kMaxTensorsPerLaunch][kOut];
  int64_t n[kMaxTensorsPerLaunch];
  int64_t first_block[kMaxTensorsPerLaunch + 1];  // prefix sums of the blocks per tensor
  bool vec[kMaxTensorsPerLaunch];
  int count;
};
static_assert(sizeof(Table<2 + optim::kMaxSlots, 1 + optim::kMaxSlots>) + 64 <= 32764,
              "the update table must fit a kernel parameter");

// The tensor block `b` works on (first_block is sorted; tensors without blocks are skipped).
template <typename T>
__device__ __forceinline__ int tensor_of_block(const T& table, int64_t b) {
  int lo = 0, hi = table.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_block[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Calls fn(i, N-tag) over the block's elements: 4-element chunks when vec, then single ones.
template <typename Fn>
__device__ __forceinline__ void for_block_elements(int64_t start, int64_t end, bool vec, Fn&& fn) {
  int64_t scalar_from = start;
  if (vec) {
    const int64_t full = start + (end - start) / kVec * kVec;
    for (int64_t i = start + static_cast<int64_t>(threadIdx.x) * kVec; i < full;
         i += static_cast<int64_t>(blockDim.x) * kVec)
      fn(i, std::integral_constant<int, kVec>{});
    scalar_from = full;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x)
    fn(i, std::integral_constant<int, 1>{});
}

// ---- updates --------------------------------------------------------------------------------

// Param, grad and up to kMaxSlots state slots in; param and slots out (unused columns null).
using UpdateTable = Table<2 + optim::kMaxSlots, 1 + optim::kMaxSlots>;

// No __restrict__: results may be written over their own operands (the executor's in-place
// updates); each element is read before it is written, by the same thread. The per-step
// constants and the element update are the rule's (ops/optimizer/rules.h), as in nn.cu's
// update_kernel.
template <class Rule, typename P, typename G, typename S>
__global__ void __launch_bounds__(kThreads)
    update_multi_kernel(const __grid_constant__ UpdateTable table, optim::HyperValues h, const void* lr_ptr,
                        DType lr_t, const void* step_ptr, DType step_t) {
  constexpr int kSlots = Rule::kSlots;
  const int t = tensor_of_block(table, blockIdx.x);
  const int64_t start = (blockIdx.x - table.first_block[t]) * kChunk;
  const int64_t end = table.n[t] < start + kChunk ? table.n[t] : start + kChunk;
  const P* param = static_cast<const P*>(table.in[t][0]);
  const G* grad = static_cast<const G*>(table.in[t][1]);
  P* param_out = static_cast<P*>(table.out[t][0]);
  const auto c = Rule::template prepare<float>(h, load_scalar(lr_ptr, lr_t), load_scalar(step_ptr, step_t));
  for_block_elements(start, end, table.vec[t], [&](int64_t i, auto width) {
    constexpr int N = decltype(width)::value;
    float p[N], g[N], s[kSlots][N];
    if constexpr (N == kVec) {
      load<N>(param + i, p);
      load<N>(grad + i, g);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) load<N>(static_cast<const S*>(table.in[t][2 + j]) + i, s[j]);
    } else {
      p[0] = to_f(param[i]);
      g[0] = to_f(grad[i]);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) s[j][0] = to_f(static_cast<const S*>(table.in[t][2 + j])[i]);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float si[kSlots];
#pragma unroll
      for (int j = 0; j < kSlots; ++j) si[j] = s[j][k];
      p[k] = Rule::apply(c, p[k], g[k], si);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) s[j][k] = si[j];
    }
    if constexpr (N == kVec) {
      store<N>(param_out + i, p);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) store<N>(static_cast<S*>(table.out[t][1 + j]) + i, s[j]);
    } else {
      param_out[i] = from_f<P>(p[0]);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) static_cast<S*>(table.out[t][1 + j])[i] = from_f<S>(s[j][0]);
    }
  });
}

// ---- global norm ----------------------------------------------------------------------------

struct NormTable {
  const void* x[kMaxTensorsPerLaunch];
  int64_t n[kMaxTensorsPerLaunch];
  int64_t first_block[kMaxTensorsPerLaunch + 1];
  DType t[kMaxTensorsPerLaunch];
  bool vec[kMaxTensorsPerLaunch];
  int count;
  int64_t partial_offset;  // this launch's first block in the partials array
};
static_assert(sizeof(NormTable) + 64 <= 32764, "the norm table must fit a kernel parameter");

struct NormFinish {
  int first_partial[kMaxNormTerms + 1];  // per term: its partials [first, next first)
  int adds[2 * kMaxNormTerms];
  int count, num_adds, result;
};
static_assert(sizeof(NormFinish) + 64 <= 32764, "the norm program must fit a kernel parameter");

// Sum of a double over the block, the same bits in every run: butterfly shuffles per warp,
// then the warp sums in warp order. Valid in thread 0.
__device__ double block_sum(double v) {
  __shared__ double warp_sums[kThreads / kWarp];
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarp); ++w) total += warp_sums[w];
  return total;
}

template <typename T>
__device__ __forceinline__ double sum_squares(const T* x, int64_t start, int64_t end, bool vec) {
  constexpr int N = 16 / sizeof(T);
  double acc = 0;
  int64_t scalar_from = start;
  if (vec) {
    const int64_t full = start + (end - start) / N * N;
    for (int64_t i = start + static_cast<int64_t>(threadIdx.x) * N; i < full;
         i += static_cast<int64_t>(blockDim.x) * N) {
      float v[N];
      load<N>(x + i, v);
#pragma unroll
      for (int k = 0; k < N; ++k) acc += static_cast<double>(__fmul_rn(v[k], v[k]));
    }
    scalar_from = full;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
    const float v = to_f(x[i]);
    acc += static_cast<double>(__fmul_rn(v, v));
  }
  return acc;
}

__global__ void __launch_bounds__(kThreads)
    norm_partials_kernel(const __grid_constant__ NormTable table, double* partials) {
  const int t = tensor_of_block(table, blockIdx.x);
  const int64_t start = (blockIdx.x - table.first_block[t]) * kChunk;
  const int64_t end = table.n[t] < start + kChunk ? table.n[t] : start + kChunk;
  double acc = 0;
  switch (table.t[t]) {
    case DType::kBF16:
      acc = sum_squares(static_cast<const bf16*>(table.x[t]), start, end, table.vec[t]);
      break;
    case DType::kF16:
      acc = sum_squares(static_cast<const f16*>(table.x[t]), start, end, table.vec[t]);
      break;
    default:
      acc = sum_squares(static_cast<const float*>(table.x[t]), start, end, table.vec[t]);
      break;
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[table.partial_offset + blockIdx.x] = total;
}

// One block of 1024 threads: warp w sums the partials of terms w, w + 32, ... (lanes stride,
// then butterfly), rounds to f32; thread 0 then runs the add tree in f32.
__global__ void __launch_bounds__(1024)
    norm_finish_kernel(const __grid_constant__ NormFinish program, const double* partials,
                       float* out) {
  __shared__ float terms[kMaxNormTerms];
  __shared__ float sums[kMaxNormTerms];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  for (int term = warp; term < program.count; term += warps) {
    double acc = 0;
    for (int p = program.first_partial[term] + lane; p < program.first_partial[term + 1]; p += kWarp)
      acc += partials[p];
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) terms[term] = static_cast<float>(acc);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  auto value = [&](int code) { return code >= 0 ? terms[code] : sums[-1 - code]; };
  for (int a = 0; a < program.num_adds; ++a)
    sums[a] = __fadd_rn(value(program.adds[2 * a]), value(program.adds[2 * a + 1]));
  *out = value(program.result);
}

// ---- casts ----------------------------------------------------------------------------------

struct CastTable {
  const float* x[kMaxTensorsPerLaunch];
  void* y[kMaxTensorsPerLaunch];
  int64_t n[kMaxTensorsPerLaunch];
  int64_t first_block[kMaxTensorsPerLaunch + 1];
  bool vec[kMaxTensorsPerLaunch];
  bool f16[kMaxTensorsPerLaunch];  // else bf16
  int count;
};
static_assert(sizeof(CastTable) + 64 <= 32764, "the cast table must fit a kernel parameter");

constexpr int kCastVec = 8;  // elements per vector step: 32 bytes of f32 in, 16 bytes out

template <bool kF16>
__device__ __forceinline__ void cast_range(const float* x, unsigned short* y, int64_t start, int64_t end,
                                           bool vec) {
  auto one = [](float f) { return kF16 ? f32_to_f16(f) : f32_to_bf16(f); };
  int64_t scalar_from = start;
  if (vec) {
    // start is a multiple of kChunk (of kCastVec): every step is 16-byte aligned.
    const int64_t full = start + (end - start) / kCastVec * kCastVec;
    for (int64_t i = start + static_cast<int64_t>(threadIdx.x) * kCastVec; i < full;
         i += static_cast<int64_t>(blockDim.x) * kCastVec) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(x + i));
      const float4 b = __ldg(reinterpret_cast<const float4*>(x + i) + 1);
      uint4 out;
      out.x = static_cast<uint32_t>(one(a.x)) | (static_cast<uint32_t>(one(a.y)) << 16);
      out.y = static_cast<uint32_t>(one(a.z)) | (static_cast<uint32_t>(one(a.w)) << 16);
      out.z = static_cast<uint32_t>(one(b.x)) | (static_cast<uint32_t>(one(b.y)) << 16);
      out.w = static_cast<uint32_t>(one(b.z)) | (static_cast<uint32_t>(one(b.w)) << 16);
      *reinterpret_cast<uint4*>(y + i) = out;
    }
    scalar_from = full;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) y[i] = one(__ldg(x + i));
}

__global__ void __launch_bounds__(kThreads) cast_multi_kernel(const __grid_constant__ CastTable table) {
  const int t = tensor_of_block(table, blockIdx.x);
  const int64_t start = (blockIdx.x - table.first_block[t]) * kChunk;
  const int64_t end = table.n[t] < start + kChunk ? table.n[t] : start + kChunk;
  unsigned short* y = static_cast<unsigned short*>(table.y[t]);
  if (table.f16[t]) cast_range<true>(table.x[t], y, start, end, table.vec[t]);
  else cast_range<false>(table.x[t], y, start, end, table.vec[t]);
}

// ---- launchers ------------------------------------------------------------------------------

bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
int64_t blocks_of(int64_t n) { return (n + kChunk - 1) / kChunk; }

template <typename Fn>
bool visit_update_types(DType p, DType g, DType s, Fn&& fn) {
  if (p != DType::kF32 || s != DType::kF32) return false;
  switch (g) {
    case DType::kF32: fn(float{}); return true;
    case DType::kBF16: fn(bf16{}); return true;
    case DType::kF16: fn(f16{}); return true;
    default: return false;
  }
}

// Fills tables of at most kMaxTensorsPerLaunch tensors and launches each: fill(table, slot, k)
// sets tensor k's pointers and vec flag, launch(table, blocks) enqueues the kernel.
template <typename TableT, typename Fill, typename Launch>
void launch_tables(int64_t count, const int64_t* sizes, Fill&& fill, Launch&& launch) {
  for (int64_t first = 0; first < count; first += kMaxTensorsPerLaunch) {
    TableT table{};
    const int64_t last = std::min(count, first + kMaxTensorsPerLaunch);
    int64_t blocks = 0;
    int slot = 0;
    for (int64_t k = first; k < last; ++k) {
      if (sizes[k] == 0) continue;
      fill(table, slot, k);
      table.n[slot] = sizes[k];
      table.first_block[slot] = blocks;
      blocks += blocks_of(sizes[k]);
      ++slot;
    }
    if (slot == 0) continue;
    table.first_block[slot] = blocks;
    table.count = slot;
    KILN_CHECK(blocks < (int64_t{1} << 31), "multi-tensor: {} blocks in one launch, at most 2^31 - 1",
               blocks);
    launch(table, blocks);
    KILN_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

bool update_types_supported(DType param, DType grad, DType state) {
  return visit_update_types(param, grad, state, [](auto) {});
}

void update(const char* optimizer, const optim::HyperValues& h, DType param_t, DType grad_t, DType state_t,
            const nn::UpdateTensor* tensors, int64_t count, DType lr_t, const void* lr, DType step_t,
            const void* step, cudaStream_t stream) {
  std::vector<int64_t> sizes(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) sizes[static_cast<size_t>(k)] = tensors[k].n;
  bool typed = true;
  const bool known = optim::visit_rule(optimizer, [&](auto rule) {
    using Rule = decltype(rule);
    typed = visit_update_types(param_t, grad_t, state_t, [&](auto grad_tag) {
      using G = decltype(grad_tag);
      launch_tables<UpdateTable>(
          count, sizes.data(),
          [&](UpdateTable& table, int slot, int64_t k) {
            const nn::UpdateTensor& x = tensors[k];
            table.in[slot][0] = x.param;
            table.in[slot][1] = x.grad;
            table.out[slot][0] = x.param_out;
            bool vec = aligned_to(x.param, 16) && aligned_to(x.param_out, 16) && aligned_to(x.grad, kVec * sizeof(G));
            for (int j = 0; j < optim::kMaxSlots; ++j) {
              table.in[slot][2 + j] = j < Rule::kSlots ? x.slots[j] : nullptr;
              table.out[slot][1 + j] = j < Rule::kSlots ? x.slots_out[j] : nullptr;
              if (j < Rule::kSlots) vec = vec && aligned_to(x.slots[j], 16) && aligned_to(x.slots_out[j], 16);
            }
            table.vec[slot] = vec;
          },
          [&](const UpdateTable& table, int64_t blocks) {
            update_multi_kernel<Rule, float, G, float><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
                table, h, lr, lr_t, step, step_t);
          });
    });
  });
  KILN_CHECK(known, "multi-tensor update: no rule for optimizer '{}'", optimizer);
  KILN_CHECK(typed, "multi-tensor update: unsupported types (param {}, grad {}, state {}); expected f32 "
             "param and state, f32/bf16/f16 grads", static_cast<int>(param_t), static_cast<int>(grad_t),
             static_cast<int>(state_t));
}

void global_norm(const NormTensor* tensors, int64_t count, const int* adds, int64_t num_adds,
                 int result, void* out, cudaStream_t stream) {
  KILN_CHECK(count >= 1 && count <= kMaxNormTerms && num_adds < kMaxNormTerms,
             "global norm: {} terms and {} adds, expected 1 to {} terms", count, num_adds, kMaxNormTerms);
  NormFinish program{};
  std::vector<int64_t> sizes(static_cast<size_t>(count));
  int64_t total_blocks = 0;
  for (int64_t k = 0; k < count; ++k) {
    sizes[static_cast<size_t>(k)] = tensors[k].n;
    program.first_partial[k] = static_cast<int>(total_blocks);
    total_blocks += blocks_of(tensors[k].n);
  }
  program.first_partial[count] = static_cast<int>(total_blocks);
  KILN_CHECK(total_blocks < (int64_t{1} << 31), "global norm: {} blocks, at most 2^31 - 1", total_blocks);
  for (int64_t a = 0; a < 2 * num_adds; ++a) program.adds[a] = adds[a];
  program.count = static_cast<int>(count);
  program.num_adds = static_cast<int>(num_adds);
  program.result = result;
  Scratch partials(static_cast<size_t>(std::max<int64_t>(total_blocks, 1)) * sizeof(double), stream);
  int64_t offset = 0;
  launch_tables<NormTable>(
      count, sizes.data(),
      [&](NormTable& table, int slot, int64_t k) {
        const NormTensor& x = tensors[k];
        table.x[slot] = x.x;
        table.t[slot] = x.t;
        table.vec[slot] = aligned_to(x.x, 16);
      },
      [&](NormTable& table, int64_t blocks) {
        table.partial_offset = offset;
        norm_partials_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(table,
                                                                                     partials.as<double>());
        offset += blocks;
      });
  norm_finish_kernel<<<1, 1024, 0, stream>>>(program, partials.as<double>(), static_cast<float*>(out));
  KILN_CUDA_CHECK(cudaGetLastError());
}

void cast(const CastTensor* tensors, int64_t count, cudaStream_t stream) {
  std::vector<int64_t> sizes(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) {
    const DType to = tensors[k].to;
    KILN_CHECK(to == DType::kBF16 || to == DType::kF16,
               "multi-tensor cast: tensor {} is cast to type code {}, expected bf16 or f16", k,
               static_cast<int>(to));
    sizes[static_cast<size_t>(k)] = tensors[k].n;
  }
  launch_tables<CastTable>(
      count, sizes.data(),
      [&](CastTable& table, int slot, int64_t k) {
        const CastTensor& c = tensors[k];
        table.x[slot] = c.x;
        table.y[slot] = c.y;
        table.f16[slot] = c.to == DType::kF16;
        table.vec[slot] = aligned_to(c.x, 16) && aligned_to(c.y, 16);
      },
      [&](const CastTable& table, int64_t blocks) {
        cast_multi_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(table);
      });
}

}  // namespace kiln::cuda::multi_tensor
