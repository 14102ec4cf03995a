// The fused classifier kernel (launcher declared in classifier.cuh): the loss and the logits'
// gradient of cross-entropy in one kernel over the logits, llm.c's fused classifier.
//
// One block per row (a grid-stride loop when rows exceed the grid). Pass 1 reads the row once
// with 16-byte vectors ([scalar head][vectors][scalar tail], the head bringing the pointer to 16
// bytes, so odd vocabularies vectorize too), four vectors in flight per thread, and folds it into
// an online softmax state (running max and sum of exp(x - max)); the states are merged across
// the block (warp shuffles, then the warps' states in warp order), so every thread holds the
// row's max and sum. Pass 2 writes dlogits = (exp(x - max) / sum - one_hot) * scale, reading the
// row again (evict-first loads: its last use, mostly L2 hits while the block's row is recent).
// RowPath::kShared (classifier.cuh, the default) instead copies a row that fits in
// kMaxSharedRowBytes (2 blocks per SM) whole into shared memory with cp.async (every 16-byte
// piece in flight at once, no registers held) and reads both passes from there: DRAM sees the
// logits once (H100, GPT-2 size: 2.30 ms against 2.77 rereading; see classifier.cuh).
//
// In place: dlogits may be the logits' buffer. Thread 0 reads row[label] before anything is
// written; pass 2 starts after the block-wide merge, and each thread then reads a vector (or a
// scalar) before it writes the same elements, which no other thread touches in pass 2. With
// "none", the loss may be dloss's buffer: dloss[row] is read by every thread before the merge,
// the loss written by thread 0 after it.
//
// Losses: "none" writes each row's loss straight to the output; otherwise per-row losses go to a
// stream-ordered scratch array and a one-block kernel sums them in a fixed order (f64). "mean"
// first counts the rows whose label is not ignore_index (another one-block kernel), since every
// row's scale needs the count.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "backends/cuda/classifier/classifier.cuh"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/common/elements.cuh"
#include "backends/cuda/runtime/device_errors.cuh"
#include "backends/cuda/common/scratch.cuh"
#include "backends/cuda/common/dtype_visit.cuh"

namespace kiln::cuda::classifier {
namespace {

using bf16 = __nv_bfloat16;
using f16 = __half;

constexpr int kWarp = 32;
constexpr int kMaxThreads = 512;   // per block; 2 blocks per SM on the shared-memory path
constexpr int kUnroll = 4;         // vectors each thread has in flight
constexpr int64_t kMaxSharedRowBytes = 112 * 1024;  // two such rows fit one SM (228 KiB)
constexpr int kReduceThreads = 1024;

// RowPath: kShared unless KILN_CLASSIFIER_ROW_PATH=reread; tests and the benchmark choose.
std::atomic<int> g_row_path{[] {
  const char* e = std::getenv("KILN_CLASSIFIER_ROW_PATH");
  return e != nullptr && std::string_view(e) == "reread" ? 0 : 1;
}()};

// to_f / from_f: elements.cuh.

// A vector of W = 16 / sizeof(T) elements moves as one 16-byte access of raw words, packed and
// unpacked here by hand (W = 1: the scalar fallback). Not through a struct of __nv_bfloat16 /
// __half: those types have user-provided copy operations, so nvcc copies such a struct element
// by element (one 2-byte store per element: 8x the store instructions, seen in the PTX).
template <typename T, int W>
struct Raw {
  using type = std::conditional_t<W == 1, T, uint4>;
};
template <typename T, int W>
using RawT = typename Raw<T, W>::type;

template <typename T, int W>
__device__ __forceinline__ RawT<T, W> load_raw(const T* p) {
  return *reinterpret_cast<const RawT<T, W>*>(p);
}
// The same with the evict-first hint (the last read of the row).
template <typename T, int W>
__device__ __forceinline__ RawT<T, W> load_raw_last(const T* p) {
  if constexpr (W == 1) return *p;
  else return __ldcs(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void unpack_word(unsigned w, float& lo, float& hi, bf16*) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack_word(unsigned w, float& lo, float& hi, f16*) {
  lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}
template <typename T, int W>
__device__ __forceinline__ void unpack(const RawT<T, W>& r, float (&out)[W]) {
  if constexpr (W == 1) {
    out[0] = to_f(r);
  } else if constexpr (std::is_same_v<T, float>) {
    out[0] = __uint_as_float(r.x);
    out[1] = __uint_as_float(r.y);
    out[2] = __uint_as_float(r.z);
    out[3] = __uint_as_float(r.w);
  } else {
    unpack_word(r.x, out[0], out[1], static_cast<T*>(nullptr));
    unpack_word(r.y, out[2], out[3], static_cast<T*>(nullptr));
    unpack_word(r.z, out[4], out[5], static_cast<T*>(nullptr));
    unpack_word(r.w, out[6], out[7], static_cast<T*>(nullptr));
  }
}

__device__ __forceinline__ unsigned bits_of(bf16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ unsigned bits_of(f16 v) { return __half_as_ushort(v); }
// One vector store to global memory, written in PTX: nvcc splits a plain uint4 / float4 struct
// assignment into 4-byte stores here (seen in the PTX).
__device__ __forceinline__ void store_global(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ void store_global(void* p, unsigned a, unsigned b) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}
// Stores W values as G at p, a global address aligned to W * sizeof(G) bytes: one access.
template <typename G, int W>
__device__ __forceinline__ void store_vec(G* p, const float (&v)[W]) {
  if constexpr (W == 1) {
    *p = from_f<G>(v[0]);
  } else if constexpr (std::is_same_v<G, float>) {
    static_assert(W == 4, "f32 gradients come from f32 logits: 4 per vector");
    store_global(p, __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                 __float_as_uint(v[3]));
  } else {
    static_assert(W == 8 || W == 4, "16-bit gradients: 8 per vector, or 4 from f32 logits");
    unsigned w[W / 2];
#pragma unroll
    for (int k = 0; k < W / 2; ++k)
      w[k] = bits_of(from_f<G>(v[2 * k])) | (bits_of(from_f<G>(v[2 * k + 1])) << 16);
    if constexpr (W == 8) store_global(p, w[0], w[1], w[2], w[3]);
    else store_global(p, w[0], w[1]);
  }
}

struct MaxSum {
  float m, s;  // running max; sum of exp(x - m)
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ void add(MaxSum& st, float x) {
  if (x > st.m) {
    st.s = st.s * __expf(st.m - x) + 1.0f;  // st.m = -inf: 0 + 1
    st.m = x;
  } else if (x != -INFINITY) {
    st.s += __expf(x - st.m);
  }
}
template <int W>
__device__ __forceinline__ void add(MaxSum& st, const float (&x)[W]) {
  float mx = x[0];
#pragma unroll
  for (int i = 1; i < W; ++i) mx = fmaxf(mx, x[i]);
  if (mx > st.m) {
    st.s *= __expf(st.m - mx);
    st.m = mx;
  }
  if (st.m == -INFINITY) return;
#pragma unroll
  for (int i = 0; i < W; ++i) st.s += __expf(x[i] - st.m);
}

// The block's merged state, the same bits in every thread (butterfly shuffles, then the warps'
// states merged in warp order). Every thread of the block must call it.
__device__ __forceinline__ MaxSum block_merge(MaxSum st, MaxSum* sh) {
#pragma unroll
  for (int mask = kWarp / 2; mask > 0; mask /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, st.m, mask),
                 __shfl_xor_sync(0xffffffffu, st.s, mask)};
    st = merge(st, other);
  }
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  __syncthreads();  // sh may still be read by the previous row's merge
  if (threadIdx.x % kWarp == 0) sh[threadIdx.x / kWarp] = st;
  __syncthreads();
  MaxSum r = sh[0];
  for (int w = 1; w < warps; ++w) r = merge(r, sh[w]);
  return r;
}

__device__ __forceinline__ double block_sum(double v, double* sh) {
#pragma unroll
  for (int mask = kWarp / 2; mask > 0; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  if (threadIdx.x % kWarp == 0) sh[threadIdx.x / kWarp] = v;
  __syncthreads();
  double r = sh[0];
  for (int w = 1; w < warps; ++w) r += sh[w];
  return r;
}

__device__ __forceinline__ int64_t load_label(const void* labels, bool labels64, int64_t row) {
  return labels64 ? static_cast<const int64_t*>(labels)[row]
                  : static_cast<int64_t>(static_cast<const int32_t*>(labels)[row]);
}

// 16 bytes global -> shared without registers (cp.async, L1 bypassed); both 16-byte aligned.
__device__ __forceinline__ void copy16_async(void* shared, const void* global) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global)
               : "memory");
}
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// W = 16 / sizeof(T) elements per vector (1: scalar fallback for unaligned buffers).
// kShared: the row stays in dynamic shared memory between the passes, element c at [c + shift]
// with shift = the row pointer's element offset past 16 bytes, so vectors stay 16-byte aligned.
template <typename T, typename G, int W, bool kShared>
__global__ void __launch_bounds__(kMaxThreads, 2)
    classifier_kernel(const T* logits, G* dlogits, const void* labels, bool labels64,
                      const float* dloss, const float* count, float* row_loss, int64_t rows,
                      int64_t vocab, int64_t ignore_index, int reduction) {
  extern __shared__ __align__(16) unsigned char shared_row[];
  T* cache = reinterpret_cast<T*>(shared_row);
  __shared__ MaxSum sh[kWarp];
  const int tid = threadIdx.x, n = blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * vocab;
    G* g = dlogits + row * vocab;
    const int64_t label = load_label(labels, labels64, row);  // the same in the whole block
    const int shift = W == 1 ? 0 : static_cast<int>(reinterpret_cast<uintptr_t>(x) % 16 / sizeof(T));
    const int64_t head = shift == 0 ? 0 : std::min<int64_t>(vocab, W - shift);
    const int64_t nvec = (vocab - head) / W, tail = head + nvec * W;
    const int64_t nedge = head + (vocab - tail);
    auto edge_col = [&](int64_t e) { return e < head ? e : tail + (e - head); };
    if (label == ignore_index) {  // a zero row, a zero loss
      for (int64_t e = tid; e < nedge; e += n) g[edge_col(e)] = from_f<G>(0.0f);
      const float zero[W] = {};
      for (int64_t v = tid; v < nvec; v += n) store_vec<G, W>(g + head + v * W, zero);
      if (tid == 0) row_loss[row] = 0.0f;
      continue;  // uniform across the block: no barrier is skipped by some threads only
    }
    const bool bad = label < 0 || label >= vocab;
    float scale = dloss[reduction == static_cast<int>(Reduction::kNone) ? row : 0];
    if (reduction == static_cast<int>(Reduction::kMean)) scale /= *count;
    const float at_label = (tid == 0 && !bad) ? to_f(x[label]) : 0.0f;

    // Pass 1: online softmax over the row. Shared path: the whole row is first copied into
    // shared memory with asynchronous 16-byte copies (all of it in flight at once, no registers
    // held), then folded from there.
    MaxSum st{-INFINITY, 0.0f};
    if constexpr (kShared) {
      for (int64_t e = tid; e < nedge; e += n) {
        const int64_t c = edge_col(e);
        cache[c + shift] = x[c];
      }
      for (int64_t v = tid; v < nvec; v += n) copy16_async(cache + head + shift + v * W, x + head + v * W);
      wait_async_copies();
      __syncthreads();
      for (int64_t e = tid; e < nedge; e += n) add(st, to_f(cache[edge_col(e) + shift]));
      for (int64_t v = tid; v < nvec; v += n) {
        float f[W];
        unpack<T, W>(load_raw<T, W>(cache + head + shift + v * W), f);
        add<W>(st, f);
      }
    } else {
      for (int64_t e = tid; e < nedge; e += n) add(st, to_f(x[edge_col(e)]));
      for (int64_t v0 = tid; v0 < nvec; v0 += static_cast<int64_t>(n) * kUnroll) {
        RawT<T, W> raw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + static_cast<int64_t>(u) * n;
          if (v < nvec) raw[u] = load_raw<T, W>(x + head + v * W);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + static_cast<int64_t>(u) * n;
          if (v >= nvec) break;
          float f[W];
          unpack<T, W>(raw[u], f);
          add<W>(st, f);
        }
      }
    }
    st = block_merge(st, sh);
    const float max = st.m, inv_sum = 1.0f / st.s;
    if (bad) {
      scale = NAN;
      if (tid == 0) record_device_error(kCrossEntropyLabelError, label, row, vocab, ignore_index);
    }
    if (tid == 0) row_loss[row] = bad ? NAN : max + logf(st.s) - at_label;

    // Pass 2: the gradient.
    auto grad_of = [&](float xv, int64_t c) {
      const float p = __expf(xv - max) * inv_sum;
      return (p - (c == label ? 1.0f : 0.0f)) * scale;
    };
    for (int64_t e = tid; e < nedge; e += n) {
      const int64_t c = edge_col(e);
      const float xv = kShared ? to_f(cache[c + shift]) : to_f(x[c]);
      g[c] = from_f<G>(grad_of(xv, c));
    }
    for (int64_t v0 = tid; v0 < nvec; v0 += static_cast<int64_t>(n) * kUnroll) {
      RawT<T, W> raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * n;
        if (v >= nvec) break;
        if constexpr (kShared)
          raw[u] = load_raw<T, W>(cache + head + shift + v * W);
        else
          raw[u] = load_raw_last<T, W>(x + head + v * W);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * n;
        if (v >= nvec) break;
        const int64_t c0 = head + v * W;
        float f[W];
        unpack<T, W>(raw[u], f);
#pragma unroll
        for (int i = 0; i < W; ++i) f[i] = grad_of(f[i], c0 + i);
        store_vec<G, W>(g + c0, f);
      }
    }
    if constexpr (kShared) __syncthreads();  // the next row overwrites the shared row
  }
}

// *count = rows whose label is not ignore_index (one block).
__global__ void __launch_bounds__(kReduceThreads)
    count_kernel(const void* labels, bool labels64, int64_t rows, int64_t ignore_index,
                 float* count) {
  __shared__ double sh[kWarp];
  double k = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
    k += load_label(labels, labels64, r) != ignore_index ? 1.0 : 0.0;
  k = block_sum(k, sh);
  if (threadIdx.x == 0) *count = static_cast<float>(k);
}

// loss[0] = the sum of the per-row losses (f64, fixed order), or their mean over `count` rows
// (0 when there is none). One block.
__global__ void __launch_bounds__(kReduceThreads)
    finish_kernel(const float* row_loss, int64_t rows, const float* count, bool mean,
                  float* loss) {
  __shared__ double sh[kWarp];
  double total = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) total += row_loss[r];
  total = block_sum(total, sh);
  if (threadIdx.x != 0) return;
  if (mean) total = *count == 0.0f ? 0.0 : total / static_cast<double>(*count);
  *loss = static_cast<float>(total);
}


template <typename Fn>
void visit(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32:
      return fn(Tag<float>{});
    case DType::kF16:
      return fn(Tag<f16>{});
    case DType::kBF16:
      return fn(Tag<bf16>{});
    default:
      break;
  }
  fail("fused classifier: {} is not f32, f16 or bf16", dtype_name(t));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int threads_for(int64_t vocab, int w) {
  const int64_t vectors = ceil_div(vocab, w);
  return static_cast<int>(std::clamp<int64_t>(ceil_div(vectors, kWarp) * kWarp, kWarp, kMaxThreads));
}

template <typename T, typename G>
void launch(const Problem& p, const float* count, float* row_loss, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = reinterpret_cast<uintptr_t>(p.logits) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.dlogits) % 16 == 0;
  const LaunchInfo info = launch_info(p.logits_t, p.vocab);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(p.rows, 1 << 30));
  auto go = [&](auto kernel, size_t shared_bytes) {
    if (shared_bytes > 48 * 1024)
      KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared_bytes)));
    kernel<<<grid, info.threads, shared_bytes, stream>>>(
        static_cast<const T*>(p.logits), static_cast<G*>(p.dlogits), p.labels, p.labels64,
        p.dloss, count, row_loss, p.rows, p.vocab, p.ignore_index, static_cast<int>(p.reduction));
    KILN_CUDA_CHECK(cudaGetLastError());
  };
  if (!vec)
    go(classifier_kernel<T, G, 1, false>, 0);
  else if (info.row_in_shared_memory)
    go(classifier_kernel<T, G, kVec, true>, static_cast<size_t>(info.shared_bytes));
  else
    go(classifier_kernel<T, G, kVec, false>, 0);
}

}  // namespace

LaunchInfo launch_info(DType logits_t, int64_t vocab) {
  const int w = static_cast<int>(16 / dtype_size(logits_t));
  LaunchInfo info;
  info.threads = threads_for(vocab, w);
  const int64_t bytes = (vocab + w) * static_cast<int64_t>(dtype_size(logits_t));
  const RowPath path = static_cast<RowPath>(g_row_path.load());
  info.row_in_shared_memory = path == RowPath::kShared && bytes <= kMaxSharedRowBytes;
  info.shared_bytes = info.row_in_shared_memory ? bytes : 0;
  return info;
}

void set_row_path(RowPath path) { g_row_path.store(static_cast<int>(path)); }

void fused_classifier(const Problem& p, cudaStream_t stream) {
  const bool none = p.reduction == Reduction::kNone;
  if (p.rows == 0) {  // "none" has nothing to write; mean and sum are 0
    if (!none) KILN_CUDA_CHECK(cudaMemsetAsync(p.loss, 0, sizeof(float), stream));
    return;
  }
  KILN_CHECK(p.vocab >= 1, "fused classifier: vocab is {}, expected >= 1", p.vocab);
  KILN_CHECK(p.grad_t == p.logits_t || p.logits_t == DType::kF32,
             "fused classifier: gradient type {} for logits of type {}: expected the logits' "
             "type, or a 16-bit gradient of f32 logits",
             static_cast<int>(p.grad_t), static_cast<int>(p.logits_t));
  // Scratch: the count, then the per-row losses (not needed for "none": they are the output).
  Scratch scratch(sizeof(float) * (none ? 4 : 4 + static_cast<size_t>(p.rows)), stream);
  float* count = scratch.as<float>();
  float* row_loss = none ? p.loss : scratch.as<float>() + 4;
  if (p.reduction == Reduction::kMean) {
    count_kernel<<<1, kReduceThreads, 0, stream>>>(p.labels, p.labels64, p.rows, p.ignore_index,
                                                   count);
    KILN_CUDA_CHECK(cudaGetLastError());
  }
  visit(p.logits_t, [&](auto logits_tag) {
    using T = typename decltype(logits_tag)::type;
    visit(p.grad_t, [&](auto grad_tag) {
      using G = typename decltype(grad_tag)::type;
      if constexpr (std::is_same_v<T, G> || std::is_same_v<T, float>) launch<T, G>(p, count, row_loss, stream);
    });
  });
  if (!none) {
    finish_kernel<<<1, kReduceThreads, 0, stream>>>(row_loss, p.rows, count,
                                                    p.reduction == Reduction::kMean, p.loss);
    KILN_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace kiln::cuda::classifier
