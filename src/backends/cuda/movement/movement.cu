// Kernels and launchers of the "cuda-movement" dialect (declared in movement.cuh). Unlike the
// generic kernels, which compute a strided index per element with 64-bit divisions, these move
// whole vectors (up to 16 bytes per access) and do their index arithmetic once per row with
// 32-bit multiply-shift division by invariant divisors, so they run near memory bandwidth:
//   copy_rows   rows of contiguous bytes (transposes that keep the last axis, slice, split,
//               concat, broadcast of leading axes), or one element repeated along a row
//               (broadcast of the innermost axis);
//   copy_tiled  32x32 shared-memory tiles for transposes that move the last axis;
//   cast        8 elements per thread between f32, f16 and bf16, bit-exact with the CPU;
//   sum_middle  deterministic two-pass sums over the middle axis of (outer, reduced, inner).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/common/float_bits.cuh"
#include "backends/cuda/movement/movement.cuh"
#include "backends/cuda/common/scratch.cuh"

namespace kiln::cuda::movement {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;          // copy_rows: vectors in flight per thread
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

void check_launch() { KILN_CUDA_CHECK(cudaGetLastError()); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- division by an invariant 32-bit divisor -----------------------------------------------

// n / d for every 32-bit n as (umulhi(n, m) + n) >> s (Granlund and Montgomery): the row and
// column indices of the copy kernels are found with a multiply and a shift instead of a
// division loop.
struct FastDiv {
  uint32_t d = 1, m = 1, s = 0;
};
FastDiv make_fast_div(uint64_t d) {
  if (d == 0 || d > 0xffffffffull) fail("movement: divisor {} is outside 1..2^32-1", d);
  FastDiv f;
  f.d = static_cast<uint32_t>(d);
  uint32_t l = 0;
  while ((uint64_t{1} << l) < d) ++l;
  // m = floor(2^32 (2^l - d) / d) + 1 < 2^32 for every d < 2^32.
  f.m = static_cast<uint32_t>((((uint64_t{1} << l) - d) << 32) / d + 1);
  f.s = l;
  return f;
}
__device__ __forceinline__ uint32_t fast_div(uint32_t n, const FastDiv& f) {
  return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, f.m)) + n) >> f.s);
}

// ---- vectors -----------------------------------------------------------------------------------

template <int V> struct VecOf;
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<4> { using type = unsigned int; };
template <> struct VecOf<2> { using type = unsigned short; };
template <> struct VecOf<1> { using type = unsigned char; };

template <int V>
__device__ __forceinline__ typename VecOf<V>::type load(const char* p) {
  return __ldg(reinterpret_cast<const typename VecOf<V>::type*>(p));
}
template <int V>
__device__ __forceinline__ void store(char* p, typename VecOf<V>::type v) {
  *reinterpret_cast<typename VecOf<V>::type*>(p) = v;
}

// The widest access (16, 8, 4, 2 or 1 bytes) that divides every value.
int widest_access(std::initializer_list<int64_t> values) {
  int v = 16;
  for (int64_t x : values)
    while (v > 1 && x % v != 0) v /= 2;
  return v;
}
int64_t address(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

// ---- copy_rows ---------------------------------------------------------------------------------

struct RowParams {
  int dims = 0;
  FastDiv size[kMaxDims];
  int64_t src_stride[kMaxDims] = {}, dst_stride[kMaxDims] = {};
  FastDiv chunks;  // vectors per row
};

// The byte offsets of row `row` in src and dst. The outermost index needs no division.
__device__ __forceinline__ void row_offsets(const RowParams& p, uint32_t row, int64_t& src,
                                            int64_t& dst) {
  src = 0;
  dst = 0;
#pragma unroll
  for (int d = kMaxDims - 1; d >= 1; --d) {
    if (d >= p.dims) continue;
    const uint32_t q = fast_div(row, p.size[d]);
    const uint32_t i = row - q * p.size[d].d;
    src += static_cast<int64_t>(i) * p.src_stride[d];
    dst += static_cast<int64_t>(i) * p.dst_stride[d];
    row = q;
  }
  if (p.dims > 0) {
    src += static_cast<int64_t>(row) * p.src_stride[0];
    dst += static_cast<int64_t>(row) * p.dst_stride[0];
  }
}

// The V bytes at byte `at` of a row that repeats the ES-byte element at `elem`.
template <int V, int ES>
__device__ __forceinline__ typename VecOf<V>::type replicated(const char* elem, uint32_t at) {
  using Vec = typename VecOf<V>::type;
  if constexpr (V <= ES) {
    return load<V>(elem + at % ES);
  } else {
    using E = typename VecOf<ES>::type;
    const E e = load<ES>(elem);
    Vec v;
    E* parts = reinterpret_cast<E*>(&v);
#pragma unroll
    for (int k = 0; k < V / ES; ++k) parts[k] = e;
    return v;
  }
}

// Item i is vector (i % chunks) of row (i / chunks); a thread moves kUnroll items a block-grid
// apart per pass, loading all before storing any.
template <int V, int ES, bool kReplicate>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(const char* __restrict__ src, char* __restrict__ dst, RowParams p,
                uint32_t items) {
  using Vec = typename VecOf<V>::type;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint64_t first = blockIdx.x * blockDim.x + threadIdx.x; first < items;
       first += static_cast<uint64_t>(stride) * kUnroll) {
    Vec v[kUnroll];
    int64_t out[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t i = first + static_cast<uint64_t>(k) * stride;
      if (i < items) {
        const uint32_t item = static_cast<uint32_t>(i);
        const uint32_t row = fast_div(item, p.chunks);
        const uint32_t at = (item - row * p.chunks.d) * V;  // byte within the row
        int64_t s, d;
        row_offsets(p, row, s, d);
        out[k] = d + at;
        if constexpr (kReplicate) {
          v[k] = replicated<V, ES>(src + s, at);
        } else {
          v[k] = load<V>(src + s + at);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
      if (first + static_cast<uint64_t>(k) * stride < items) store<V>(dst + out[k], v[k]);
  }
}

template <int V>
void launch_rows(const char* src, char* dst, const RowParams& p, uint32_t items, int elem_bytes,
                 bool replicate, cudaStream_t stream) {
  const int blocks = static_cast<int>(
      std::clamp<int64_t>(ceil_div(items, int64_t{kThreads} * kUnroll), 1, kMaxBlocks));
  if (!replicate) {
    rows_kernel<V, 1, false><<<blocks, kThreads, 0, stream>>>(src, dst, p, items);
  } else {
    switch (elem_bytes) {
      case 1: rows_kernel<V, 1, true><<<blocks, kThreads, 0, stream>>>(src, dst, p, items); break;
      case 2: rows_kernel<V, 2, true><<<blocks, kThreads, 0, stream>>>(src, dst, p, items); break;
      case 4: rows_kernel<V, 4, true><<<blocks, kThreads, 0, stream>>>(src, dst, p, items); break;
      case 8: rows_kernel<V, 8, true><<<blocks, kThreads, 0, stream>>>(src, dst, p, items); break;
      default: fail("movement: broadcast of {}-byte elements, expected 1, 2, 4 or 8", elem_bytes);
    }
  }
  check_launch();
}

// ---- copy_tiled --------------------------------------------------------------------------------

// 32x32 tiles, each thread moving 4 elements. Measured on an H200 for (32768, 768) -> (768,
// 32768): 0.86 TB/s bf16, 1.6 TB/s f32; 64x64 tiles (16 elements a thread) were slower (0.51 and
// 0.97 TB/s). The transposes of GPT-2 keep the last axis and take copy_rows instead.
constexpr int kTile = 32;
constexpr int kTileRows = kThreads / kTile;  // 8: each thread moves 4 elements of a tile

template <class E>
__global__ void __launch_bounds__(kThreads)
    tiled_kernel(const E* __restrict__ src, E* __restrict__ dst, TiledCopy p, int64_t tiles_a,
                 int64_t batch) {
  __shared__ E tile[kTile][kTile + 1];  // +1: the column reads hit 32 different banks
  const int64_t a0 = (blockIdx.x % tiles_a) * kTile, b0 = (blockIdx.x / tiles_a) * kTile;
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  for (int64_t n = blockIdx.y; n < batch; n += gridDim.y) {
    int64_t s = p.src_offset, d = p.dst_offset, rest = n;
    for (int k = p.batch_dims - 1; k >= 0; --k) {
      const int64_t i = rest % p.batch_size[k];
      rest /= p.batch_size[k];
      s += i * p.batch_src_stride[k];
      d += i * p.batch_dst_stride[k];
    }
    // Read along b (the source's contiguous axis), write along a (the destination's).
#pragma unroll
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t a = a0 + j, b = b0 + tx;
      if (a < p.size_a && b < p.size_b) tile[j][tx] = src[s + a * p.src_stride_a + b];
    }
    __syncthreads();
#pragma unroll
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t b = b0 + j, a = a0 + tx;
      if (a < p.size_a && b < p.size_b) dst[d + a + b * p.dst_stride_b] = tile[tx][j];
    }
    __syncthreads();
  }
}

template <class E>
void launch_tiled(const void* src, void* dst, const TiledCopy& p, cudaStream_t stream) {
  int64_t batch = 1;
  for (int k = 0; k < p.batch_dims; ++k) batch *= p.batch_size[k];
  const int64_t tiles_a = ceil_div(p.size_a, kTile), tiles = tiles_a * ceil_div(p.size_b, kTile);
  if (tiles > 0x7fffffff) fail("movement: {} tiles in one transpose, at most 2^31-1", tiles);
  const dim3 grid(static_cast<unsigned>(tiles),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  tiled_kernel<E><<<grid, kThreads, 0, stream>>>(static_cast<const E*>(src), static_cast<E*>(dst),
                                                 p, tiles_a, batch);
  check_launch();
}

struct F32 {
  using Bits = float;
  __device__ static float to_f32(float v) { return v; }
  __device__ static float from_f32(float v) { return v; }
};
struct F16 {
  using Bits = unsigned short;
  __device__ static float to_f32(unsigned short v) { return f16_to_f32(v); }
  __device__ static unsigned short from_f32(float v) { return f32_to_f16(v); }
};
struct BF16 {
  using Bits = unsigned short;
  __device__ static float to_f32(unsigned short v) { return bf16_to_f32(v); }
  __device__ static unsigned short from_f32(float v) { return f32_to_bf16(v); }
};

template <class Fn>
void visit_float(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32: return fn(F32{});
    case DType::kF16: return fn(F16{});
    case DType::kBF16: return fn(BF16{});
    default: break;
  }
  fail("movement: {} is not a float storage type (f32, f16, bf16)", dtype_name(t));
}

// ---- cast ----------------------------------------------------------------------------------------

constexpr int kCastGroup = 8;  // elements per thread: 16 or 32 bytes of f32, 16 of 16-bit

// A group of kCastGroup elements moved as whole 16-byte vectors.
template <class T>
struct alignas(16) Group {
  typename T::Bits v[kCastGroup];
};

template <class From, class To>
__global__ void __launch_bounds__(kThreads)
    cast_vector_kernel(const Group<From>* __restrict__ x, Group<To>* __restrict__ y,
                       int64_t groups, const typename From::Bits* __restrict__ x_tail,
                       typename To::Bits* __restrict__ y_tail, int tail) {
  constexpr int kIn = sizeof(Group<From>) / 16, kOut = sizeof(Group<To>) / 16;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t g = first; g < groups; g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Group<From> in;
    Group<To> out;
#pragma unroll
    for (int k = 0; k < kIn; ++k)
      reinterpret_cast<uint4*>(&in)[k] = __ldg(reinterpret_cast<const uint4*>(x + g) + k);
#pragma unroll
    for (int e = 0; e < kCastGroup; ++e) out.v[e] = To::from_f32(From::to_f32(in.v[e]));
#pragma unroll
    for (int k = 0; k < kOut; ++k)
      reinterpret_cast<uint4*>(y + g)[k] = reinterpret_cast<const uint4*>(&out)[k];
  }
  if (first < tail) y_tail[first] = To::from_f32(From::to_f32(x_tail[first]));
}

template <class From, class To>
__global__ void __launch_bounds__(kThreads)
    cast_scalar_kernel(const typename From::Bits* __restrict__ x,
                       typename To::Bits* __restrict__ y, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = To::from_f32(From::to_f32(x[i]));
}

// ---- sums ------------------------------------------------------------------------------------------

// Loads V consecutive elements (one 16-byte vector when V > 1) as f32.
template <class T, int V>
__device__ __forceinline__ void load_f32(const typename T::Bits* p, float (&out)[V]) {
  using Bits = typename T::Bits;
  if constexpr (V == 1) {
    out[0] = T::to_f32(p[0]);
  } else {
    static_assert(V * sizeof(Bits) == 16, "one 16-byte vector");
    uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const Bits* e = reinterpret_cast<const Bits*>(&raw);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = T::to_f32(e[k]);
  }
}

constexpr int kColumnLanes = 32;                       // column vectors per block
constexpr int kColumnUnroll = 2;                       // loads in flight per thread
constexpr int kRowGroups = kThreads / kColumnLanes;   // 8 rows in flight per block

// Column sums of x (outer, R, C): block (strip, split, o) sums rows [split * rows_per_split, ...)
// of a strip of kColumnLanes * V columns; row group g takes rows g, g + 8, ... of the split, in
// order, and the 8 groups are added in order through shared memory. With one split the block
// writes y; else the f32 partial (o, split, c), which column_finish_kernel adds in split order.
template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    column_sum_kernel(const typename T::Bits* __restrict__ x, float* __restrict__ partial,
                      typename T::Bits* __restrict__ y, int64_t outer, int64_t R, int64_t C,
                      int64_t rows_per_split, int64_t splits) {
  __shared__ float sums[kRowGroups][kColumnLanes * V];
  const int lane = threadIdx.x % kColumnLanes, group = threadIdx.x / kColumnLanes;
  const int64_t strip = static_cast<int64_t>(blockIdx.x) * kColumnLanes * V;
  const int64_t c0 = strip + static_cast<int64_t>(lane) * V;
  const int64_t split = blockIdx.y;
  const int64_t r_begin = split * rows_per_split;
  const int64_t r_end = std::min<int64_t>(R, r_begin + rows_per_split);
  for (int64_t o = blockIdx.z; o < outer; o += gridDim.z) {
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
    if (c0 < C) {
      const typename T::Bits* base = x + o * R * C + c0;
      int64_t r = r_begin + group;
      constexpr int kStep = kRowGroups;
      // kColumnUnroll loads in flight, added in row order.
      for (; r + (kColumnUnroll - 1) * kStep < r_end; r += kColumnUnroll * kStep) {
        float v[kColumnUnroll][V];
#pragma unroll
        for (int u = 0; u < kColumnUnroll; ++u) load_f32<T, V>(base + (r + u * kStep) * C, v[u]);
#pragma unroll
        for (int u = 0; u < kColumnUnroll; ++u)
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] += v[u][k];
      }
      for (; r < r_end; r += kStep) {
        float v[V];
        load_f32<T, V>(base + r * C, v);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += v[k];
      }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) sums[group][lane * V + k] = acc[k];
    __syncthreads();
    for (int col = threadIdx.x; col < kColumnLanes * V; col += kThreads) {
      float s = sums[0][col];
#pragma unroll
      for (int g = 1; g < kRowGroups; ++g) s += sums[g][col];
      const int64_t c = strip + col;
      if (c < C) {
        if (splits == 1) {
          y[o * C + c] = T::from_f32(s);
        } else {
          partial[(o * splits + split) * C + c] = s;
        }
      }
    }
    __syncthreads();
  }
}

// y (o, c) = the partials (o, 0..splits-1, c) added in a fixed order: a block of kFinishThreads
// takes 32 columns; group g of 32 threads adds splits g, g + kFinishGroups, ... (four loads in
// flight), then the groups' sums are added in group order. Many short chains instead of one
// long one per column: the partials come from L2, and a chain of dependent loads would wait
// out its latency once per split.
constexpr int kFinishThreads = 1024;
constexpr int kFinishGroups = kFinishThreads / 32;

template <class T>
__global__ void __launch_bounds__(kFinishThreads)
    column_finish_kernel(const float* __restrict__ partial, typename T::Bits* __restrict__ y,
                         int64_t outer, int64_t C, int64_t splits) {
  __shared__ float sums[kFinishGroups][32];
  const int lane = threadIdx.x % 32, group = threadIdx.x / 32;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  for (int64_t o = blockIdx.y; o < outer; o += gridDim.y) {
    float s = 0.0f;
    if (c < C) {
      const float* p = partial + o * splits * C + c;
      int64_t k = group;
      constexpr int kStep = kFinishGroups;
      for (; k + 3 * kStep < splits; k += 4 * kStep) {
        const float v0 = p[k * C], v1 = p[(k + kStep) * C], v2 = p[(k + 2 * kStep) * C],
                    v3 = p[(k + 3 * kStep) * C];
        s += v0;
        s += v1;
        s += v2;
        s += v3;
      }
      for (; k < splits; k += kStep) s += p[k * C];
    }
    sums[group][lane] = s;
    __syncthreads();
    if (group == 0 && c < C) {
      float total = sums[0][lane];
      for (int g = 1; g < kFinishGroups; ++g) total += sums[g][lane];
      y[o * C + c] = T::from_f32(total);
    }
    __syncthreads();
  }
}

__device__ __forceinline__ float warp_sum(float v) {  // a fixed butterfly: deterministic
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Row sums of x (outer, R): a warp per (row, segment of `segment` elements); lane l adds the
// vectors l, l + 32, ... of its segment in order, then the butterfly. With one segment per row
// the warp writes y, else the f32 partial (o, split), which row_finish_kernel adds.
template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    row_sum_kernel(const typename T::Bits* __restrict__ x, float* __restrict__ partial,
                   typename T::Bits* __restrict__ y, int64_t outer, int64_t R, int64_t segment,
                   int64_t splits) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
       item < outer * splits; item += warps) {
    const int64_t o = item / splits, split = item % splits;
    const int64_t begin = split * segment, end = std::min<int64_t>(R, begin + segment);
    const typename T::Bits* row = x + o * R;
    float acc = 0.0f;
    int64_t i = begin + static_cast<int64_t>(lane) * V;
    for (; i + 3 * 32 * V < end; i += 4 * 32 * V) {
      float v[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) load_f32<T, V>(row + i + u * 32 * V, v[u]);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int k = 0; k < V; ++k) acc += v[u][k];
    }
    for (; i < end; i += 32 * V) {
      float v[V];
      load_f32<T, V>(row + i, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc += v[k];
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      if (splits == 1) {
        y[o] = T::from_f32(acc);
      } else {
        partial[item] = acc;
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    row_finish_kernel(const float* __restrict__ partial, typename T::Bits* __restrict__ y,
                      int64_t outer, int64_t splits) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
       o < outer; o += warps) {
    float s = 0.0f;
    for (int64_t k = lane; k < splits; k += 32) s += partial[o * splits + k];
    s = warp_sum(s);
    if (lane == 0) y[o] = T::from_f32(s);
  }
}

// Work sizes: chosen from the shape alone (never from the device), so that a shape always sums
// in the same order.
// Column sums: more, shorter splits with 2 loads in flight measured fastest on an H100 (bf16
// (32768, 3072) over rows 87 -> 79 us, (32768, 2304) 69 -> 64 us against 2048 blocks of >= 128
// rows with 4 or 8 in flight; the KILN_COLSUM experiment logged in bench/log/sessions-1-12.md).
constexpr int64_t kColumnTargetBlocks = 4096;  // about four waves of 8 blocks per SM
constexpr int64_t kColumnMinRows = 32;          // rows per split
constexpr int64_t kRowTargetWarps = 8192;
constexpr int64_t kRowMinSegment = 2048;    // elements per segment

template <class T, int V>
void column_sum(const void* x, void* y, int64_t outer, int64_t R, int64_t C,
                cudaStream_t stream) {
  using Bits = typename T::Bits;
  const int64_t strips = ceil_div(C, int64_t{kColumnLanes} * V);
  int64_t splits = std::clamp<int64_t>(ceil_div(kColumnTargetBlocks, strips * outer), 1,
                                       ceil_div(R, kColumnMinRows));
  const int64_t rows_per_split = ceil_div(R, splits);
  splits = ceil_div(R, rows_per_split);
  if (strips > 0x7fffffff) fail("movement: sum over {} column strips, at most 2^31-1", strips);
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(splits),
                  static_cast<unsigned>(std::min<int64_t>(outer, 65535)));
  Scratch partial(splits > 1 ? static_cast<size_t>(outer * splits * C) * sizeof(float) : 0,
                  stream);
  column_sum_kernel<T, V><<<grid, kThreads, 0, stream>>>(
      static_cast<const Bits*>(x), partial.as<float>(), static_cast<Bits*>(y), outer, R, C,
      rows_per_split, splits);
  check_launch();
  if (splits > 1) {
    const dim3 finish_grid(static_cast<unsigned>(ceil_div(C, 32)),
                           static_cast<unsigned>(std::min<int64_t>(outer, 65535)));
    column_finish_kernel<T><<<finish_grid, kFinishThreads, 0, stream>>>(
        partial.as<float>(), static_cast<Bits*>(y), outer, C, splits);
    check_launch();
  }
}

template <class T, int V>
void row_sum(const void* x, void* y, int64_t outer, int64_t R, cudaStream_t stream) {
  using Bits = typename T::Bits;
  const int64_t splits_wanted = std::clamp<int64_t>(ceil_div(kRowTargetWarps, outer), 1,
                                                    ceil_div(R, kRowMinSegment));
  const int64_t segment = ceil_div(ceil_div(R, splits_wanted), V) * V;
  const int64_t splits = ceil_div(R, segment);
  constexpr int64_t kWarpsPerBlock = kThreads / 32;
  Scratch partial(splits > 1 ? static_cast<size_t>(outer * splits) * sizeof(float) : 0, stream);
  const int blocks = static_cast<int>(
      std::clamp<int64_t>(ceil_div(outer * splits, kWarpsPerBlock), 1, kMaxBlocks));
  row_sum_kernel<T, V><<<blocks, kThreads, 0, stream>>>(static_cast<const Bits*>(x),
                                                        partial.as<float>(),
                                                        static_cast<Bits*>(y), outer, R,
                                                        segment, splits);
  check_launch();
  if (splits > 1) {
    const int finish_blocks = static_cast<int>(
        std::clamp<int64_t>(ceil_div(outer, kWarpsPerBlock), 1, kMaxBlocks));
    row_finish_kernel<T><<<finish_blocks, kThreads, 0, stream>>>(
        partial.as<float>(), static_cast<Bits*>(y), outer, splits);
    check_launch();
  }
}

}  // namespace

void copy_rows(const void* src, void* dst, const RowCopy& copy, cudaStream_t stream) {
  if (copy.dims < 0 || copy.dims > kMaxDims)
    fail("movement: a row copy over {} dims, expected 0..{}", copy.dims, kMaxDims);
  int64_t rows = 1;
  for (int d = 0; d < copy.dims; ++d) rows *= copy.size[d];
  if (rows == 0 || copy.run_bytes == 0) return;
  int access = widest_access({copy.run_bytes, copy.src_offset, copy.dst_offset, address(dst),
                              copy.replicate ? 0 : address(src)});
  for (int d = 0; d < copy.dims; ++d)
    access = std::min(access, widest_access({copy.dst_stride[d],
                                             copy.replicate ? 0 : copy.src_stride[d]}));
  if (copy.replicate) {
    // The repeated element is read whole when the access is wider than it, else in pieces of
    // the access's width, so its address must allow the narrower of the two.
    int src_access = widest_access({address(src), copy.src_offset});
    for (int d = 0; d < copy.dims; ++d)
      src_access = std::min(src_access, widest_access({copy.src_stride[d]}));
    if (src_access < copy.elem_bytes) access = std::min(access, src_access);
  }
  const int64_t chunks = copy.run_bytes / access;
  const int64_t items = rows * chunks;
  if (items >= (int64_t{1} << 32))
    fail("movement: a row copy of {} vectors, at most 2^32-1 (bytes {})", items,
         rows * copy.run_bytes);
  RowParams p;
  p.dims = copy.dims;
  for (int d = 0; d < copy.dims; ++d) {
    p.size[d] = make_fast_div(static_cast<uint64_t>(copy.size[d]));
    p.src_stride[d] = copy.src_stride[d];
    p.dst_stride[d] = copy.dst_stride[d];
  }
  p.chunks = make_fast_div(static_cast<uint64_t>(chunks));
  const char* s = static_cast<const char*>(src) + copy.src_offset;
  char* t = static_cast<char*>(dst) + copy.dst_offset;
  const auto n = static_cast<uint32_t>(items);
  switch (access) {
    case 16: return launch_rows<16>(s, t, p, n, copy.elem_bytes, copy.replicate, stream);
    case 8: return launch_rows<8>(s, t, p, n, copy.elem_bytes, copy.replicate, stream);
    case 4: return launch_rows<4>(s, t, p, n, copy.elem_bytes, copy.replicate, stream);
    case 2: return launch_rows<2>(s, t, p, n, copy.elem_bytes, copy.replicate, stream);
    default: return launch_rows<1>(s, t, p, n, copy.elem_bytes, copy.replicate, stream);
  }
}

void copy_tiled(const void* src, void* dst, const TiledCopy& copy, cudaStream_t stream) {
  if (copy.batch_dims < 0 || copy.batch_dims > kMaxDims)
    fail("movement: a tiled copy over {} batch dims, expected 0..{}", copy.batch_dims, kMaxDims);
  if (copy.size_a <= 0 || copy.size_b <= 0) return;
  for (int k = 0; k < copy.batch_dims; ++k)
    if (copy.batch_size[k] <= 0) return;
  switch (copy.elem_bytes) {
    case 1: return launch_tiled<unsigned char>(src, dst, copy, stream);
    case 2: return launch_tiled<unsigned short>(src, dst, copy, stream);
    case 4: return launch_tiled<unsigned int>(src, dst, copy, stream);
    case 8: return launch_tiled<unsigned long long>(src, dst, copy, stream);
    default: fail("movement: a tiled copy of {}-byte elements, expected 1, 2, 4 or 8",
                  copy.elem_bytes);
  }
}

void cast(DType from, DType to, const void* x, void* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  visit_float(from, [&](auto from_tag) {
    visit_float(to, [&](auto to_tag) {
      using From = decltype(from_tag);
      using To = decltype(to_tag);
      using InBits = typename From::Bits;
      using OutBits = typename To::Bits;
      if (address(x) % 16 == 0 && address(y) % 16 == 0) {
        const int64_t groups = n / kCastGroup;
        const int tail = static_cast<int>(n % kCastGroup);
        const int blocks = static_cast<int>(
            std::clamp<int64_t>(ceil_div(std::max<int64_t>(groups, tail), kThreads), 1,
                                kMaxBlocks));
        cast_vector_kernel<From, To><<<blocks, kThreads, 0, stream>>>(
            static_cast<const Group<From>*>(x), static_cast<Group<To>*>(y), groups,
            static_cast<const InBits*>(x) + groups * kCastGroup,
            static_cast<OutBits*>(y) + groups * kCastGroup, tail);
      } else {
        const int blocks =
            static_cast<int>(std::clamp<int64_t>(ceil_div(n, kThreads), 1, kMaxBlocks));
        cast_scalar_kernel<From, To><<<blocks, kThreads, 0, stream>>>(
            static_cast<const InBits*>(x), static_cast<OutBits*>(y), n);
      }
      check_launch();
    });
  });
}

void sum_middle(DType type, const void* x, void* y, int64_t outer, int64_t reduced, int64_t inner,
                cudaStream_t stream) {
  if (outer <= 0 || inner <= 0) return;
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVector = static_cast<int>(16 / sizeof(typename T::Bits));
    if (reduced == 0) {  // a sum over nothing is 0 (+0.0 is all zero bits in every float type)
      KILN_CUDA_CHECK(cudaMemsetAsync(
          y, 0, static_cast<size_t>(outer * inner) * sizeof(typename T::Bits), stream));
      return;
    }
    const bool aligned = address(x) % 16 == 0;
    if (inner == 1) {
      if (aligned && reduced % kVector == 0) {
        row_sum<T, kVector>(x, y, outer, reduced, stream);
      } else {
        row_sum<T, 1>(x, y, outer, reduced, stream);
      }
    } else if (aligned && inner % kVector == 0) {
      column_sum<T, kVector>(x, y, outer, reduced, inner, stream);
    } else {
      column_sum<T, 1>(x, y, outer, reduced, inner, stream);
    }
  });
}

}  // namespace kiln::cuda::movement
