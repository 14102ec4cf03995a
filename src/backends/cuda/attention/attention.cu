// Flash attention on the GPU: forward and backward (FlashAttention-2's scheme), never
// materializing the Tq x Tk scores in device memory.
//
// Tensor-core path (bf16/f16, d == dv in {32, 64, 128}): CTAs of 4 warps, 64 query (or key) rows
// a CTA, 16 a warp; mma.sync m16n8k16 with f32 accumulators, operands through ldmatrix from
// padded shared-memory tiles filled by cp.async (double-buffered). Scores live in registers in
// the log2 domain (exp2f with scale * log2(e) folded in).
//   forward: query blocks, online softmax over key blocks, O += P V; writes the log-sum-exp of
//            each row (the op's lse output, natural log, f32).
//   backward (FlashAttention-2 with the saved lse): (1) a small memory-bound pre-pass writes
//            per row (lse * log2(e), D_i = dout_i . out_i) as a float2 into a stream-ordered
//            scratch buffer (cudaMallocAsync, 8 bytes a row); (2) dk/dv pass over key blocks,
//            each warp owning 16 keys and looping over the query blocks that see them,
//            P = exp2(s - lse) straight from the saved statistic (no reductions across CTAs);
//            (3) dq pass over query blocks, recomputing S and dP (a separate pass instead of
//            f32 atomics: deterministic, no dq accumulator).
// Simple path (f32, other head dims): the same passes with one warp per query (key) row and f32
// CUDA-core math.
// Both paths take q, k, v (dq, dk, dv) rows at a stride of their own (AttentionShape::
// qkv_row_stride): attention_qkv reads them in place from its packed (..., T, 3, H, D) and its
// gradient writes them in place; out, dout and lse keep the plain layouts.
// Grouped-query attention (AttentionShape::group > 1): a query problem reads the k and v tiles
// of its key/value problem (b / group); the dk/dv pass runs one CTA per key block of a
// key/value problem and loops over the query blocks of every query head of the group, so dk
// and dv are summed in registers and written once (no atomics, no reduction pass).
// A key bias (attention's key_bias: a padding mask) is a template parameter B of every kernel:
// with it each score gets its key's bias added (read from global memory, where the L1 keeps a
// block's 64 values; a finite bias stays finite in the log2 domain, so finfo.min is not -inf), a
// score of -inf gets P = 0 even where the row's statistic is -inf too, and a row whose every
// score is -inf is NaN (softmax's 0/0, as the reference); without it the kernels are the ones
// they were.
#include "backends/cuda/attention/attention.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/common/cuda_check.h"

namespace kiln::cuda {
namespace {

constexpr float kNegInf = -INFINITY;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlock = 64;  // rows of a query or key block (16 a warp)

enum Mode { kForward = 0, kDq = 1 };

constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;

// ---- element conversions ----

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats as one 32-bit register of two 16-bit values (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// A key_bias value in the log2 domain of the scores: -inf stays -inf (a masked key), and a finite
// one stays finite (torch.finfo.min * log2(e) would overflow to -inf: a row of them would be
// masked whole instead of uniform, as its softmax is).
template <typename T>
__device__ __forceinline__ float log2_bias(T b) {
  const float x = to_f32(b);
  return x == kNegInf ? kNegInf : fmaxf(x * kLog2e, -FLT_MAX);
}

__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fffffff); }

// ---- PTX wrappers ----

// c += a * b, m16n8k16, A row-major, B column-major, f32 accumulators.
template <typename T>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0,
                                                   uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float c[4], const uint32_t a[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// 16 bytes global -> shared; zero-filled when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}
// 8 bytes global -> shared; zero-filled when !valid.
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Flat row index of row t of attention problem b, for a tensor of `rows` rows a problem:
// "bhtd" (heads == 1) keeps a problem's rows together; "bthd" ((..., T, H, D), problem b =
// (leading index b / H, head b % H)) puts them H rows apart.
__device__ __forceinline__ int64_t row_index(int64_t b, int64_t t, int64_t rows, int heads) {
  return (b / heads * rows + t) * heads + b % heads;
}

// Element offset of row t of attention problem b in a tensor of `rows` rows a problem, `dim`
// elements a row, whose consecutive positions are `ld` elements apart: row_index(...) * dim
// when ld == heads * dim (the plain layouts); wider for q, k, v (dq, dk, dv) read from (written
// into) attention_qkv's packed (..., T, 3, H, D), where ld = 3 * H * D.
__device__ __forceinline__ int64_t row_offset(int64_t b, int64_t t, int64_t rows, int heads,
                                              int64_t ld, int dim) {
  return (b / heads * rows + t) * ld + b % heads * int64_t(dim);
}

// ---- tiles ----

// A kBlock x D tile in shared memory, rows padded by 16 bytes so that the 8 row addresses of
// an ldmatrix fall in distinct bank groups.
template <int D>
struct Tile {
  static constexpr int kStride = D + 8;  // elements
  static constexpr int kElems = kBlock * kStride;
};

// Rows [row0, row0 + kBlock) of a (rows, D) matrix whose rows are `ld` elements apart into a
// tile; rows past the end read as 0.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row0, int64_t rows,
                                          int64_t ld) {
  constexpr int kChunks = D / 8;  // 16-byte chunks a row
  for (int c = threadIdx.x; c < kBlock * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool valid = row0 + r < rows;
    const T* s = valid ? src + (row0 + r) * ld + col : src;
    cp_async16(tile + r * Tile<D>::kStride + col, s, valid);
  }
}

// A fragments (16 rows x D, row-major) of rows [row, row + 16) of a tile.
template <typename T, int D>
__device__ __forceinline__ void load_a_frags(uint32_t (&f)[D / 16][4], const T* tile, int row) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(f[kk], tile + (row + (lane & 15)) * Tile<D>::kStride + kk * 16 + (lane >> 4) * 8);
}

// acc[n] (16 x 64, n-tiles of 8) += A (16 x D, fragments) * B^T where B is a tile stored
// [n][k] (64 rows of D): scores q k^T, or dP = dout v^T.
template <typename T, int D>
__device__ __forceinline__ void mma_abt(float (&acc)[8][4], const uint32_t (&a)[D / 16][4],
                                        const T* tile) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, tile + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * Tile<D>::kStride +
                         kk * 16 + ((lane >> 3) & 1) * 8);
      mma<T>(acc[2 * np], a[kk], b[0], b[1]);
      mma<T>(acc[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc[n] (16 x D) += P (16 x 64, the f32 accumulators of an mma_abt, rounded to T) * B where B
// is a tile stored [k][n] (64 rows of D): O += P V, dq += dS K, dv += P^T dout, dk += dS^T q.
template <typename T, int D>
__device__ __forceinline__ void mma_pb(float (&acc)[D / 8][4], const float (&p)[8][4],
                                       const T* tile) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    a[0] = pack2<T>(p[2 * kk][0], p[2 * kk][1]);
    a[1] = pack2<T>(p[2 * kk][2], p[2 * kk][3]);
    a[2] = pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, tile + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) *
                                      Tile<D>::kStride +
                               dn * 16 + (lane >> 4) * 8);
      mma<T>(acc[2 * dn], a, b[0], b[1]);
      mma<T>(acc[2 * dn + 1], a, b[2], b[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// ---- tensor-core kernels ----

// One CTA = 64 query rows of one batch entry; loops over key blocks.
//   kForward: out = softmax(s) v, lse = the natural log-sum-exp of each row's scores.
//   kDq: out = dq = scale * dS k, from the pre-pass statistics (lse * log2(e), D) per row.
template <typename T, int D, int M, bool B>
__global__ void __launch_bounds__(kThreads) flash_rows_kernel(const T* __restrict__ q,
                                                              const T* __restrict__ k,
                                                              const T* __restrict__ v,
                                                              const T* __restrict__ dout,
                                                              const float2* __restrict__ stats,
                                                              T* __restrict__ out,
                                                              float* __restrict__ lse_out,
                                                              int64_t tq, int64_t tk, int heads,
                                                              int64_t q_ld, int kv_heads,
                                                              int group, int64_t kv_ld,
                                                              bool causal, float scale_log2,
                                                              float scale,
                                                              const T* __restrict__ bias,
                                                              int bias_heads) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_do = s_q + Tile<D>::kElems;  // only kDq
  T* s_k = s_do + (M == kForward ? 0 : Tile<D>::kElems);
  T* s_v = s_k + 2 * Tile<D>::kElems;

  const int64_t b = blockIdx.x;
  const int64_t q0 = (int64_t(gridDim.y) - 1 - blockIdx.y) * kBlock;  // heaviest blocks first
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Between a problem's rows (d == dv here): q (and dq) q_ld, k and v kv_ld, out and dout o_ld.
  const int64_t qrow0 = row_index(b, 0, tq, heads), o_ld = int64_t(heads) * D;
  const int64_t out_ld = M == kDq ? q_ld : o_ld;
  q += row_offset(b, 0, tq, heads, q_ld, D);
  k += row_offset(b / group, 0, tk, kv_heads, kv_ld, D);
  v += row_offset(b / group, 0, tk, kv_heads, kv_ld, D);
  if (M != kForward) dout += qrow0 * D;
  if (M == kDq) stats += qrow0;
  out += row_offset(b, 0, tq, heads, out_ld, D);
  if constexpr (B) bias += b / bias_heads * tk;

  int64_t n_kb = (tk + kBlock - 1) / kBlock;
  if (causal) n_kb = min(n_kb, (q0 + kBlock - 1) / kBlock + 1);

  load_tile<T, D>(s_q, q, q0, tq, q_ld);
  if (M != kForward) load_tile<T, D>(s_do, dout, q0, tq, o_ld);
  cp_async_commit();
  if (n_kb > 0) {
    load_tile<T, D>(s_k, k, 0, tk, kv_ld);
    load_tile<T, D>(s_v, v, 0, tk, kv_ld);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  uint32_t qf[D / 16][4], df[D / 16][4];
  load_a_frags<T, D>(qf, s_q, warp * 16);
  if (M != kForward) load_a_frags<T, D>(df, s_do, warp * 16);

  const int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f}, dsum[2] = {0.f, 0.f};
  float lse[2] = {INFINITY, INFINITY};  // kDq: rows past tq get P = 0
  if (M == kDq) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (row[h] < tq) {
        const float2 st = stats[row[h] * heads];
        lse[h] = st.x;
        dsum[h] = st.y;
      }
  }
  float acc[D / 8][4];  // kForward: O; kDq: dq
  zero(acc);

  for (int64_t kb = 0; kb < n_kb; ++kb) {
    const int buf = kb & 1;
    if (kb + 1 < n_kb) {
      load_tile<T, D>(s_k + (buf ^ 1) * Tile<D>::kElems, k, (kb + 1) * kBlock, tk, kv_ld);
      load_tile<T, D>(s_v + (buf ^ 1) * Tile<D>::kElems, v, (kb + 1) * kBlock, tk, kv_ld);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* tk_tile = s_k + buf * Tile<D>::kElems;
    const T* tv_tile = s_v + buf * Tile<D>::kElems;

    float s[8][4];
    zero(s);
    mma_abt<T, D>(s, qf, tk_tile);
    const int64_t k0 = kb * kBlock;
    const bool edge = k0 + kBlock > tk || (causal && k0 + kBlock - 1 > q0);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] *= scale_log2;
        if constexpr (B) {
          const int64_t col = k0 + n * 8 + 2 * t + (e & 1);
          if (col < tk) s[n][e] += log2_bias(bias[col]);
        }
        if (edge) {
          const int64_t col = k0 + n * 8 + 2 * t + (e & 1);
          if (col >= tk || (causal && col > row[e >> 1])) s[n][e] = kNegInf;
        }
      }

    if (M == kDq) {
      float dp[8][4];
      zero(dp);
      mma_abt<T, D>(dp, df, tv_tile);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          const float p = B && s[n][e] == kNegInf ? 0.f : exp2f(s[n][e] - lse[h]);
          s[n][e] = p * (dp[n][e] - dsum[h]);  // dS
        }
      mma_pb<T, D>(acc, s, tk_tile);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = kNegInf;
#pragma unroll
        for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[h], mx);
        const float m_use = m_new == kNegInf ? 0.f : m_new;
        const float alpha = exp2f(m[h] - m_use);
        m[h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const float p = exp2f(s[n][e] - m_use);
            s[n][e] = p;
            sum += p;
          }
        l[h] = l[h] * alpha + sum;  // a quad's partial sums; reduced at the end
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[n][2 * h] *= alpha;
          acc[n][2 * h + 1] *= alpha;
        }
      }
      mma_pb<T, D>(acc, s, tv_tile);
    }
    __syncthreads();
  }

  if constexpr (M == kDq) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] >= tq) continue;
      T* dst = out + row[h] * out_ld;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t) =
            pack2<T>(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
      if (row[h] < tq) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : (B && tk > 0 ? nan_f32() : 0.f);
        T* dst = out + row[h] * out_ld;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t) =
              pack2<T>(acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
        // log(sum_j e^{s_ij}) = ln 2 * (m + log2 l) in the log2 domain; -inf without keys.
        if (t == 0)
          lse_out[qrow0 + row[h] * heads] = l[h] > 0.f ? (m[h] + log2f(l[h])) * kLn2 : kNegInf;
      }
    }
  }
}

// One CTA = 64 keys of one key/value problem (16 a warp, no reductions across warps or CTAs);
// loops over the query blocks that see them, of every query head of the key/value head's group
// (one head without grouped-query attention): dv = P^T dout, dk = scale * dS^T q.
template <typename T, int D, bool B>
__global__ void __launch_bounds__(kThreads) flash_dkdv_kernel(const T* __restrict__ q,
                                                              const T* __restrict__ k,
                                                              const T* __restrict__ v,
                                                              const T* __restrict__ dout,
                                                              const float2* __restrict__ stats,
                                                              T* __restrict__ dk,
                                                              T* __restrict__ dv, int64_t tq,
                                                              int64_t tk, int heads,
                                                              int64_t q_ld, int kv_heads,
                                                              int group, int64_t kv_ld,
                                                              bool causal, float scale_log2,
                                                              float scale,
                                                              const T* __restrict__ bias,
                                                              int bias_heads) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);
  T* s_v = s_k + Tile<D>::kElems;
  T* s_q = s_v + Tile<D>::kElems;       // 2 buffers
  T* s_do = s_q + 2 * Tile<D>::kElems;  // 2 buffers
  float2* s_st = reinterpret_cast<float2*>(s_do + 2 * Tile<D>::kElems);  // 2 x kBlock

  const int64_t kvb = blockIdx.x;  // the key/value problem
  const int64_t k0 = int64_t(blockIdx.y) * kBlock;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Between a problem's rows: q q_ld, k, v, dk, dv kv_ld, dout o_ld.
  const int64_t o_ld = int64_t(heads) * D;
  const int64_t koff = row_offset(kvb, 0, tk, kv_heads, kv_ld, D);
  k += koff;
  v += koff;
  dk += koff;
  dv += koff;

  const int64_t n_qb = (tq + kBlock - 1) / kBlock;
  const int64_t qb0 = causal ? k0 / kBlock : 0;
  // Steps: (query head of the group, query block) pairs, head-major.
  const int64_t per_head = n_qb > qb0 ? n_qb - qb0 : 0, steps = group * per_head;

  auto load_q_block = [&](int64_t step, int buf) {
    const int64_t b = kvb * group + step / per_head, qb = qb0 + step % per_head;
    const int64_t qrow0 = row_index(b, 0, tq, heads);
    load_tile<T, D>(s_q + buf * Tile<D>::kElems, q + row_offset(b, 0, tq, heads, q_ld, D),
                    qb * kBlock, tq, q_ld);
    load_tile<T, D>(s_do + buf * Tile<D>::kElems, dout + qrow0 * D, qb * kBlock, tq, o_ld);
    if (threadIdx.x < kBlock) {
      const int64_t r = qb * kBlock + threadIdx.x;
      const bool valid = r < tq;
      const float2* st = stats + qrow0;
      cp_async8(s_st + buf * kBlock + threadIdx.x, valid ? st + r * heads : st, valid);
    }
  };

  load_tile<T, D>(s_k, k, k0, tk, kv_ld);
  load_tile<T, D>(s_v, v, k0, tk, kv_ld);
  if (steps > 0) load_q_block(0, 0);
  cp_async_commit();

  // K and V fragments stay in registers for D <= 64; at D = 128 they are re-read from shared
  // memory each query block (keeping them spills).
  constexpr bool kResident = D <= 64;
  uint32_t kf[kResident ? D / 16 : 1][4], vf[kResident ? D / 16 : 1][4];
  const int64_t key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  // Each key's bias (log2 domain): the same for every query head of the group (one batch entry).
  float key_bias[2] = {0.f, 0.f};
  if constexpr (B) {
    const T* row = bias + kvb * group / bias_heads * tk;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (key[h] < tk) key_bias[h] = log2_bias(row[key[h]]);
  }
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
  zero(dk_acc);
  zero(dv_acc);

  for (int64_t step = 0; step < steps; ++step) {
    const int buf = step & 1;
    if (step + 1 < steps) {
      load_q_block(step + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (kResident) {
      if (step == 0) {
        load_a_frags<T, D>(kf, s_k, warp * 16);
        load_a_frags<T, D>(vf, s_v, warp * 16);
      }
    }
    const T* tq_tile = s_q + buf * Tile<D>::kElems;
    const T* tdo_tile = s_do + buf * Tile<D>::kElems;
    const float2* st = s_st + buf * kBlock;
    const int64_t q0 = (qb0 + step % per_head) * kBlock;

    float s[8][4], dp[8][4];  // transposed: rows = keys, columns = queries
    zero(s);
    zero(dp);
    if constexpr (kResident) {
      mma_abt<T, D>(s, kf, tq_tile);
      mma_abt<T, D>(dp, vf, tdo_tile);
    } else {
      uint32_t f[D / 16][4];
      load_a_frags<T, D>(f, s_k, warp * 16);
      mma_abt<T, D>(s, f, tq_tile);
      load_a_frags<T, D>(f, s_v, warp * 16);
      mma_abt<T, D>(dp, f, tdo_tile);
    }
    const bool edge = q0 + kBlock > tq || (causal && q0 < k0 + kBlock - 1);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = n * 8 + 2 * t + c;
        const float2 stc = st[col];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float p;
          if constexpr (B) {
            const float score = s[n][2 * h + c] * scale_log2 + key_bias[h];
            p = score == kNegInf ? 0.f : exp2f(score - stc.x);
          } else {
            p = exp2f(s[n][2 * h + c] * scale_log2 - stc.x);
          }
          if (edge && (q0 + col >= tq || (causal && key[h] > q0 + col))) p = 0.f;
          s[n][2 * h + c] = p;
          dp[n][2 * h + c] = p * (dp[n][2 * h + c] - stc.y);  // dS^T
        }
      }
    mma_pb<T, D>(dv_acc, s, tdo_tile);
    mma_pb<T, D>(dk_acc, dp, tq_tile);
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (key[h] >= tk) continue;
    T* dst_k = dk + key[h] * kv_ld;
    T* dst_v = dv + key[h] * kv_ld;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst_k + n * 8 + 2 * t) =
          pack2<T>(dk_acc[n][2 * h] * scale, dk_acc[n][2 * h + 1] * scale);
      *reinterpret_cast<uint32_t*>(dst_v + n * 8 + 2 * t) =
          pack2<T>(dv_acc[n][2 * h], dv_acc[n][2 * h + 1]);
    }
  }
}

template <typename T, int D>
size_t rows_smem(int mode) {
  return sizeof(T) * Tile<D>::kElems * (mode == kForward ? 5 : 6);
}

// ---- backward pre-pass ----

constexpr int kPrepThreads = 256;
constexpr int kPrepLanes = 8;  // threads a row

// stats[r] = (lse_r * log2(e), D_r = dout_r . out_r) for each of `rows` rows of dv elements; f32
// math, fixed summation order (deterministic). 16-byte loads where rows allow.
template <typename T>
__global__ void __launch_bounds__(kPrepThreads) attention_prep_kernel(
    const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
    float2* __restrict__ stats, int64_t rows, int dv, bool vectorized) {
  const int64_t r = (int64_t(blockIdx.x) * kPrepThreads + threadIdx.x) / kPrepLanes;
  const int sub = threadIdx.x % kPrepLanes;
  float acc = 0.f;
  if (r < rows) {
    const T* o = out + r * dv;
    const T* g = dout + r * dv;
    if (vectorized) {
      constexpr int kVec = 16 / sizeof(T);
      for (int c = sub * kVec; c < dv; c += kPrepLanes * kVec) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
        const uint4 gv = *reinterpret_cast<const uint4*>(g + c);
        const T* oe = reinterpret_cast<const T*>(&ov);
        const T* ge = reinterpret_cast<const T*>(&gv);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc += to_f32(oe[e]) * to_f32(ge[e]);
      }
    } else {
      for (int c = sub; c < dv; c += kPrepLanes) acc += to_f32(o[c]) * to_f32(g[c]);
    }
  }
#pragma unroll
  for (int off = kPrepLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (r < rows && sub == 0) stats[r] = make_float2(lse[r] * kLog2e, acc);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
void launch_prep(const T* out, const T* dout, const float* lse, float2* stats, int64_t rows,
                 int64_t dv, cudaStream_t stream) {
  const bool vectorized = (dv * int64_t(sizeof(T))) % 16 == 0 && aligned16(out) && aligned16(dout);
  const int64_t blocks = (rows * kPrepLanes + kPrepThreads - 1) / kPrepThreads;
  attention_prep_kernel<T><<<static_cast<unsigned>(blocks), kPrepThreads, 0, stream>>>(
      out, dout, lse, stats, rows, static_cast<int>(dv), vectorized);
  KILN_CUDA_CHECK(cudaGetLastError());
}

// Stream-ordered scratch for the pre-pass statistics, freed on the stream after its users.
class StatsScratch {
 public:
  StatsScratch(int64_t rows, cudaStream_t stream) : stream_(stream) {
    KILN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ptr_),
                                    static_cast<size_t>(rows > 0 ? rows : 1) * sizeof(float2),
                                    stream));
  }
  ~StatsScratch() { cudaFreeAsync(ptr_, stream_); }
  StatsScratch(const StatsScratch&) = delete;
  StatsScratch& operator=(const StatsScratch&) = delete;
  float2* get() const { return ptr_; }

 private:
  float2* ptr_ = nullptr;
  cudaStream_t stream_;
};
template <typename T, int D>
size_t dkdv_smem() {
  return sizeof(T) * Tile<D>::kElems * 6 + sizeof(float2) * 2 * kBlock;
}

// Heads of k and v (dk, dv) in a row: "bthd" heads / group; "bhtd" 1.
int kv_heads(const AttentionShape& s) {
  return static_cast<int>(s.heads > 1 ? s.heads / s.group : 1);
}
// Elements between consecutive positions of q (dq): the given stride, or the plain layouts'
// heads * d; of k (dk) and v (dv): likewise with k's heads, and dv for v. (d == dv on the
// tensor-core path.)
int64_t q_stride(const AttentionShape& s) {
  return s.qkv_row_stride > 0 ? s.qkv_row_stride : s.heads * s.d;
}
int64_t k_stride(const AttentionShape& s) {
  return s.qkv_row_stride > 0 ? s.qkv_row_stride : kv_heads(s) * s.d;
}
int64_t v_stride(const AttentionShape& s) {
  return s.qkv_row_stride > 0 ? s.qkv_row_stride : kv_heads(s) * s.dv;
}

template <typename T, int D, int M, bool B>
void launch_rows(const T* q, const T* k, const T* v, const T* bias, const T* dout, const float2* stats,
                 T* out, float* lse, const AttentionShape& s, float scale_log2, cudaStream_t stream) {
  const size_t smem = rows_smem<T, D>(M);
  auto kernel = flash_rows_kernel<T, D, M, B>;
  static const bool raised = [&] {  // once per instantiation (thread-safe static init)
    KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    return true;
  }();
  (void)raised;
  const dim3 grid(static_cast<unsigned>(s.batch),
                  static_cast<unsigned>((s.tq + kBlock - 1) / kBlock));
  kernel<<<grid, kThreads, smem, stream>>>(q, k, v, dout, stats, out, lse, s.tq, s.tk,
                                           static_cast<int>(s.heads), q_stride(s), kv_heads(s),
                                           static_cast<int>(s.group), k_stride(s), s.causal,
                                           scale_log2, static_cast<float>(s.scale), bias,
                                           static_cast<int>(s.bias_heads));
  KILN_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int D>
void tc_forward(const void* q, const void* k, const void* v, const void* bias, void* out, float* lse,
                const AttentionShape& s, float scale_log2, cudaStream_t stream) {
  const T* biased = static_cast<const T*>(bias);
  if (biased != nullptr)
    return launch_rows<T, D, kForward, true>(static_cast<const T*>(q), static_cast<const T*>(k),
                                             static_cast<const T*>(v), biased, nullptr, nullptr,
                                             static_cast<T*>(out), lse, s, scale_log2, stream);
  launch_rows<T, D, kForward, false>(static_cast<const T*>(q), static_cast<const T*>(k),
                                     static_cast<const T*>(v), nullptr, nullptr, nullptr,
                                     static_cast<T*>(out), lse, s, scale_log2, stream);
}

// `stats`: the pre-pass output (batch * tq float2).
template <typename T, int D, bool B>
void tc_backward_biased(const void* q_, const void* k_, const void* v_, const void* bias_,
                        const void* dout_, const float2* stats, void* dq_, void* dk_, void* dv_,
                        const AttentionShape& s, float scale_log2, cudaStream_t stream) {
  const T *q = static_cast<const T*>(q_), *k = static_cast<const T*>(k_),
          *v = static_cast<const T*>(v_), *dout = static_cast<const T*>(dout_),
          *bias = static_cast<const T*>(bias_);
  T *dq = static_cast<T*>(dq_), *dk = static_cast<T*>(dk_), *dv = static_cast<T*>(dv_);
  {
    const size_t smem = dkdv_smem<T, D>();
    auto kernel = flash_dkdv_kernel<T, D, B>;
    static const bool raised = [&] {
      KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
      return true;
    }();
    (void)raised;
    const dim3 grid(static_cast<unsigned>(s.batch / s.group),  // key/value problems
                    static_cast<unsigned>((s.tk + kBlock - 1) / kBlock));
    kernel<<<grid, kThreads, smem, stream>>>(q, k, v, dout, stats, dk, dv, s.tq, s.tk,
                                             static_cast<int>(s.heads), q_stride(s),
                                             kv_heads(s), static_cast<int>(s.group), k_stride(s),
                                             s.causal, scale_log2, static_cast<float>(s.scale), bias,
                                             static_cast<int>(s.bias_heads));
    KILN_CUDA_CHECK(cudaGetLastError());
  }
  launch_rows<T, D, kDq, B>(q, k, v, bias, dout, stats, dq, nullptr, s, scale_log2, stream);
}

template <typename T, int D>
void tc_backward(const void* q, const void* k, const void* v, const void* bias, const void* dout,
                 const float2* stats, void* dq, void* dk, void* dv, const AttentionShape& s,
                 float scale_log2, cudaStream_t stream) {
  if (bias != nullptr)
    return tc_backward_biased<T, D, true>(q, k, v, bias, dout, stats, dq, dk, dv, s, scale_log2, stream);
  tc_backward_biased<T, D, false>(q, k, v, nullptr, dout, stats, dq, dk, dv, s, scale_log2, stream);
}

// ---- simple path: one warp per row, f32 math on CUDA cores ----

constexpr int kSimplePerLane = kAttentionMaxHeadDim / 32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Row r of a (rows, n) matrix into a lane's registers (element c = lane + 32 u).
template <typename T>
__device__ __forceinline__ void load_row(float (&x)[kSimplePerLane], const T* src, int n) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kSimplePerLane; ++u) {
    const int c = lane + 32 * u;
    x[u] = c < n ? to_f32(src[c]) : 0.f;
  }
}
template <typename T>
__device__ __forceinline__ float dot_row(const float (&x)[kSimplePerLane], const T* src, int n) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
#pragma unroll
  for (int u = 0; u < kSimplePerLane; ++u) {
    const int c = lane + 32 * u;
    if (c < n) acc += x[u] * to_f32(src[c]);
  }
  return warp_sum(acc);
}

// One warp = one query row. kForward: out and lse; kDq: out = dq from the pre-pass statistics.
template <typename T, int M, bool B>
__global__ void simple_rows_kernel(const T* q, const T* k, const T* v, const T* dout,
                                   const float2* stats, T* out, float* lse_out, int64_t batch,
                                   int64_t tq, int64_t tk, int heads, int d, int dv,
                                   int64_t q_ld, int kv_heads, int group, int64_t k_ld,
                                   int64_t v_ld, bool causal, float scale_log2, float scale,
                                   const T* bias, int bias_heads) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (w >= batch * tq) return;
  const int lane = threadIdx.x & 31;
  const int64_t b = w / tq, i = w % tq;
  // q (dq), k, v rows q_ld, k_ld, v_ld apart (k and v: key/value problem b / group); out,
  // dout and lse plain (row qr).
  const int64_t qr = row_index(b, i, tq, heads);
  const T* kb = k + row_offset(b / group, 0, tk, kv_heads, k_ld, d);
  const T* vb = v + row_offset(b / group, 0, tk, kv_heads, v_ld, dv);
  float qv[kSimplePerLane], dov[kSimplePerLane], acc[kSimplePerLane];
  load_row(qv, q + row_offset(b, i, tq, heads, q_ld, d), d);
  if (M != kForward) load_row(dov, dout + qr * dv, dv);
  for (int u = 0; u < kSimplePerLane; ++u) acc[u] = 0.f;
  float lse = 0.f, dsum = 0.f;
  if (M == kDq) {
    const float2 st = stats[qr];
    lse = st.x;
    dsum = st.y;
  }
  const int64_t n_keys = causal ? min(tk, i + 1) : tk;
  const T* bias_row = B ? bias + b / bias_heads * tk : nullptr;
  float m = kNegInf, l = 0.f;
  for (int64_t j = 0; j < n_keys; ++j) {
    float s = dot_row(qv, kb + j * k_ld, d) * scale_log2;
    if constexpr (B) s += log2_bias(bias_row[j]);
    if (M == kDq) {
      const float dp = dot_row(dov, vb + j * v_ld, dv);
      const float ds = (B && s == kNegInf ? 0.f : exp2f(s - lse)) * (dp - dsum);
#pragma unroll
      for (int u = 0; u < kSimplePerLane; ++u) {
        const int c = lane + 32 * u;
        if (c < d) acc[u] += ds * to_f32(kb[j * k_ld + c]);
      }
    } else {
      const float m_new = fmaxf(m, s);
      // With a bias, a row's first scores may all be -inf: exp2 of 0 rather than of -inf - -inf.
      const float m_use = B && m_new == kNegInf ? 0.f : m_new;
      const float alpha = exp2f(m - m_use), p = exp2f(s - m_use);
      m = m_new;
      l = l * alpha + p;
#pragma unroll
      for (int u = 0; u < kSimplePerLane; ++u) {
        const int c = lane + 32 * u;
        acc[u] = acc[u] * alpha + (c < dv ? p * to_f32(vb[j * v_ld + c]) : 0.f);
      }
    }
  }
  if (M == kForward && lane == 0) lse_out[qr] = l > 0.f ? (m + log2f(l)) * kLn2 : kNegInf;
  const float mul = M == kDq ? scale : (l > 0.f ? 1.f / l : (B && tk > 0 ? nan_f32() : 0.f));
  const int n = M == kDq ? d : dv;
  T* dst = out + (M == kDq ? row_offset(b, i, tq, heads, q_ld, d) : qr * dv);
#pragma unroll
  for (int u = 0; u < kSimplePerLane; ++u) {
    const int c = lane + 32 * u;
    if (c < n) dst[c] = from_f32<T>(acc[u] * mul);
  }
}

// One warp = one key row of a key/value problem: dk, dv, summed over the query heads of its
// group.
template <typename T, bool B>
__global__ void simple_dkdv_kernel(const T* q, const T* k, const T* v, const T* dout,
                                   const float2* stats, T* dk, T* dv, int64_t kv_batch,
                                   int64_t tq, int64_t tk, int heads, int d, int dvn,
                                   int64_t q_ld, int kv_heads, int group, int64_t k_ld,
                                   int64_t v_ld, bool causal, float scale_log2, float scale,
                                   const T* bias, int bias_heads) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (w >= kv_batch * tk) return;
  const int lane = threadIdx.x & 31;
  const int64_t kvb = w / tk, j = w % tk;
  // q rows q_ld apart, k (dk) k_ld, v (dv) v_ld; dout and the statistics plain.
  const int64_t dold = int64_t(heads) * dvn;
  const int64_t kr = row_offset(kvb, j, tk, kv_heads, k_ld, d);
  const int64_t vr = row_offset(kvb, j, tk, kv_heads, v_ld, dvn);
  float kv[kSimplePerLane], vv[kSimplePerLane], dk_acc[kSimplePerLane], dv_acc[kSimplePerLane];
  load_row(kv, k + kr, d);
  load_row(vv, v + vr, dvn);
  for (int u = 0; u < kSimplePerLane; ++u) dk_acc[u] = dv_acc[u] = 0.f;
  // The key's bias (log2 domain), the same for every query head of the group (one batch entry).
  const float key_bias = B ? log2_bias(bias[kvb * group / bias_heads * tk + j]) : 0.f;
  for (int64_t b = kvb * group; b < (kvb + 1) * group; ++b) {
    const int64_t qr0 = row_index(b, 0, tq, heads);
    const T* qb = q + row_offset(b, 0, tq, heads, q_ld, d);
    const T* dob = dout + qr0 * dvn;
    for (int64_t i = causal ? j : 0; i < tq; ++i) {
      const float2 st = stats[qr0 + i * heads];
      float p;
      if constexpr (B) {
        const float score = dot_row(kv, qb + i * q_ld, d) * scale_log2 + key_bias;
        p = score == kNegInf ? 0.f : exp2f(score - st.x);
      } else {
        p = exp2f(dot_row(kv, qb + i * q_ld, d) * scale_log2 - st.x);
      }
      const float ds = p * (dot_row(vv, dob + i * dold, dvn) - st.y);
#pragma unroll
      for (int u = 0; u < kSimplePerLane; ++u) {
        const int c = lane + 32 * u;
        if (c < dvn) dv_acc[u] += p * to_f32(dob[i * dold + c]);
        if (c < d) dk_acc[u] += ds * to_f32(qb[i * q_ld + c]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kSimplePerLane; ++u) {
    const int c = lane + 32 * u;
    if (c < d) dk[kr + c] = from_f32<T>(dk_acc[u] * scale);
    if (c < dvn) dv[vr + c] = from_f32<T>(dv_acc[u]);
  }
}

constexpr int kSimpleThreads = 256;  // 8 rows a block

unsigned simple_grid(int64_t rows) {
  return static_cast<unsigned>((rows * 32 + kSimpleThreads - 1) / kSimpleThreads);
}

template <typename T, bool B>
void simple_forward_biased(const void* q, const void* k, const void* v, const void* bias, void* out,
                           float* lse, const AttentionShape& s, float scale_log2, cudaStream_t stream) {
  simple_rows_kernel<T, kForward, B><<<simple_grid(s.batch * s.tq), kSimpleThreads, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), nullptr,
      nullptr, static_cast<T*>(out), lse, s.batch, s.tq, s.tk, int(s.heads), int(s.d), int(s.dv),
      q_stride(s), kv_heads(s), int(s.group), k_stride(s), v_stride(s), s.causal, scale_log2,
      float(s.scale), static_cast<const T*>(bias), int(s.bias_heads));
  KILN_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void simple_forward(const void* q, const void* k, const void* v, const void* bias, void* out, float* lse,
                    const AttentionShape& s, float scale_log2, cudaStream_t stream) {
  if (bias != nullptr) return simple_forward_biased<T, true>(q, k, v, bias, out, lse, s, scale_log2, stream);
  simple_forward_biased<T, false>(q, k, v, nullptr, out, lse, s, scale_log2, stream);
}

// `stats`: the pre-pass output (batch * tq float2).
template <typename T, bool B>
void simple_backward_biased(const void* q_, const void* k_, const void* v_, const void* bias_,
                            const void* dout_, const float2* stats, void* dq_, void* dk_, void* dv_,
                            const AttentionShape& s, float scale_log2, cudaStream_t stream) {
  const T *q = static_cast<const T*>(q_), *k = static_cast<const T*>(k_),
          *v = static_cast<const T*>(v_), *dout = static_cast<const T*>(dout_),
          *bias = static_cast<const T*>(bias_);
  T *dq = static_cast<T*>(dq_), *dk = static_cast<T*>(dk_), *dv = static_cast<T*>(dv_);
  const int d = int(s.d), dvn = int(s.dv);
  const float scale = float(s.scale);
  const int64_t kv_batch = s.batch / s.group;
  const unsigned qgrid = simple_grid(s.batch * s.tq), kgrid = simple_grid(kv_batch * s.tk);
  simple_dkdv_kernel<T, B><<<kgrid, kSimpleThreads, 0, stream>>>(
      q, k, v, dout, stats, dk, dv, kv_batch, s.tq, s.tk, int(s.heads), d, dvn, q_stride(s),
      kv_heads(s), int(s.group), k_stride(s), v_stride(s), s.causal, scale_log2, scale, bias,
      int(s.bias_heads));
  KILN_CUDA_CHECK(cudaGetLastError());
  simple_rows_kernel<T, kDq, B><<<qgrid, kSimpleThreads, 0, stream>>>(
      q, k, v, dout, stats, dq, nullptr, s.batch, s.tq, s.tk, int(s.heads), d, dvn, q_stride(s),
      kv_heads(s), int(s.group), k_stride(s), v_stride(s), s.causal, scale_log2, scale, bias,
      int(s.bias_heads));
  KILN_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void simple_backward(const void* q, const void* k, const void* v, const void* bias, const void* dout,
                     const float2* stats, void* dq, void* dk, void* dv, const AttentionShape& s,
                     float scale_log2, cudaStream_t stream) {
  if (bias != nullptr)
    return simple_backward_biased<T, true>(q, k, v, bias, dout, stats, dq, dk, dv, s, scale_log2, stream);
  simple_backward_biased<T, false>(q, k, v, nullptr, dout, stats, dq, dk, dv, s, scale_log2, stream);
}

template <typename T>
void backward_typed(const void* q, const void* k, const void* v, const void* kb, const void* out,
                    const void* dout, const float* lse, void* dq, void* dk, void* dv,
                    const AttentionShape& s, bool tc, float sl2, cudaStream_t stream) {
  const int64_t rows = s.batch * s.tq;
  StatsScratch stats(rows, stream);
  launch_prep<T>(static_cast<const T*>(out), static_cast<const T*>(dout), lse, stats.get(), rows,
                 s.dv, stream);
  if constexpr (!std::is_same_v<T, float>) {
    if (tc) {
      const float2* st = stats.get();
      if (s.d == 32) return tc_backward<T, 32>(q, k, v, kb, dout, st, dq, dk, dv, s, sl2, stream);
      if (s.d == 64) return tc_backward<T, 64>(q, k, v, kb, dout, st, dq, dk, dv, s, sl2, stream);
      return tc_backward<T, 128>(q, k, v, kb, dout, st, dq, dk, dv, s, sl2, stream);
    }
  }
  simple_backward<T>(q, k, v, kb, dout, stats.get(), dq, dk, dv, s, sl2, stream);
}

float log2_scale(const AttentionShape& s) {
  return static_cast<float>(s.scale * 1.4426950408889634);  // scale * log2(e)
}

// The launchers' preconditions on the shape (the KernelImpls' supports() admit only these).
void check_shape(const AttentionShape& s, const char* op) {
  KILN_CHECK(s.d >= 1 && s.dv >= 1 && s.d <= kAttentionMaxHeadDim &&
                 s.dv <= kAttentionMaxHeadDim,
             "cuda {}: head dims are {} and {}, expected 1 to {}", op, s.d, s.dv,
             kAttentionMaxHeadDim);
  KILN_CHECK(s.group >= 1 && s.batch % s.group == 0 && (s.heads == 1 || s.heads % s.group == 0) &&
                 (s.group == 1 || s.qkv_row_stride == 0),
             "cuda {}: {} query heads per key/value head do not divide the {} problems and {} "
             "heads (or come with packed q, k, v)",
             op, s.group, s.batch, s.heads);
  KILN_CHECK(s.qkv_row_stride == 0 || s.qkv_row_stride >= s.heads * std::max(s.d, s.dv),
             "cuda {}: q, k, v rows are {} elements apart, expected 0 (plain) or at least "
             "heads * head dim = {} * {}",
             op, s.qkv_row_stride, s.heads, std::max(s.d, s.dv));
}

// The tensor-core path's 16-byte cp.async loads and 4-byte stores: every q, k, v, dq, dk, dv
// row starts 16-byte aligned (16-bit elements) when the bases are and the stride is a multiple
// of 8 elements (always so for the plain layouts at d in {32, 64, 128}).
bool tc_rows_aligned(const AttentionShape& s) {
  return q_stride(s) % 8 == 0 && k_stride(s) % 8 == 0;
}

// Zeroes a gradient of q, k or v: `problems` / `heads` leading indices times `rows` positions
// of heads * dim elements, `ld` apart (one contiguous block for the plain layouts).
void zero_rows(void* p, int64_t problems, int64_t heads, int64_t rows, int64_t dim, int64_t ld,
               size_t elem, cudaStream_t stream) {
  const int64_t width = heads * dim, height = problems / heads * rows;
  if (width == 0 || height == 0) return;
  if (ld == width) {
    KILN_CUDA_CHECK(cudaMemsetAsync(p, 0, size_t(width * height) * elem, stream));
  } else {
    KILN_CUDA_CHECK(cudaMemset2DAsync(p, size_t(ld) * elem, 0, size_t(width) * elem,
                                      size_t(height), stream));
  }
}

}  // namespace

bool attention_uses_tensor_cores(DType dtype, int64_t d, int64_t dv) {
  return dtype != DType::kF32 && d == dv && (d == 32 || d == 64 || d == 128);
}

void attention_forward(DType dtype, const void* q, const void* k, const void* v, const void* kb,
                       void* out, float* lse, const AttentionShape& s, cudaStream_t stream) {
  check_shape(s, "attention");
  if (s.batch == 0 || s.tq == 0) return;
  const float sl2 = log2_scale(s);
  const bool tc = attention_uses_tensor_cores(dtype, s.d, s.dv) && tc_rows_aligned(s) &&
                  aligned16(q) && aligned16(k) && aligned16(v) && aligned16(out);
  switch (dtype) {
    case DType::kF32:
      return simple_forward<float>(q, k, v, kb, out, lse, s, sl2, stream);
    case DType::kF16:
      if (!tc) return simple_forward<__half>(q, k, v, kb, out, lse, s, sl2, stream);
      if (s.d == 32) return tc_forward<__half, 32>(q, k, v, kb, out, lse, s, sl2, stream);
      if (s.d == 64) return tc_forward<__half, 64>(q, k, v, kb, out, lse, s, sl2, stream);
      return tc_forward<__half, 128>(q, k, v, kb, out, lse, s, sl2, stream);
    case DType::kBF16:
      if (!tc) return simple_forward<__nv_bfloat16>(q, k, v, kb, out, lse, s, sl2, stream);
      if (s.d == 32) return tc_forward<__nv_bfloat16, 32>(q, k, v, kb, out, lse, s, sl2, stream);
      if (s.d == 64) return tc_forward<__nv_bfloat16, 64>(q, k, v, kb, out, lse, s, sl2, stream);
      return tc_forward<__nv_bfloat16, 128>(q, k, v, kb, out, lse, s, sl2, stream);
    default:
      fail("attention: {} is not f32, f16 or bf16", dtype_name(dtype));
  }
}

void attention_backward(DType dtype, const void* q, const void* k, const void* v, const void* kb,
                        const void* out, const void* dout, const float* lse, void* dq, void* dk,
                        void* dv, const AttentionShape& s, cudaStream_t stream) {
  check_shape(s, "attention_grad");
  if (s.batch == 0) return;
  const size_t elem = dtype_size(dtype);
  if (s.tk == 0) {  // no keys: every gradient is 0 (dk and dv are empty)
    zero_rows(dq, s.batch, s.heads, s.tq, s.d, q_stride(s), elem, stream);
    return;
  }
  if (s.tq == 0) {  // no queries: dk and dv are 0
    const int64_t kv_batch = s.batch / s.group;
    zero_rows(dk, kv_batch, kv_heads(s), s.tk, s.d, k_stride(s), elem, stream);
    zero_rows(dv, kv_batch, kv_heads(s), s.tk, s.dv, v_stride(s), elem, stream);
    return;
  }
  const float sl2 = log2_scale(s);
  const bool tc = attention_uses_tensor_cores(dtype, s.d, s.dv) && tc_rows_aligned(s) &&
                  aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout) &&
                  aligned16(dq) && aligned16(dk) && aligned16(dv);
  switch (dtype) {
    case DType::kF32:
      return backward_typed<float>(q, k, v, kb, out, dout, lse, dq, dk, dv, s, false, sl2, stream);
    case DType::kF16:
      return backward_typed<__half>(q, k, v, kb, out, dout, lse, dq, dk, dv, s, tc, sl2, stream);
    case DType::kBF16:
      return backward_typed<__nv_bfloat16>(q, k, v, kb, out, dout, lse, dq, dk, dv, s, tc, sl2,
                                           stream);
    default:
      fail("attention_grad: {} is not f32, f16 or bf16", dtype_name(dtype));
  }
}

}  // namespace kiln::cuda
