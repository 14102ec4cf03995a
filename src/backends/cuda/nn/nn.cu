// Kernels and launchers of the "cuda-nn" dialect (declared in nn.cuh; registered by nn.cc).
//
// Row ops (layer_norm(_grad), softmax, log_softmax and their grads, cross_entropy(_grad)) give
// each row to a group of threads: a warp when the row has at most kWarpMaxCols elements (8 rows
// per 256-thread block), else a whole block. A row is read as [head][16-byte vectors][tail]:
// the scalar head brings the pointer to 16-byte alignment, so rows of any length (odd vocab
// sizes included) move through 16-byte accesses. Each thread keeps its first K vectors in
// registers, so the passes after the first (variance after mean, write after the reductions)
// read registers; a longer row's remainder is read again (L1/L2 hits). Reductions within a
// group: warp shuffles (butterfly, so every lane holds the same bits), then, for a block, the
// warp partials summed in warp order through shared memory.
//
// Elementwise ops (gelu, gelu_grad, optimizer_update) walk 16-byte chunks (4 elements
// for the optimizer updates, whose operands may mix 16- and 32-bit types) with a scalar tail.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/common/elements.cuh"
#include "backends/cuda/runtime/device_errors.cuh"
#include "backends/cuda/common/device_math.cuh"
#include "backends/cuda/nn/nn.cuh"
#include "backends/cuda/common/scratch.cuh"
#include "backends/cuda/common/dtype_visit.cuh"
#include "ops/elementwise_math.h"

namespace kiln::cuda::nn {
namespace {

using bf16 = __nv_bfloat16;
using f16 = __half;

template <int V>
using IntC = std::integral_constant<int, V>;
template <bool V>
using BoolC = std::integral_constant<bool, V>;

constexpr int kWarp = 32;
constexpr int64_t kWarpMaxCols = 1024;  // rows up to this length: one warp per row
constexpr int kWarpRowsPerBlock = 8;    // warp path: 256-thread blocks
constexpr int kCacheFloatsWarp = 32;    // registers per thread holding a row (warp path)
constexpr int kCacheFloatsBlock = 8;    // (block path: more threads, fewer registers each)
constexpr int kMaxBlockThreads = 512;   // block path: <= 128 registers per thread

// ---- conversions and vector access ----------------------------------------------------------

// to_f / from_f / load / store: elements.cuh.

// Vector access when `vec`, else N scalar loads (a parameter vector read at a row's offset
// that is not 16-byte aligned).
template <int N, typename T>
__device__ __forceinline__ void load_maybe(const T* p, float (&out)[N], bool vec) {
  if (vec) {
    load<N>(p, out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_f(p[i]);
  }
}
// A device scalar of any float type (lr, step), read by every thread.
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

// ---- row groups and reductions --------------------------------------------------------------

// The threads that share a row: a warp (warp path) or the block (block path).
template <bool kBlockRow>
struct RowGroup {
  int tid;     // index within the group
  int n;       // threads in the group
  int group;   // group index within the block
  int groups;  // groups per block
  __device__ RowGroup() {
    if constexpr (kBlockRow) {
      tid = threadIdx.x;
      n = blockDim.x;
      group = 0;
      groups = 1;
    } else {
      tid = threadIdx.x % kWarp;
      n = kWarp;
      group = threadIdx.x / kWarp;
      groups = blockDim.x / kWarp;
    }
  }
};

struct MaxSum {
  float m, s;  // running max, sum of exp(x - m)
};
struct Sum2 {
  float a, b;
};

__device__ __forceinline__ float shfl(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ MaxSum shfl(MaxSum v, int mask) {
  return {shfl(v.m, mask), shfl(v.s, mask)};
}
__device__ __forceinline__ Sum2 shfl(Sum2 v, int mask) {
  return {shfl(v.a, mask), shfl(v.b, mask)};
}

struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
  __device__ Sum2 operator()(Sum2 a, Sum2 b) const { return {a.a + b.a, a.b + b.b}; }
};
// Merges two online-softmax states; symmetric in its operands (so butterfly lanes agree).
struct MergeOp {
  __device__ MaxSum operator()(MaxSum a, MaxSum b) const {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.0f};
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
  }
};

// The group's reduction of v, the same value in every thread of the group. Block path: every
// thread of the block must call it (it synchronizes); `sh` holds 32 values.
template <bool kBlockRow, typename V, typename Op>
__device__ __forceinline__ V group_reduce(V v, Op op, V* sh) {
#pragma unroll
  for (int mask = kWarp / 2; mask > 0; mask /= 2) v = op(v, shfl(v, mask));
  if constexpr (!kBlockRow) {
    return v;
  } else {
    const int warps = (blockDim.x + kWarp - 1) / kWarp;
    __syncthreads();  // sh may still be read by the previous reduction
    if (threadIdx.x % kWarp == 0) sh[threadIdx.x / kWarp] = v;
    __syncthreads();
    V r = sh[0];
    for (int w = 1; w < warps; ++w) r = op(r, sh[w]);
    return r;
  }
}

// Adds x to an online-softmax state.
__device__ __forceinline__ void add_to(MaxSum& st, float x) {
  if (x > st.m) {
    st.s = st.s * expf(st.m - x) + 1.0f;  // st.m = -inf: 0 * 0 + 1
    st.m = x;
  } else if (x != -INFINITY) {
    st.s += expf(x - st.m);
  }
}
template <int W>
__device__ __forceinline__ void add_to(MaxSum& st, const float (&x)[W]) {
  float mx = x[0];
#pragma unroll
  for (int i = 1; i < W; ++i) mx = fmaxf(mx, x[i]);
  if (mx > st.m) {
    st.s *= expf(st.m - mx);
    st.m = mx;
  }
  if (st.m == -INFINITY) return;
#pragma unroll
  for (int i = 0; i < W; ++i) st.s += expf(x[i] - st.m);
}

// A row as [0, head) scalars, nvec vectors of W from head, [tail, cols) scalars.
struct RowSplit {
  int64_t head, nvec, tail, cols;
};
template <int W, typename T>
__device__ __forceinline__ RowSplit split_row(const T* row, int64_t cols) {
  if constexpr (W == 1) {
    return {0, cols, cols, cols};
  } else {
    const int misaligned = static_cast<int>(reinterpret_cast<uintptr_t>(row) % 16 / sizeof(T));
    const int64_t head = misaligned == 0 ? 0 : (cols < W - misaligned ? cols : W - misaligned);
    const int64_t nvec = (cols - head) / W;
    return {head, nvec, head + nvec * W, cols};
  }
}

// fn(col) for the scalar columns of the row (head and tail).
template <typename Fn>
__device__ __forceinline__ void for_edges(const RowSplit& s, int tid, int n, Fn&& fn) {
  const int64_t nedge = s.head + (s.cols - s.tail);
  for (int64_t e = tid; e < nedge; e += n) fn(e < s.head ? e : s.tail + (e - s.head));
}
// fn(slot, first col) for this thread's vectors: slot k < K for the cached ones (a compile-time
// constant after unrolling, so the register arrays are never indexed at run time), -1 beyond.
template <int K, int W, typename Fn>
__device__ __forceinline__ void for_vecs(const RowSplit& s, int tid, int n, Fn&& fn) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = tid + static_cast<int64_t>(k) * n;
    if (v < s.nvec) fn(k, s.head + v * W);
  }
  for (int64_t v = tid + static_cast<int64_t>(K) * n; v < s.nvec; v += n) fn(-1, s.head + v * W);
}

// Loads the W values at p into out, from the cache when slot >= 0 and `fill` is false; with
// `fill`, loads from memory and stores them in the cache slot.
template <int K, int W, typename T>
__device__ __forceinline__ void cached(float (&cache)[K][W], int slot, const T* p, float (&out)[W],
                                       bool fill) {
  if (slot >= 0 && !fill) {
#pragma unroll
    for (int i = 0; i < W; ++i) out[i] = cache[slot][i];
  } else {
    load<W>(p, out);
    if (slot >= 0) {
#pragma unroll
      for (int i = 0; i < W; ++i) cache[slot][i] = out[i];
    }
  }
}

// ---- launch configuration -------------------------------------------------------------------

int sm_count() {
  int device = 0, count = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// Whether row-shaped arrays can share one head/vector/tail split: same address modulo 16.
bool same_alignment(std::initializer_list<const void*> ptrs) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(*ptrs.begin()) % 16;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != first) return false;
  return true;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads of a block-path row group: enough for K vectors each, a multiple of 32, at most
// kMaxBlockThreads.
int block_threads(int64_t cols, int w, int k) {
  const int64_t t = ceil_div(ceil_div(cols, w), k);
  return static_cast<int>(
      std::min<int64_t>(kMaxBlockThreads, std::max<int64_t>(128, ceil_div(t, kWarp) * kWarp)));
}

struct RowLaunch {
  dim3 grid, block;
};
// Grid for one row per group (warp path: 8 rows per block; block path: a row per block).
template <bool kBlockRow>
RowLaunch row_launch(int64_t rows, int64_t cols, int w, int k) {
  if constexpr (kBlockRow) {
    return {dim3(static_cast<unsigned>(rows)), dim3(block_threads(cols, w, k))};
  } else {
    return {dim3(static_cast<unsigned>(ceil_div(rows, kWarpRowsPerBlock))),
            dim3(kWarp * kWarpRowsPerBlock)};
  }
}

// Calls launch(IntC<W>, IntC<K>, BoolC<kBlockRow>): 16-byte vectors when `vec`, the warp path
// for short rows; otherwise scalars on the block path.
template <typename T, typename Launch>
void dispatch_rows(int64_t cols, bool vec, Launch&& launch) {
  constexpr int kVecW = 16 / sizeof(T);
  if (vec && cols <= kWarpMaxCols) {
    launch(IntC<kVecW>{}, IntC<std::max(1, kCacheFloatsWarp / kVecW)>{}, BoolC<false>{});
  } else if (vec) {
    launch(IntC<kVecW>{}, IntC<std::max(1, kCacheFloatsBlock / kVecW)>{}, BoolC<true>{});
  } else {
    launch(IntC<1>{}, IntC<kCacheFloatsBlock>{}, BoolC<true>{});
  }
}

template <typename Fn>
void visit_float(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32:
      return fn(Tag<float>{});
    case DType::kF16:
      return fn(Tag<f16>{});
    case DType::kBF16:
      return fn(Tag<bf16>{});
    default:
      fail("cuda-nn: {} is not f32, f16 or bf16", dtype_name(t));
  }
}

// ---- layer_norm -----------------------------------------------------------------------------

template <typename T, int W, int K, bool kBlockRow>
__global__ void __launch_bounds__(kBlockRow ? kMaxBlockThreads : kWarp * kWarpRowsPerBlock)
    layer_norm_kernel(const T* __restrict__ x, const T* __restrict__ gamma,
                      const T* __restrict__ beta, T* __restrict__ y, int64_t rows, int64_t cols,
                      float eps, bool params_aligned) {
  __shared__ float sh[kWarp];
  const RowGroup<kBlockRow> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  if (row >= rows) return;  // warp path only: a block-path grid has exactly `rows` blocks
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  const RowSplit s = split_row<W>(xr, cols);
  const bool pvec = params_aligned && s.head == 0;
  float cache[K][W];

  float sum = 0.0f;
  for_edges(s, g.tid, g.n, [&](int64_t c) { sum += to_f(xr[c]); });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W];
    cached<K, W>(cache, slot, xr + c0, v, true);
#pragma unroll
    for (int i = 0; i < W; ++i) sum += v[i];
  });
  const float mean = group_reduce<kBlockRow>(sum, AddOp{}, sh) / static_cast<float>(cols);

  float sq = 0.0f;
  for_edges(s, g.tid, g.n, [&](int64_t c) {
    const float d = to_f(xr[c]) - mean;
    sq += d * d;
  });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W];
    cached<K, W>(cache, slot, xr + c0, v, false);
#pragma unroll
    for (int i = 0; i < W; ++i) sq += (v[i] - mean) * (v[i] - mean);
  });
  const float var = group_reduce<kBlockRow>(sq, AddOp{}, sh) / static_cast<float>(cols);
  const float rstd = rsqrtf(var + eps);

  for_edges(s, g.tid, g.n, [&](int64_t c) {
    yr[c] = from_f<T>((to_f(xr[c]) - mean) * rstd * to_f(gamma[c]) + to_f(beta[c]));
  });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W], ga[W], be[W], out[W];
    cached<K, W>(cache, slot, xr + c0, v, false);
    load_maybe<W>(gamma + c0, ga, pvec);
    load_maybe<W>(beta + c0, be, pvec);
#pragma unroll
    for (int i = 0; i < W; ++i) out[i] = (v[i] - mean) * rstd * ga[i] + be[i];
    store<W>(yr + c0, out);
  });
}

// ---- layer_norm_grad ------------------------------------------------------------------------

// dx per row; dgamma/dbeta per-column sums accumulated in shared memory (one slice per row
// group, each group taking rows group, group + total groups, ...), then summed over the
// block's groups in group order into partial[block][2][cols].
constexpr int kLnGradWarpsPerBlock = 4;

template <typename T, int W, int K, bool kBlockRow>
__global__ void __launch_bounds__(kBlockRow ? kMaxBlockThreads : kWarp * kLnGradWarpsPerBlock)
    layer_norm_grad_kernel(const T* __restrict__ x, const T* __restrict__ gamma,
                           const T* __restrict__ dy, T* __restrict__ dx,
                           float* __restrict__ partial, int64_t rows, int64_t cols, float eps,
                           bool params_aligned) {
  extern __shared__ float acc[];  // [groups][2][padded], padded = W * ceil(cols / W)
  __shared__ float sh[kWarp];
  __shared__ Sum2 sh2[kWarp];
  const RowGroup<kBlockRow> g;
  // Column c's accumulator is at (c % W) * stride + c / W: the lanes of a warp, W columns apart,
  // then touch consecutive banks (indexing by c was a W-way bank conflict on every accumulate).
  const int64_t stride = (cols + W - 1) / W, padded = stride * W;
  auto at = [stride](int64_t c) { return (c % W) * stride + c / W; };
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(g.groups) * 2 * padded; i += blockDim.x)
    acc[i] = 0.0f;
  __syncthreads();
  float* dgamma_acc = acc + static_cast<int64_t>(g.group) * 2 * padded;
  float* dbeta_acc = dgamma_acc + padded;
  const int64_t total_groups = static_cast<int64_t>(gridDim.x) * g.groups;
  const float inv_cols = 1.0f / static_cast<float>(cols);

  // Block path: the row loop is uniform across the block (group 0 only), as the reductions
  // need. Warp path: each warp runs its own rows.
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group; row < rows;
       row += total_groups) {
    const T* xr = x + row * cols;
    const T* dyr = dy + row * cols;
    T* dxr = dx + row * cols;
    const RowSplit s = split_row<W>(xr, cols);
    const bool pvec = params_aligned && s.head == 0;
    float xc[K][W];  // x cached; dy is read again in the last pass (an L1 hit), which keeps
                     // the registers low enough for more warps in flight

    float sum = 0.0f;
    for_edges(s, g.tid, g.n, [&](int64_t c) { sum += to_f(xr[c]); });
    for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
      float v[W];
      cached<K, W>(xc, slot, xr + c0, v, true);
#pragma unroll
      for (int i = 0; i < W; ++i) sum += v[i];
    });
    const float mean = group_reduce<kBlockRow>(sum, AddOp{}, sh) * inv_cols;

    float sq = 0.0f;
    for_edges(s, g.tid, g.n, [&](int64_t c) {
      const float d = to_f(xr[c]) - mean;
      sq += d * d;
    });
    for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
      float v[W];
      cached<K, W>(xc, slot, xr + c0, v, false);
#pragma unroll
      for (int i = 0; i < W; ++i) sq += (v[i] - mean) * (v[i] - mean);
    });
    const float rstd = rsqrtf(group_reduce<kBlockRow>(sq, AddOp{}, sh) * inv_cols + eps);

    // g = dy * gamma: sums of g and g * x_hat; dgamma += dy * x_hat, dbeta += dy.
    Sum2 sums{0.0f, 0.0f};
    for_edges(s, g.tid, g.n, [&](int64_t c) {
      const float xh = (to_f(xr[c]) - mean) * rstd, d = to_f(dyr[c]);
      const float gg = d * to_f(gamma[c]);
      sums.a += gg;
      sums.b += gg * xh;
      dgamma_acc[at(c)] += d * xh;
      dbeta_acc[at(c)] += d;
    });
    for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
      float v[W], d[W], ga[W];
      cached<K, W>(xc, slot, xr + c0, v, false);
      load<W>(dyr + c0, d);
      load_maybe<W>(gamma + c0, ga, pvec);
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const float xh = (v[i] - mean) * rstd, gg = d[i] * ga[i];
        sums.a += gg;
        sums.b += gg * xh;
        dgamma_acc[at(c0 + i)] += d[i] * xh;
        dbeta_acc[at(c0 + i)] += d[i];
      }
    });
    sums = group_reduce<kBlockRow>(sums, AddOp{}, sh2);
    const float mean_g = sums.a * inv_cols, mean_gx = sums.b * inv_cols;

    for_edges(s, g.tid, g.n, [&](int64_t c) {
      const float xh = (to_f(xr[c]) - mean) * rstd;
      const float gg = to_f(dyr[c]) * to_f(gamma[c]);
      dxr[c] = from_f<T>(rstd * (gg - mean_g - xh * mean_gx));
    });
    for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
      float v[W], d[W], ga[W], out[W];
      cached<K, W>(xc, slot, xr + c0, v, false);
      load<W>(dyr + c0, d);
      load_maybe<W>(gamma + c0, ga, pvec);
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const float xh = (v[i] - mean) * rstd;
        out[i] = rstd * (d[i] * ga[i] - mean_g - xh * mean_gx);
      }
      store<W>(dxr + c0, out);
    });
    // The next row may give this row's columns to other lanes of the group.
    if constexpr (kBlockRow)
      __syncthreads();
    else
      __syncwarp();
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float dg = 0.0f, db = 0.0f;
    for (int k = 0; k < g.groups; ++k) {
      dg += acc[static_cast<int64_t>(k) * 2 * padded + at(c)];
      db += acc[static_cast<int64_t>(k) * 2 * padded + padded + at(c)];
    }
    partial[(static_cast<int64_t>(blockIdx.x) * 2) * cols + c] = dg;
    partial[(static_cast<int64_t>(blockIdx.x) * 2 + 1) * cols + c] = db;
  }
}

// dgamma[c] = sum over blocks of partial[b][0][c] (dbeta: [1]), in block order: a 32x32 block
// per 32 columns, thread (x, y) summing blocks y, y + 32, ..., then the 32 sums in y order.
template <typename T>
__global__ void column_sum_kernel(const float* __restrict__ partial, int64_t nblocks, int64_t cols,
                                  T* __restrict__ dgamma, T* __restrict__ dbeta) {
  __shared__ float sh[2][kWarp][kWarp + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  float a = 0.0f, b = 0.0f;
  if (c < cols) {
    for (int64_t k = threadIdx.y; k < nblocks; k += kWarp) {
      a += partial[(k * 2) * cols + c];
      b += partial[(k * 2 + 1) * cols + c];
    }
  }
  sh[0][threadIdx.y][threadIdx.x] = a;
  sh[1][threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float sa = 0.0f, sb = 0.0f;
    for (int k = 0; k < kWarp; ++k) {
      sa += sh[0][k][threadIdx.x];
      sb += sh[1][k][threadIdx.x];
    }
    dgamma[c] = from_f<T>(sa);
    dbeta[c] = from_f<T>(sb);
  }
}

// ---- softmax / log_softmax and their grads --------------------------------------------------

template <typename T, int W, int K, bool kBlockRow>
__global__ void __launch_bounds__(kBlockRow ? kMaxBlockThreads : kWarp * kWarpRowsPerBlock)
    softmax_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t cols,
                   bool log) {
  __shared__ MaxSum sh[kWarp];
  const RowGroup<kBlockRow> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  if (row >= rows) return;
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  const RowSplit s = split_row<W>(xr, cols);
  float cache[K][W];

  MaxSum st{-INFINITY, 0.0f};
  for_edges(s, g.tid, g.n, [&](int64_t c) { add_to(st, to_f(xr[c])); });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W];
    cached<K, W>(cache, slot, xr + c0, v, true);
    add_to<W>(st, v);
  });
  st = group_reduce<kBlockRow>(st, MergeOp{}, sh);
  const float max = st.m, inv_sum = 1.0f / st.s, log_sum = logf(st.s);
  auto f = [&](float v) { return log ? v - max - log_sum : expf(v - max) * inv_sum; };

  for_edges(s, g.tid, g.n, [&](int64_t c) { yr[c] = from_f<T>(f(to_f(xr[c]))); });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W];
    cached<K, W>(cache, slot, xr + c0, v, false);
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = f(v[i]);
    store<W>(yr + c0, v);
  });
}

// dx = y * (dy - sum(dy * y)) (softmax) or dy - exp(y) * sum(dy) (log_softmax).
template <typename T, int W, int K, bool kBlockRow>
__global__ void __launch_bounds__(kBlockRow ? kMaxBlockThreads : kWarp * kWarpRowsPerBlock)
    softmax_grad_kernel(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                        int64_t rows, int64_t cols, bool log) {
  __shared__ float sh[kWarp];
  const RowGroup<kBlockRow> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  if (row >= rows) return;
  const T* yr = y + row * cols;
  const T* dyr = dy + row * cols;
  T* dxr = dx + row * cols;
  const RowSplit s = split_row<W>(yr, cols);
  float yc[K][W], dc[K][W];

  float total = 0.0f;
  for_edges(s, g.tid, g.n,
            [&](int64_t c) { total += log ? to_f(dyr[c]) : to_f(dyr[c]) * to_f(yr[c]); });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W], d[W];
    cached<K, W>(yc, slot, yr + c0, v, true);
    cached<K, W>(dc, slot, dyr + c0, d, true);
#pragma unroll
    for (int i = 0; i < W; ++i) total += log ? d[i] : d[i] * v[i];
  });
  total = group_reduce<kBlockRow>(total, AddOp{}, sh);
  auto f = [&](float yv, float dv) { return log ? dv - expf(yv) * total : yv * (dv - total); };

  for_edges(s, g.tid, g.n, [&](int64_t c) { dxr[c] = from_f<T>(f(to_f(yr[c]), to_f(dyr[c]))); });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W], d[W];
    cached<K, W>(yc, slot, yr + c0, v, false);
    cached<K, W>(dc, slot, dyr + c0, d, false);
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = f(v[i], d[i]);
    store<W>(dxr + c0, v);
  });
}

// ---- cross_entropy --------------------------------------------------------------------------

__device__ __forceinline__ int64_t load_label(const void* labels, bool labels64, int64_t row) {
  return labels64 ? static_cast<const int64_t*>(labels)[row]
                  : static_cast<int64_t>(static_cast<const int32_t*>(labels)[row]);
}

// Per-row loss: logsumexp(row) - row[label] in one online pass. kNone writes it to out (type
// T); otherwise to row_loss (f32) for the finishing kernel. Ignored rows: 0.
template <typename T, int W, int K, bool kBlockRow>
__global__ void __launch_bounds__(kBlockRow ? kMaxBlockThreads : kWarp * kWarpRowsPerBlock)
    cross_entropy_kernel(const T* __restrict__ logits, const void* labels, bool labels64,
                         T* __restrict__ out, float* __restrict__ row_loss, int64_t rows,
                         int64_t vocab, int64_t ignore_index) {
  __shared__ MaxSum sh[kWarp];
  const RowGroup<kBlockRow> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  if (row >= rows) return;
  const int64_t label = load_label(labels, labels64, row);
  float loss = 0.0f;
  if (label != ignore_index) {  // uniform across the group
    const T* xr = logits + row * vocab;
    const RowSplit s = split_row<W>(xr, vocab);
    MaxSum st{-INFINITY, 0.0f};
    for_edges(s, g.tid, g.n, [&](int64_t c) { add_to(st, to_f(xr[c])); });
    // One pass: nothing to cache (K is unused here beyond the unrolled first vectors).
    for_vecs<K, W>(s, g.tid, g.n, [&](int, int64_t c0) {
      float v[W];
      load<W>(xr + c0, v);
      add_to<W>(st, v);
    });
    st = group_reduce<kBlockRow>(st, MergeOp{}, sh);
    if (label >= 0 && label < vocab) {
      loss = st.m + logf(st.s) - to_f(xr[label]);
    } else {
      loss = NAN;
      if (g.tid == 0) record_device_error(kCrossEntropyLabelError, label, row, vocab, ignore_index);
    }
  }
  if (g.tid == 0) {
    if (out != nullptr)
      out[row] = from_f<T>(loss);
    else
      row_loss[row] = loss;
  }
}

// out[0] = sum (or mean over counted rows) of row_loss; one block, fixed order.
template <typename T>
__global__ void __launch_bounds__(1024)
    cross_entropy_finish_kernel(const float* __restrict__ row_loss, const void* labels,
                                bool labels64, int64_t rows, int64_t ignore_index, bool mean,
                                T* __restrict__ out) {
  __shared__ Sum2 sh[kWarp];
  Sum2 acc{0.0f, 0.0f};  // loss, counted rows (exact in f32 up to 2^24 rows)
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    acc.a += row_loss[r];
    acc.b += load_label(labels, labels64, r) != ignore_index ? 1.0f : 0.0f;
  }
  acc = group_reduce<true>(acc, AddOp{}, sh);
  if (threadIdx.x == 0) out[0] = from_f<T>(mean ? (acc.b == 0.0f ? 0.0f : acc.a / acc.b) : acc.a);
}

// Rows whose label is not ignore_index, into *count (one block).
__global__ void __launch_bounds__(1024)
    count_labels_kernel(const void* labels, bool labels64, int64_t rows, int64_t ignore_index,
                        float* count) {
  __shared__ float sh[kWarp];
  float n = 0.0f;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
    n += load_label(labels, labels64, r) != ignore_index ? 1.0f : 0.0f;
  n = group_reduce<true>(n, AddOp{}, sh);
  if (threadIdx.x == 0) *count = n;
}

// dlogits = (softmax(row) - one_hot(label)) * scale; scale = dloss[row] (kNone), dloss[0]
// (kSum) or dloss[0] / *count (kMean). Ignored rows: 0.
template <typename T, int W, int K, bool kBlockRow>
__global__ void __launch_bounds__(kBlockRow ? kMaxBlockThreads : kWarp * kWarpRowsPerBlock)
    cross_entropy_grad_kernel(const T* __restrict__ logits, const void* labels, bool labels64,
                              const T* __restrict__ dloss, const float* __restrict__ count,
                              T* __restrict__ dlogits, int64_t rows, int64_t vocab,
                              int64_t ignore_index, int reduction) {
  __shared__ MaxSum sh[kWarp];
  const RowGroup<kBlockRow> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  if (row >= rows) return;
  const int64_t label = load_label(labels, labels64, row);
  const T* xr = logits + row * vocab;
  T* dr = dlogits + row * vocab;
  const RowSplit s = split_row<W>(xr, vocab);
  if (label == ignore_index) {
    float zero[W] = {};
    for_edges(s, g.tid, g.n, [&](int64_t c) { dr[c] = from_f<T>(0.0f); });
    for_vecs<K, W>(s, g.tid, g.n, [&](int, int64_t c0) { store<W>(dr + c0, zero); });
    return;
  }
  float scale = to_f(dloss[reduction == static_cast<int>(Reduction::kNone) ? row : 0]);
  if (reduction == static_cast<int>(Reduction::kMean)) scale /= *count;
  if (label < 0 || label >= vocab) {
    scale = NAN;
    if (g.tid == 0)
      record_device_error(kCrossEntropyGradLabelError, label, row, vocab, ignore_index);
  }
  float cache[K][W];
  MaxSum st{-INFINITY, 0.0f};
  for_edges(s, g.tid, g.n, [&](int64_t c) { add_to(st, to_f(xr[c])); });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W];
    cached<K, W>(cache, slot, xr + c0, v, true);
    add_to<W>(st, v);
  });
  st = group_reduce<kBlockRow>(st, MergeOp{}, sh);
  const float max = st.m, inv_sum = 1.0f / st.s;
  for_edges(s, g.tid, g.n, [&](int64_t c) {
    const float p = expf(to_f(xr[c]) - max) * inv_sum;
    dr[c] = from_f<T>((p - (c == label ? 1.0f : 0.0f)) * scale);
  });
  for_vecs<K, W>(s, g.tid, g.n, [&](int slot, int64_t c0) {
    float v[W];
    cached<K, W>(cache, slot, xr + c0, v, false);
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float p = expf(v[i] - max) * inv_sum;
      v[i] = (p - (c0 + i == label ? 1.0f : 0.0f)) * scale;
    }
    store<W>(dr + c0, v);
  });
}

// ---- gelu -----------------------------------------------------------------------------------

// gelu and d gelu / dx: the lines of ops/elementwise_math.h.
__device__ __forceinline__ float gelu_f(float x, bool tanh_form) {
  return tanh_form ? math::GeluTanh::apply<DeviceMath>(x) : math::GeluErf::apply<DeviceMath>(x);
}
__device__ __forceinline__ float gelu_derivative_f(float x, bool tanh_form) {
  return tanh_form ? math::gelu_tanh_derivative<DeviceMath>(x)
                   : math::gelu_erf_derivative<DeviceMath>(x);
}

// Items 0..nchunks-1 are N-element chunks, the rest single tail elements.
template <typename T, int N>
__global__ void gelu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, bool tanh_form) {
  const int64_t nchunks = n / N, items = nchunks + n % N;
  for (int64_t it = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (it < nchunks) {
      float v[N];
      load<N>(x + it * N, v);
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = gelu_f(v[i], tanh_form);
      store<N>(y + it * N, v);
    } else {
      const int64_t i = nchunks * N + (it - nchunks);
      y[i] = from_f<T>(gelu_f(to_f(x[i]), tanh_form));
    }
  }
}

template <typename T, int N>
__global__ void gelu_grad_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                 T* __restrict__ dx, int64_t n, bool tanh_form) {
  const int64_t nchunks = n / N, items = nchunks + n % N;
  for (int64_t it = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (it < nchunks) {
      float v[N], d[N];
      load<N>(x + it * N, v);
      load<N>(dy + it * N, d);
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = d[i] * gelu_derivative_f(v[i], tanh_form);
      store<N>(dx + it * N, v);
    } else {
      const int64_t i = nchunks * N + (it - nchunks);
      dx[i] = from_f<T>(to_f(dy[i]) * gelu_derivative_f(to_f(x[i]), tanh_form));
    }
  }
}

// Grid for a grid-stride elementwise loop: enough blocks to fill the machine a few times over.
dim3 elementwise_grid(int64_t items, int threads) {
  const int64_t wanted = ceil_div(std::max<int64_t>(items, 1), threads);
  return dim3(
      static_cast<unsigned>(std::min<int64_t>(wanted, static_cast<int64_t>(sm_count()) * 16)));
}

// ---- rotary_embedding -----------------------------------------------------------------------

// Items are N-element chunks of a row's first half (columns i .. i+N-1 < D/2) together with the
// matching chunk of its second half (i + D/2 ...): the pairs that rotate together. Row r is at
// position (r / heads) % t; the angle of column i is position * base^(-2i/D) (f32, as PyTorch's
// tables), negated for the inverse rotation. Memory-bound: one read and one write of x.
template <typename T, int N>
__global__ void rotary_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                              int64_t t, int64_t heads, int64_t half, float log2_base,
                              float sign) {
  const int64_t chunks = half / N, items = rows * chunks;
  const float inv_d = 1.0f / static_cast<float>(2 * half);
  for (int64_t it = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = it / chunks, i0 = (it % chunks) * N;
    const float position = sign * static_cast<float>(row / heads % t);
    const T* x1 = x + row * 2 * half + i0;
    T* y1 = y + row * 2 * half + i0;
    float a[N], b[N];
    if constexpr (N > 1) {
      load<N>(x1, a);
      load<N>(x1 + half, b);
    } else {
      a[0] = to_f(x1[0]);
      b[0] = to_f(x1[half]);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float frequency = exp2f(-2.0f * static_cast<float>(i0 + k) * inv_d * log2_base);
      float s, c;
      sincosf(position * frequency, &s, &c);
      const float x1k = a[k], x2k = b[k];
      a[k] = x1k * c - x2k * s;
      b[k] = x2k * c + x1k * s;
    }
    if constexpr (N > 1) {
      store<N>(y1, a);
      store<N>(y1 + half, b);
    } else {
      y1[0] = from_f<T>(a[0]);
      y1[half] = from_f<T>(b[0]);
    }
  }
}

// ---- optimizer updates ----------------------------------------------------------------------

constexpr int kUpdateChunk = 4;

// No __restrict__: the executor writes the updated param and state over their inputs (in
// place), and each element is read before it is written by one thread. The per-step constants
// (bias corrections in f64) once per thread; the element update is the rule's (rules.h).
template <class Rule, typename P, typename G, typename S>
__global__ void update_kernel(UpdateTensor x, optim::HyperValues h, const void* lr_ptr, DType lr_t,
                              const void* step_ptr, DType step_t, bool vec) {
  constexpr int kSlots = Rule::kSlots;
  const auto c = Rule::template prepare<float>(h, load_scalar(lr_ptr, lr_t), load_scalar(step_ptr, step_t));
  const P* param = static_cast<const P*>(x.param);
  const G* grad = static_cast<const G*>(x.grad);
  P* param_out = static_cast<P*>(x.param_out);
  constexpr int N = kUpdateChunk;
  const int64_t n = x.n, nchunks = vec ? n / N : 0, items = nchunks + (n - nchunks * N);
  for (int64_t it = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (it < nchunks) {
      float p[N], g[N], s[kSlots][N];
      load<N>(param + it * N, p);
      load<N>(grad + it * N, g);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) load<N>(static_cast<const S*>(x.slots[j]) + it * N, s[j]);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float si[kSlots];
#pragma unroll
        for (int j = 0; j < kSlots; ++j) si[j] = s[j][i];
        p[i] = Rule::apply(c, p[i], g[i], si);
#pragma unroll
        for (int j = 0; j < kSlots; ++j) s[j][i] = si[j];
      }
      store<N>(param_out + it * N, p);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) store<N>(static_cast<S*>(x.slots_out[j]) + it * N, s[j]);
    } else {
      const int64_t i = nchunks * N + (it - nchunks);
      float si[kSlots];
#pragma unroll
      for (int j = 0; j < kSlots; ++j) si[j] = to_f(static_cast<const S*>(x.slots[j])[i]);
      param_out[i] = from_f<P>(Rule::apply(c, to_f(param[i]), to_f(grad[i]), si));
#pragma unroll
      for (int j = 0; j < kSlots; ++j) static_cast<S*>(x.slots_out[j])[i] = from_f<S>(si[j]);
    }
  }
}

// Calls fn(Tag<P>, Tag<G>, Tag<S>) for a supported combination.
template <typename Fn>
bool visit_update_types(DType p, DType g, DType s, Fn&& fn) {
  auto same = [&](auto tag) {
    using T = typename decltype(tag)::type;
    fn(Tag<T>{}, Tag<T>{}, Tag<T>{});
  };
  if (p == g && g == s && is_storage_float(p)) {
    visit_float(p, same);
    return true;
  }
  if (p == g && s == DType::kF32 && p == DType::kBF16)
    return fn(Tag<bf16>{}, Tag<bf16>{}, Tag<float>{}), true;
  if (p == g && s == DType::kF32 && p == DType::kF16)
    return fn(Tag<f16>{}, Tag<f16>{}, Tag<float>{}), true;
  if (p == DType::kF32 && s == DType::kF32 && g == DType::kBF16)
    return fn(Tag<float>{}, Tag<bf16>{}, Tag<float>{}), true;
  if (p == DType::kF32 && s == DType::kF32 && g == DType::kF16)
    return fn(Tag<float>{}, Tag<f16>{}, Tag<float>{}), true;
  return false;
}

bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- gather / scatter_add -------------------------------------------------------------------

// out row j = (o, p) <- table row (o, indices[p]); rows of `units` elements of type U.
template <typename U>
__global__ void gather_kernel(const U* __restrict__ table, const void* indices, bool indices64,
                              U* __restrict__ out, int64_t n, int64_t dim, int64_t units,
                              int64_t total_rows) {
  for (int64_t j = blockIdx.x; j < total_rows; j += gridDim.x) {
    const int64_t o = j / n, p = j % n;
    const int64_t index = load_label(indices, indices64, p);
    U* dst = out + j * units;
    if (index < 0 || index >= dim) {
      if (threadIdx.x == 0) record_device_error(kGatherIndexError, index, p, dim);
      U bad;
      memset(&bad, 0xFF, sizeof(U));
      for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = bad;
      continue;
    }
    const U* src = table + (o * dim + index) * units;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = src[u];
  }
}

// Sort keys: the index, or dim for an out-of-range one (sorted last, then skipped; recorded as
// a data error).
__global__ void scatter_keys_kernel(const void* indices, bool indices64, int64_t n, int64_t dim,
                                    uint32_t* keys, uint32_t* positions) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= n) return;
  const int64_t index = load_label(indices, indices64, p);
  const bool bad = index < 0 || index >= dim;
  if (bad) record_device_error(kScatterAddIndexError, index, p, dim);
  keys[p] = static_cast<uint32_t>(bad ? dim : index);
  positions[p] = static_cast<uint32_t>(p);
}

// The sorted entries in chunks of `chunk`, one block each, so that no block sums more than one
// chunk of rows however long a run of equal keys is (a type-id embedding's whole batch is one
// run). A run inside one chunk is summed here and written: out = base + its rows, in position
// order (the sort is stable). A run that crosses a chunk boundary leaves each chunk's part of
// it in `partial` instead: slot 0 the part continuing a run from the chunk before, slot 1 the
// part starting one that continues into the next; scatter_crossing_kernel adds them up in
// order. So the result is deterministic.
template <typename T>
__global__ void scatter_chunks_kernel(const T* __restrict__ base, const T* __restrict__ updates,
                                      const uint32_t* __restrict__ keys,
                                      const uint32_t* __restrict__ positions, T* __restrict__ out,
                                      float* __restrict__ partial, int64_t outer, int64_t dim,
                                      int64_t inner, int64_t n, int64_t chunk) {
  const int64_t begin = blockIdx.x * chunk, end = min(begin + chunk, n), width = outer * inner;
  for (int64_t s = begin, e; s < end; s = e) {
    const uint32_t key = keys[s];
    for (e = s + 1; e < end && keys[e] == key;) ++e;
    if (key >= dim) continue;  // out of range: recorded by scatter_keys_kernel
    const bool from_before = s == begin && begin > 0 && keys[begin - 1] == key;
    const bool into_next = e == end && end < n && keys[end] == key;
    for (int64_t x = threadIdx.x; x < width; x += blockDim.x) {
      const int64_t o = x / inner, c = x % inner;
      float acc = 0.f;
      for (int64_t k = s; k < e; ++k) acc += to_f(updates[(o * n + positions[k]) * inner + c]);
      if (from_before || into_next) {
        partial[(blockIdx.x * 2 + (from_before ? 0 : 1)) * width + x] = acc;
      } else {
        const int64_t dst = (o * dim + key) * inner + c;
        out[dst] = from_f<T>(to_f(base[dst]) + acc);
      }
    }
  }
}

// Block b - 1 takes the run crossing the boundary before chunk b when the run starts in chunk
// b - 1 (so each crossing run has one block): base + its parts, chunk by chunk.
template <typename T>
__global__ void scatter_crossing_kernel(const T* __restrict__ base, const uint32_t* __restrict__ keys,
                                        T* __restrict__ out, const float* __restrict__ partial,
                                        int64_t outer, int64_t dim, int64_t inner, int64_t n,
                                        int64_t chunk) {
  const int64_t b = blockIdx.x + 1, first = b * chunk, previous = first - chunk, width = outer * inner;
  const uint32_t key = keys[first];
  if (key >= dim || keys[first - 1] != key) return;          // no run crosses this boundary
  if (previous > 0 && keys[previous - 1] == key) return;    // it started before chunk b - 1
  for (int64_t x = threadIdx.x; x < width; x += blockDim.x) {
    float acc = partial[((b - 1) * 2 + 1) * width + x];
    for (int64_t c = b;; ++c) {
      acc += partial[c * 2 * width + x];
      if ((c + 1) * chunk >= n || keys[(c + 1) * chunk] != key) break;
    }
    const int64_t o = x / inner, col = x % inner, dst = (o * dim + key) * inner + col;
    out[dst] = from_f<T>(to_f(base[dst]) + acc);
  }
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------

void layer_norm(DType t, const void* x, const void* gamma, const void* beta, void* y, int64_t rows,
                int64_t cols, float eps, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = same_alignment({x, y});
    const bool params_aligned = aligned16(gamma) && aligned16(beta);
    dispatch_rows<T>(cols, vec, [&](auto w, auto k, auto block_row) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      constexpr bool kBlock = decltype(block_row)::value;
      const RowLaunch l = row_launch<kBlock>(rows, cols, W, K);
      layer_norm_kernel<T, W, K, kBlock><<<l.grid, l.block, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(beta),
          static_cast<T*>(y), rows, cols, eps, params_aligned);
      KILN_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void layer_norm_grad(DType t, const void* x, const void* gamma, const void* dy, void* dx,
                     void* dgamma, void* dbeta, int64_t rows, int64_t cols, float eps,
                     cudaStream_t stream) {
  if (cols == 0) return;
  KILN_CHECK(cols <= kLayerNormGradMaxCols, "cuda-nn layer_norm_grad: {} columns, at most {}", cols,
             kLayerNormGradMaxCols);
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = same_alignment({x, dy, dx});
    const bool params_aligned = aligned16(gamma);
    dispatch_rows<T>(cols, vec, [&](auto w, auto k, auto block_row) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      constexpr bool kBlock = decltype(block_row)::value;
      auto kernel = layer_norm_grad_kernel<T, W, K, kBlock>;
      const int threads = kBlock ? block_threads(cols, W, K) : kWarp * kLnGradWarpsPerBlock;
      const int groups = kBlock ? 1 : kLnGradWarpsPerBlock;
      const size_t smem = static_cast<size_t>(groups) * 2 * ceil_div(cols, W) * W * sizeof(float);
      // The default dynamic limit is 48 KiB minus the kernel's static shared memory.
      if (smem + 1024 > 48 * 1024)
        KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
      int per_sm = 0;
      KILN_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
      const int64_t blocks = std::max<int64_t>(
          1, std::min<int64_t>(ceil_div(std::max<int64_t>(rows, 1), groups),
                               static_cast<int64_t>(sm_count()) * std::max(per_sm, 1)));
      Scratch partial(static_cast<size_t>(blocks) * 2 * cols * sizeof(float), stream);
      kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(dy),
          static_cast<T*>(dx), partial.as<float>(), rows, cols, eps, params_aligned);
      KILN_CUDA_CHECK(cudaGetLastError());
      column_sum_kernel<T>
          <<<static_cast<unsigned>(ceil_div(cols, kWarp)), dim3(kWarp, kWarp), 0, stream>>>(
              partial.as<float>(), blocks, cols, static_cast<T*>(dgamma), static_cast<T*>(dbeta));
      KILN_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void softmax(DType t, const void* x, void* y, int64_t rows, int64_t cols, bool log,
             cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_rows<T>(cols, same_alignment({x, y}), [&](auto w, auto k, auto block_row) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      constexpr bool kBlock = decltype(block_row)::value;
      const RowLaunch l = row_launch<kBlock>(rows, cols, W, K);
      softmax_kernel<T, W, K, kBlock><<<l.grid, l.block, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), rows, cols, log);
      KILN_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void softmax_grad(DType t, const void* y, const void* dy, void* dx, int64_t rows, int64_t cols,
                  bool log, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_rows<T>(cols, same_alignment({y, dy, dx}), [&](auto w, auto k, auto block_row) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      constexpr bool kBlock = decltype(block_row)::value;
      const RowLaunch l = row_launch<kBlock>(rows, cols, W, K);
      softmax_grad_kernel<T, W, K, kBlock>
          <<<l.grid, l.block, 0, stream>>>(static_cast<const T*>(y), static_cast<const T*>(dy),
                                           static_cast<T*>(dx), rows, cols, log);
      KILN_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void cross_entropy(DType t, const void* logits, DType label_t, const void* labels, void* out,
                   int64_t rows, int64_t vocab, int64_t ignore_index, Reduction reduction,
                   cudaStream_t stream) {
  const bool labels64 = label_t == DType::kI64;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows == 0) {  // no rows: "none" has nothing to write; mean and sum are 0
      if (reduction != Reduction::kNone)
        KILN_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(T), stream));
      return;
    }
    const bool none = reduction == Reduction::kNone;
    Scratch row_loss(none ? 0 : static_cast<size_t>(rows) * sizeof(float), stream);
    dispatch_rows<T>(vocab, true, [&](auto w, auto, auto block_row) {
      constexpr int W = decltype(w)::value;
      constexpr bool kBlock = decltype(block_row)::value;
      const RowLaunch l = row_launch<kBlock>(rows, vocab, W, 8 / W > 0 ? 8 / W : 1);
      cross_entropy_kernel<T, W, 1, kBlock><<<l.grid, l.block, 0, stream>>>(
          static_cast<const T*>(logits), labels, labels64, none ? static_cast<T*>(out) : nullptr,
          row_loss.as<float>(), rows, vocab, ignore_index);
      KILN_CUDA_CHECK(cudaGetLastError());
    });
    if (!none) {
      cross_entropy_finish_kernel<T>
          <<<1, 1024, 0, stream>>>(row_loss.as<float>(), labels, labels64, rows, ignore_index,
                                   reduction == Reduction::kMean, static_cast<T*>(out));
      KILN_CUDA_CHECK(cudaGetLastError());
    }
  });
}

void cross_entropy_grad(DType t, const void* logits, DType label_t, const void* labels,
                        const void* dloss, void* dlogits, int64_t rows, int64_t vocab,
                        int64_t ignore_index, Reduction reduction, cudaStream_t stream) {
  if (rows == 0 || vocab == 0) return;
  const bool labels64 = label_t == DType::kI64;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Scratch count(sizeof(float), stream);
    if (reduction == Reduction::kMean) {
      count_labels_kernel<<<1, 1024, 0, stream>>>(labels, labels64, rows, ignore_index,
                                                  count.as<float>());
      KILN_CUDA_CHECK(cudaGetLastError());
    }
    dispatch_rows<T>(vocab, same_alignment({logits, dlogits}), [&](auto w, auto k, auto block_row) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      constexpr bool kBlock = decltype(block_row)::value;
      const RowLaunch l = row_launch<kBlock>(rows, vocab, W, K);
      cross_entropy_grad_kernel<T, W, K, kBlock><<<l.grid, l.block, 0, stream>>>(
          static_cast<const T*>(logits), labels, labels64, static_cast<const T*>(dloss),
          count.as<float>(), static_cast<T*>(dlogits), rows, vocab, ignore_index,
          static_cast<int>(reduction));
      KILN_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void gelu(DType t, const void* x, void* y, int64_t n, bool tanh_form, cudaStream_t stream) {
  if (n == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int N = 16 / sizeof(T);
    const int threads = 256;
    if (aligned16(x) && aligned16(y)) {
      gelu_kernel<T, N><<<elementwise_grid(n / N + n % N, threads), threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), n, tanh_form);
    } else {
      gelu_kernel<T, 1><<<elementwise_grid(n, threads), threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), n, tanh_form);
    }
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void gelu_grad(DType t, const void* x, const void* dy, void* dx, int64_t n, bool tanh_form,
               cudaStream_t stream) {
  if (n == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int N = 16 / sizeof(T);
    const int threads = 256;
    if (aligned16(x) && aligned16(dy) && aligned16(dx)) {
      gelu_grad_kernel<T, N><<<elementwise_grid(n / N + n % N, threads), threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), n, tanh_form);
    } else {
      gelu_grad_kernel<T, 1><<<elementwise_grid(n, threads), threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), n, tanh_form);
    }
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void rotary_embedding(DType t, const void* x, void* y, int64_t rows, int64_t positions,
                      int64_t heads, int64_t d, double base, bool inverse, cudaStream_t stream) {
  const int64_t half = d / 2;
  if (rows == 0 || half == 0) return;
  const float log2_base = static_cast<float>(std::log2(base)), sign = inverse ? -1.0f : 1.0f;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int N = 16 / sizeof(T);
    const int threads = 256;
    // 16-byte chunks when both halves of every row start 16-byte aligned.
    if (half % N == 0 && aligned16(x) && aligned16(y)) {
      rotary_kernel<T, N><<<elementwise_grid(rows * (half / N), threads), threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), rows, positions, heads, half, log2_base,
          sign);
    } else {
      rotary_kernel<T, 1><<<elementwise_grid(rows * half, threads), threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), rows, positions, heads, half, log2_base,
          sign);
    }
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

bool update_types_supported(DType param, DType grad, DType state) {
  return visit_update_types(param, grad, state, [](auto, auto, auto) {});
}

void optimizer_update(const char* optimizer, const optim::HyperValues& h, DType param_t, DType grad_t,
                      DType state_t, const UpdateTensor& x, DType lr_t, const void* lr, DType step_t,
                      const void* step, cudaStream_t stream) {
  if (x.n == 0) return;
  bool typed = true;
  const bool known = optim::visit_rule(optimizer, [&](auto rule) {
    using Rule = decltype(rule);
    typed = visit_update_types(param_t, grad_t, state_t, [&](auto pt, auto gt, auto st) {
      using P = typename decltype(pt)::type;
      using G = typename decltype(gt)::type;
      using S = typename decltype(st)::type;
      bool vec = aligned_to(x.param, 4 * sizeof(P)) && aligned_to(x.param_out, 4 * sizeof(P)) &&
                 aligned_to(x.grad, 4 * sizeof(G));
      for (int j = 0; j < Rule::kSlots; ++j)
        vec = vec && aligned_to(x.slots[j], 4 * sizeof(S)) && aligned_to(x.slots_out[j], 4 * sizeof(S));
      const int threads = 256;
      const int64_t items = vec ? x.n / kUpdateChunk + x.n % kUpdateChunk : x.n;
      update_kernel<Rule, P, G, S><<<elementwise_grid(items, threads), threads, 0, stream>>>(
          x, h, lr, lr_t, step, step_t, vec);
      KILN_CUDA_CHECK(cudaGetLastError());
    });
  });
  KILN_CHECK(known, "cuda-nn optimizer_update: no rule for optimizer '{}'", optimizer);
  KILN_CHECK(typed, "cuda-nn optimizer_update: unsupported types (param {}, grad {}, state {})",
             static_cast<int>(param_t), static_cast<int>(grad_t), static_cast<int>(state_t));
}

void gather(const void* table, int64_t elem_bytes, DType index_t, const void* indices, void* out,
            int64_t outer, int64_t dim, int64_t inner, int64_t n, cudaStream_t stream) {
  const int64_t total_rows = outer * n, row_bytes = inner * elem_bytes;
  if (total_rows == 0 || row_bytes == 0) return;
  const bool indices64 = index_t == DType::kI64;
  auto launch = [&](auto unit) {
    using U = typename decltype(unit)::type;
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
    const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(units, kWarp) * kWarp));
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(total_rows, 1 << 20));
    gather_kernel<U><<<blocks, threads, 0, stream>>>(static_cast<const U*>(table), indices,
                                                     indices64, static_cast<U*>(out), n, dim, units,
                                                     total_rows);
    KILN_CUDA_CHECK(cudaGetLastError());
  };
  // The widest unit that divides a row and to which both bases are aligned.
  auto fits = [&](int64_t u) {
    return row_bytes % u == 0 && aligned_to(table, u) && aligned_to(out, u);
  };
  if (fits(16))
    launch(Tag<uint4>{});
  else if (fits(8))
    launch(Tag<uint2>{});
  else if (fits(4))
    launch(Tag<uint32_t>{});
  else if (fits(2))
    launch(Tag<uint16_t>{});
  else
    launch(Tag<uint8_t>{});
}

void scatter_add(DType t, const void* base, DType index_t, const void* indices, const void* updates,
                 void* out, int64_t outer, int64_t dim, int64_t inner, int64_t n,
                 cudaStream_t stream) {
  KILN_CHECK(dim < (int64_t{1} << 31) && n < (int64_t{1} << 31),
             "cuda-nn scatter_add: dim {} and {} indices must be below 2^31", dim, n);
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t total = outer * dim * inner;
    if (total > 0 && out != base)
      KILN_CUDA_CHECK(cudaMemcpyAsync(out, base, static_cast<size_t>(total) * sizeof(T),
                                      cudaMemcpyDeviceToDevice, stream));
    if (n == 0 || total == 0) return;
    int bits = 1;
    while ((int64_t{1} << bits) <= dim) ++bits;  // keys are in [0, dim]
    size_t temp_bytes = 0;
    KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr), static_cast<int>(n),
        0, bits, stream));
    const size_t array_bytes = (static_cast<size_t>(n) * sizeof(uint32_t) + 255) / 256 * 256;
    Scratch scratch(4 * array_bytes + temp_bytes, stream);
    auto* bytes = scratch.as<unsigned char>();
    auto* keys_in = reinterpret_cast<uint32_t*>(bytes);
    auto* pos_in = reinterpret_cast<uint32_t*>(bytes + array_bytes);
    auto* keys = reinterpret_cast<uint32_t*>(bytes + 2 * array_bytes);
    auto* pos = reinterpret_cast<uint32_t*>(bytes + 3 * array_bytes);
    scatter_keys_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, stream>>>(
        indices, index_t == DType::kI64, n, dim, keys_in, pos_in);
    KILN_CUDA_CHECK(cudaGetLastError());
    KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(bytes + 4 * array_bytes, temp_bytes, keys_in,
                                                    keys, pos_in, pos, static_cast<int>(n), 0, bits,
                                                    stream));
    const int threads =
        static_cast<int>(std::min<int64_t>(256, ceil_div(outer * inner, kWarp) * kWarp));
    // Chunks of 32 entries, fewer (longer) past 2048 chunks, which bounds the partial sums.
    const int64_t chunk = std::max<int64_t>(32, ceil_div(n, 2048)), chunks = ceil_div(n, chunk);
    Scratch partial(static_cast<size_t>(chunks * 2 * outer * inner) * sizeof(float), stream);
    scatter_chunks_kernel<T><<<static_cast<unsigned>(chunks), threads, 0, stream>>>(
        static_cast<const T*>(base), static_cast<const T*>(updates), keys, pos,
        static_cast<T*>(out), partial.as<float>(), outer, dim, inner, n, chunk);
    KILN_CUDA_CHECK(cudaGetLastError());
    if (chunks > 1) {
      scatter_crossing_kernel<T><<<static_cast<unsigned>(chunks - 1), threads, 0, stream>>>(
          static_cast<const T*>(base), keys, static_cast<T*>(out), partial.as<float>(), outer,
          dim, inner, n, chunk);
    }
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace kiln::cuda::nn
