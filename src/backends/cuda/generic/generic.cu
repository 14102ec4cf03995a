// Kernels and launchers of the "cuda" generic dialect (declared in generic.cuh): one simple,
// correct kernel per op. Written for clarity, not speed: grid-stride loops, index arithmetic
// over a small by-value layout struct, one block (or warp) per reduced line. An elementwise op
// is its line of ops/elementwise_math.h, so each elementwise kernel is one template
// instantiated per line and dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/device_errors.cuh"
#include "backends/cuda/common/device_math.cuh"
#include "backends/cuda/generic/generic.cuh"
#include "backends/cuda/common/scratch.cuh"
#include "backends/cuda/common/dtype_visit.cuh"
#include "support/philox.h"

namespace kiln::cuda::generic {
namespace {

constexpr int kThreads = 256;

#define KILN_GRID_LOOP(i, n)                                                          \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

int grid_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 1 << 20));
}
// Blocks for a one-block-per-item kernel (the kernel loops when there are more items).
int grid_items(int64_t n) { return static_cast<int>(std::clamp<int64_t>(n, 1, 1 << 20)); }

void check_launch() { KILN_CUDA_CHECK(cudaGetLastError()); }

// ---- element types ----------------------------------------------------------------------------

// Storage type T, its compute type C, load (T -> C) and store (C -> T). Integers compute in i64
// and store by truncation, which is wrap-around modulo 2^bits.
template <class T> struct Num;
template <> struct Num<float> {
  using C = float;
  __device__ static C load(float v) { return v; }
  __device__ static float store(C v) { return v; }
};
template <> struct Num<double> {
  using C = double;
  __device__ static C load(double v) { return v; }
  __device__ static double store(C v) { return v; }
};
template <> struct Num<__half> {
  using C = float;
  __device__ static C load(__half v) { return __half2float(v); }
  __device__ static __half store(C v) { return __float2half_rn(v); }
};
template <> struct Num<__nv_bfloat16> {
  using C = float;
  __device__ static C load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(C v) { return __float2bfloat16_rn(v); }
};
template <> struct Num<int32_t> {
  using C = int64_t;
  __device__ static C load(int32_t v) { return v; }
  __device__ static int32_t store(C v) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(v)));
  }
};
template <> struct Num<int64_t> {
  using C = int64_t;
  __device__ static C load(int64_t v) { return v; }
  __device__ static int64_t store(C v) { return v; }
};
template <> struct Num<uint8_t> {
  using C = int64_t;
  __device__ static C load(uint8_t v) { return v; }
  __device__ static uint8_t store(C v) { return static_cast<uint8_t>(static_cast<uint64_t>(v)); }
};
template <> struct Num<bool> {
  using C = int64_t;
  __device__ static C load(bool v) { return v ? 1 : 0; }
  __device__ static bool store(C v) { return v != 0; }
};

template <class T> inline constexpr bool kIsFloat = std::is_floating_point_v<typename Num<T>::C>;

// Calls fn(Tag<T>{}) with the storage type of `t` (dtype_visit.cuh).
template <class Fn>
void visit(DType t, Fn&& fn) {
  visit_storage(t, fn);
}
// Same, for float types only (the caller's supports() guarantees it).
template <class Fn>
void visit_float(DType t, Fn&& fn) {
  visit_float_storage(t, "cuda generic", fn);
}
// An unsigned type of `size` bytes, for kernels that only move data.
template <class Fn>
void visit_size(int size, Fn&& fn) {
  switch (size) {
    case 1: return fn(Tag<uint8_t>{});
    case 2: return fn(Tag<uint16_t>{});
    case 4: return fn(Tag<uint32_t>{});
    case 8: return fn(Tag<uint64_t>{});
  }
  fail("cuda generic: unsupported element size {}", size);
}

// ---- math -----------------------------------------------------------------------------------------

// The primitives of every kernel here: DeviceMath (device_math.cuh), and abs of an Int below.
template <class C> __device__ inline bool is_nan(C x) {
  if constexpr (std::is_floating_point_v<C>) {
    return x != x;
  } else {
    return false;
  }
}
// std::max's rule: the first operand unless the second is larger.
template <class C> __device__ inline C m_max(C a, C b) { return a < b ? b : a; }
template <class C> __device__ inline C lowest() {
  if constexpr (std::is_floating_point_v<C>) {
    return -std::numeric_limits<C>::infinity();
  } else {
    return std::numeric_limits<C>::min();
  }
}
// Wrapping integer arithmetic (through unsigned, so overflow is defined).
template <class C> __device__ inline C wrap(uint64_t v) { return static_cast<C>(v); }

// kiln's integer arithmetic, as the elementwise lines compute it on integer dtypes (in i64):
// +, -, * and negation wrap modulo 2^64 (the store then wraps modulo 2^bits); division
// truncates toward zero, a zero divisor is a data error whose result is 0, and min / -1 wraps.
struct Int {
  int64_t v;
  __device__ Int(int64_t value = 0) : v(value) {}
};
__device__ inline Int operator+(Int a, Int b) {
  return wrap<int64_t>(static_cast<uint64_t>(a.v) + static_cast<uint64_t>(b.v));
}
__device__ inline Int operator-(Int a, Int b) {
  return wrap<int64_t>(static_cast<uint64_t>(a.v) - static_cast<uint64_t>(b.v));
}
__device__ inline Int operator*(Int a, Int b) {
  return wrap<int64_t>(static_cast<uint64_t>(a.v) * static_cast<uint64_t>(b.v));
}
__device__ inline Int operator-(Int a) { return wrap<int64_t>(0ull - static_cast<uint64_t>(a.v)); }
__device__ inline Int operator/(Int a, Int b) {
  if (b.v == 0) {
    record_device_error(kDivideByZeroError, a.v);
    return 0;
  }
  if (b.v == -1) return -a;
  return a.v / b.v;
}
__device__ inline bool operator==(Int a, Int b) { return a.v == b.v; }
__device__ inline bool operator!=(Int a, Int b) { return a.v != b.v; }
__device__ inline bool operator<(Int a, Int b) { return a.v < b.v; }
__device__ inline bool operator<=(Int a, Int b) { return a.v <= b.v; }
__device__ inline bool operator>(Int a, Int b) { return a.v > b.v; }
__device__ inline bool operator>=(Int a, Int b) { return a.v >= b.v; }

struct GenericMath : DeviceMath {
  using DeviceMath::abs;
  using DeviceMath::fmod;
  static __device__ Int abs(Int x) { return x < Int(0) ? -x : x; }
  // C's remainder (the dividend's sign); x % -1 is 0 (INT64_MIN % -1 would trap).
  static __device__ Int fmod(Int a, Int b) {
    if (b.v == 0) {
      record_device_error(kRemainderByZeroError, a.v);
      return 0;
    }
    return b.v == -1 ? Int(0) : Int(a.v % b.v);
  }
};

// ---- layout ---------------------------------------------------------------------------------------

// Offsets of element i of the iteration space in the first `count` operands.
template <int count>
__device__ inline void locate(const Layout& layout, int64_t i, int64_t (&off)[count]) {
#pragma unroll
  for (int k = 0; k < count; ++k) off[k] = layout.offset[k] + (layout.contiguous ? i : 0);
  if (layout.contiguous) return;
  for (int d = layout.rank - 1; d >= 0; --d) {
    const int64_t extent = layout.shape[d];
    const int64_t index = i % extent;
    i /= extent;
#pragma unroll
    for (int k = 0; k < count; ++k) off[k] += index * layout.strides[k][d];
  }
}

// ---- elementwise: the lines of ops/elementwise_math.h ---------------------------------------------

// A storage value as a line computes it (floats as Num's compute type, integers and bool as
// Int), and a line's result stored back (bool for comparisons).
template <class T> __device__ inline auto load(T v) {
  if constexpr (kIsFloat<T>) {
    return Num<T>::load(v);
  } else {
    return Int(Num<T>::load(v));
  }
}
template <class TOut, class C> __device__ inline TOut store(C v) {
  if constexpr (std::is_same_v<C, Int>) {
    return Num<TOut>::store(v.v);
  } else {
    return Num<TOut>::store(v);
  }
}

// Whether line F takes storage type T (its domain).
template <class F, class T> constexpr bool takes() {
  if constexpr (F::domain() == math::Domain::kFloat) {
    return kIsFloat<T>;
  } else if constexpr (F::domain() == math::Domain::kArithmetic) {
    return !std::is_same_v<T, bool>;
  } else {
    return true;
  }
}
template <class F, class T>
using OutOf = std::conditional_t<F::domain() == math::Domain::kCompare, bool, T>;

template <class F, class T>
__global__ void unary_kernel(const T* x, T* y, int64_t n) {
  KILN_GRID_LOOP(i, n) { y[i] = store<T>(F::template apply<GenericMath>(load(x[i]))); }
}

template <class F, class T, class TOut>
__global__ void binary_kernel(const T* a, const T* b, TOut* out, Layout layout, int64_t n) {
  KILN_GRID_LOOP(i, n) {
    int64_t off[3];
    locate<3>(layout, i, off);
    out[off[0]] = store<TOut>(F::template apply<GenericMath>(load(a[off[1]]), load(b[off[2]])));
  }
}

// A rank-2 layout whose operands each walk a row contiguously (stride 1 along it; a broadcast
// operand has row stride 0): row r, element j, with no index division. blockIdx.y takes rows.
template <class F, class T, class TOut>
__global__ void binary_rows_kernel(const T* a, const T* b, TOut* out, Layout layout) {
  const int64_t rows = layout.shape[0], cols = layout.shape[1];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* ar = a + layout.offset[1] + r * layout.strides[1][0];
    const T* br = b + layout.offset[2] + r * layout.strides[2][0];
    TOut* o = out + layout.offset[0] + r * layout.strides[0][0];
    for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < cols;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x)
      o[j] = store<TOut>(F::template apply<GenericMath>(load(ar[j]), load(br[j])));
  }
}

bool walks_rows(const Layout& layout, int operands) {
  if (layout.contiguous || layout.rank != 2) return false;
  for (int k = 0; k < operands; ++k)
    if (layout.strides[k][1] != 1) return false;
  return true;
}

template <class F>
void unary(DType type, const void* x, void* y, int64_t n, cudaStream_t stream) {
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (takes<F, T>() && F::domain() != math::Domain::kCompare) {
      unary_kernel<F, T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x),
                                                             static_cast<T*>(y), n);
      check_launch();
    } else {
      fail("cuda generic: {} does not take {}", F::name(), dtype_name(type));
    }
  });
}

template <class F>
void binary(DType type, const void* a, const void* b, void* out, const Layout& layout,
            int64_t n, cudaStream_t stream) {
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using TOut = OutOf<F, T>;
    if constexpr (takes<F, T>()) {
      if (walks_rows(layout, 3)) {
        // About 4096 blocks in all, each thread a few elements of a row.
        const int64_t rows = std::min<int64_t>(layout.shape[0], 65535);
        const int64_t per_row = std::clamp<int64_t>((4096 + rows - 1) / rows, 1,
                                                    (layout.shape[1] + kThreads - 1) / kThreads);
        binary_rows_kernel<F, T, TOut>
            <<<dim3(static_cast<unsigned>(per_row), static_cast<unsigned>(rows)), kThreads, 0,
               stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                         static_cast<TOut*>(out), layout);
      } else {
        binary_kernel<F, T, TOut><<<grid_for(n), kThreads, 0, stream>>>(
            static_cast<const T*>(a), static_cast<const T*>(b), static_cast<TOut*>(out), layout,
            n);
      }
      check_launch();
    } else {
      fail("cuda generic: {} does not take {}", F::name(), dtype_name(type));
    }
  });
}

// ---- where, copy, fill ----------------------------------------------------------------------------

template <class U>
__global__ void where_kernel(const bool* cond, const U* a, const U* b, U* out, Layout layout,
                             int64_t n) {
  KILN_GRID_LOOP(i, n) {
    int64_t off[4];
    locate<4>(layout, i, off);
    out[off[0]] = cond[off[1]] ? a[off[2]] : b[off[3]];
  }
}

template <class U>
__global__ void copy_kernel(const U* in, U* out, Layout layout, int64_t n) {
  KILN_GRID_LOOP(i, n) {
    int64_t off[2];
    locate<2>(layout, i, off);
    out[off[0]] = in[off[1]];
  }
}

template <class U>
__global__ void fill_kernel(U value, U* out, int64_t n) {
  KILN_GRID_LOOP(i, n) { out[i] = value; }
}

// ---- cast -----------------------------------------------------------------------------------------

// From -> To with the reference's rules (see generic.cuh).
template <class From, class To>
__device__ inline To convert(From x) {
  using CF = typename Num<From>::C;
  const CF v = Num<From>::load(x);
  if constexpr (std::is_same_v<To, bool>) {
    return v != CF(0);
  } else if constexpr (kIsFloat<To>) {
    // Through f64 and then (for the 16-bit types) f32: the host's double rounding exactly.
    const double d = static_cast<double>(v);
    if constexpr (std::is_same_v<To, double>) {
      return d;
    } else {
      return Num<To>::store(static_cast<float>(d));
    }
  } else if constexpr (std::is_floating_point_v<CF>) {  // float -> integer: saturate
    const double d = static_cast<double>(v);
    constexpr To kLow = std::numeric_limits<To>::min(), kHigh = std::numeric_limits<To>::max();
    if (d != d) return To(0);
    if (d <= static_cast<double>(kLow)) return kLow;
    if (d >= static_cast<double>(kHigh)) return kHigh;
    return static_cast<To>(trunc(d));
  } else {  // integer -> integer: wrap
    return static_cast<To>(static_cast<uint64_t>(v));
  }
}

template <class From, class To>
__global__ void cast_kernel(const From* x, To* y, int64_t n) {
  KILN_GRID_LOOP(i, n) { y[i] = convert<From, To>(x[i]); }
}

template <class To>
__global__ void iota_kernel(To* out, int64_t n, int64_t dim, int64_t inner) {
  KILN_GRID_LOOP(i, n) { out[i] = convert<int64_t, To>((i / inner) % dim); }
}

template <class I, class To>
__global__ void one_hot_kernel(const I* indices, To* out, int64_t n, int64_t depth) {
  KILN_GRID_LOOP(i, n) {
    const int64_t index = Num<I>::load(indices[i / depth]);
    out[i] = convert<int64_t, To>(index == i % depth ? 1 : 0);
  }
}

// ---- dropout --------------------------------------------------------------------------------------

template <class T>
__global__ void dropout_kernel(const T* x, T* y, int64_t n, typename Num<T>::C keep,
                               uint32_t threshold, uint64_t seed, const int64_t* offset_ptr) {
  const uint64_t offset = offset_ptr != nullptr ? static_cast<uint64_t>(*offset_ptr) : 0;
  using C = typename Num<T>::C;
  KILN_GRID_LOOP(i, n) {
    const bool dropped =
        dropout_drops(philox_word(seed, offset, static_cast<uint64_t>(i)), threshold);
    y[i] = Num<T>::store(dropped ? C(0) : Num<T>::load(x[i]) / keep);
  }
}

// ---- gather / scatter_add -------------------------------------------------------------------------

// Element i of an (outer, n_indices, inner) tensor maps to the offset of row indices[p] in an
// (outer, dim, inner) one; -1 (and a recorded `code` error) when the index is out of range.
template <class I>
__device__ int64_t indexed_offset(int64_t i, const I* indices, int64_t dim, int64_t inner,
                                  int64_t n_indices, int code) {
  const int64_t in = i % inner, p = (i / inner) % n_indices, o = i / (inner * n_indices);
  const int64_t row = static_cast<int64_t>(indices[p]);
  if (row >= 0 && row < dim) return (o * dim + row) * inner + in;
  record_device_error(code, row, p, dim);
  return -1;
}

template <class U, class I>
__global__ void gather_kernel(const U* table, const I* indices, U* out, int64_t outer,
                              int64_t dim, int64_t inner, int64_t n_indices) {
  KILN_GRID_LOOP(i, outer * n_indices * inner) {
    const int64_t at = indexed_offset(i, indices, dim, inner, n_indices, kGatherIndexError);
    out[i] = at < 0 ? U(0) : table[at];
  }
}

__device__ inline void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ inline void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ inline void atomic_add(__half* p, __half v) { atomicAdd(p, v); }
__device__ inline void atomic_add(__nv_bfloat16* p, __nv_bfloat16 v) { atomicAdd(p, v); }
__device__ inline void atomic_add(int32_t* p, int32_t v) { atomicAdd(p, v); }
__device__ inline void atomic_add(int64_t* p, int64_t v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

template <class T, class I>
__global__ void scatter_add_kernel(const I* indices, const T* updates, T* out, int64_t outer,
                                   int64_t dim, int64_t inner, int64_t n_indices) {
  KILN_GRID_LOOP(i, outer * n_indices * inner) {
    const int64_t at = indexed_offset(i, indices, dim, inner, n_indices, kScatterAddIndexError);
    if (at >= 0) atomic_add(&out[at], updates[i]);
  }
}

// ---- group reductions -----------------------------------------------------------------------------

// Reduces `value` over each aligned group of `group` threads (a power of two dividing the block)
// with `combine`; every thread gets its group's result. Every thread of the block must call it.
template <class A, class Combine>
__device__ A group_reduce(A value, int group, Combine combine) {
  __shared__ A shared[kThreads];
  shared[threadIdx.x] = value;
  __syncthreads();
  const int lane = threadIdx.x % group;
  for (int s = group / 2; s > 0; s /= 2) {
    if (lane < s) shared[threadIdx.x] = combine(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const A result = shared[threadIdx.x - lane];
  __syncthreads();
  return result;
}

struct SumCombine {
  template <class A> __device__ A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      return wrap<A>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
    } else {
      return a + b;
    }
  }
};
struct MaxCombine {  // once NaN, stays NaN
  template <class A> __device__ A operator()(A a, A b) const {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return a > b ? a : b;
  }
};
template <class A> __device__ A block_sum(A v) { return group_reduce(v, kThreads, SumCombine{}); }
template <class A> __device__ A block_max(A v) { return group_reduce(v, kThreads, MaxCombine{}); }

// Reduction functors: element(value, r) makes an accumulator from element r of the line,
// combine merges two, finish turns the total into the output.
template <class T, bool kMean>
struct SumReduce {
  using A = std::conditional_t<kIsFloat<T>, double, int64_t>;
  using Out = T;
  __device__ A identity() const { return A(0); }
  __device__ A element(T x, int64_t) const { return static_cast<A>(Num<T>::load(x)); }
  __device__ A combine(A a, A b) const { return SumCombine{}(a, b); }
  __device__ T finish(A a, int64_t count) const {
    if constexpr (kMean) a = a / static_cast<A>(count);
    return Num<T>::store(static_cast<typename Num<T>::C>(a));
  }
};
template <class T>
struct MaxReduce {
  using A = typename Num<T>::C;
  using Out = T;
  __device__ A identity() const { return lowest<A>(); }
  __device__ A element(T x, int64_t) const { return Num<T>::load(x); }
  __device__ A combine(A a, A b) const { return MaxCombine{}(a, b); }
  __device__ T finish(A a, int64_t) const { return Num<T>::store(a); }
};
template <class C>
struct ValueIndex {
  C value;
  int64_t index;  // -1: empty
};
// First index of the maximum; NaN counts as the maximum. Associative and commutative thanks to
// the index tie-break, so any reduction order gives the reference's answer.
template <class T>
struct ArgmaxReduce {
  using C = typename Num<T>::C;
  using A = ValueIndex<C>;
  using Out = int64_t;
  __device__ A identity() const { return A{C(0), -1}; }
  __device__ A element(T x, int64_t r) const { return A{Num<T>::load(x), r}; }
  __device__ A combine(A a, A b) const {
    if (a.index < 0) return b;
    if (b.index < 0) return a;
    const bool an = is_nan(a.value), bn = is_nan(b.value);
    if (an != bn) return an ? a : b;
    if (!an && a.value != b.value) return a.value > b.value ? a : b;
    return a.index < b.index ? a : b;
  }
  __device__ int64_t finish(A a, int64_t) const { return a.index; }
};

struct ProdCombine {
  template <class A> __device__ A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      return wrap<A>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
    } else {
      return a * b;
    }
  }
};
template <class T>
struct ProdReduce {
  using A = std::conditional_t<kIsFloat<T>, double, int64_t>;
  using Out = T;
  __device__ A identity() const { return A(1); }
  __device__ A element(T x, int64_t) const { return static_cast<A>(Num<T>::load(x)); }
  __device__ A combine(A a, A b) const { return ProdCombine{}(a, b); }
  __device__ T finish(A a, int64_t) const {
    return Num<T>::store(static_cast<typename Num<T>::C>(a));
  }
};

template <int kGroup, class T, class R>
__global__ void reduce_kernel(R reduce, const T* x, typename R::Out* out, ReduceLayout layout) {
  using A = typename R::A;
  constexpr int kGroups = kThreads / kGroup;
  const int lane = threadIdx.x % kGroup;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups; first < layout.outputs;
       first += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t o = first + threadIdx.x / kGroup;
    A acc = reduce.identity();
    if (o < layout.outputs) {
      int64_t base = 0, rest = o;
      for (int d = layout.kept_rank - 1; d >= 0; --d) {
        base += (rest % layout.kept_shape[d]) * layout.kept_strides[d];
        rest /= layout.kept_shape[d];
      }
      for (int64_t r = lane; r < layout.count; r += kGroup) {
        int64_t offset = base, left = r;
        for (int d = layout.reduced_rank - 1; d >= 0; --d) {
          offset += (left % layout.reduced_shape[d]) * layout.reduced_strides[d];
          left /= layout.reduced_shape[d];
        }
        acc = reduce.combine(acc, reduce.element(x[offset], r));
      }
    }
    acc = group_reduce(acc, kGroup, [&](A a, A b) { return reduce.combine(a, b); });
    if (o < layout.outputs && lane == 0) out[o] = reduce.finish(acc, layout.count);
  }
}

// A warp per output when there are many outputs or short lines, else a block per output.
template <class T, class R>
void run_reduce(R reduce, const void* x, void* out, const ReduceLayout& layout,
                cudaStream_t stream) {
  if (layout.outputs == 0) return;
  using Out = typename R::Out;
  if (layout.outputs >= 1024 || layout.count <= 64) {
    reduce_kernel<32, T, R><<<grid_items((layout.outputs + 7) / 8), kThreads, 0, stream>>>(
        reduce, static_cast<const T*>(x), static_cast<Out*>(out), layout);
  } else {
    reduce_kernel<kThreads, T, R><<<grid_items(layout.outputs), kThreads, 0, stream>>>(
        reduce, static_cast<const T*>(x), static_cast<Out*>(out), layout);
  }
  check_launch();
}

// ---- gather_elements, scatter_elements, cumsum, topk ---------------------------------------------

// The offset in data that element q of indices addresses with `index` along the axis.
__device__ inline int64_t elements_target(const ElementsLayout& layout, int64_t q, int64_t index) {
  int64_t offset = 0;
  for (int d = layout.rank - 1; d >= 0; --d) {
    const int64_t coordinate = q % layout.index_shape[d];
    q /= layout.index_shape[d];
    offset += (d == layout.axis ? index : coordinate) * layout.data_strides[d];
  }
  return offset;
}

template <class U, class I>
__global__ void gather_elements_kernel(const U* data, const I* indices, U* out,
                                       ElementsLayout layout, int64_t n) {
  KILN_GRID_LOOP(q, n) {
    const int64_t index = static_cast<int64_t>(indices[q]);
    if (index >= 0 && index < layout.dim) {
      out[q] = data[elements_target(layout, q, index)];
    } else {
      record_device_error(kGatherElementsIndexError, index, q, layout.dim);
      out[q] = U(0);
    }
  }
}

// One thread per line of indices along the axis (indices seen as (outer, m, inner)): the lines
// address disjoint positions of out (their other coordinates differ), and each walks its
// updates in index order, as the reference does.
template <class T, class I>
__global__ void scatter_elements_kernel(const I* indices, const T* updates, T* out,
                                        ElementsLayout layout, int reduction, int64_t outer,
                                        int64_t m, int64_t inner) {
  using C = typename Num<T>::C;
  KILN_GRID_LOOP(line, outer * inner) {
    const int64_t o = line / inner, i = line % inner;
    for (int64_t p = 0; p < m; ++p) {
      const int64_t q = (o * m + p) * inner + i;
      const int64_t index = static_cast<int64_t>(indices[q]);
      if (index < 0 || index >= layout.dim) {
        record_device_error(kScatterElementsIndexError, index, q, layout.dim);
        continue;
      }
      T& slot = out[elements_target(layout, q, index)];
      if (reduction == 0) {
        slot = updates[q];
        continue;
      }
      const C a = Num<T>::load(slot), b = Num<T>::load(updates[q]);
      C r;
      if (reduction == 1) r = SumCombine{}(a, b);
      else if (reduction == 2) r = ProdCombine{}(a, b);
      else if (reduction == 3) r = a > b || is_nan(a) ? a : b;  // maximum's NaN rule
      else r = a < b || is_nan(a) ? a : b;
      slot = Num<T>::store(r);
    }
  }
}

template <class T>
__global__ void cumsum_kernel(const T* x, T* y, int64_t outer, int64_t dim, int64_t inner,
                              bool exclusive, bool reverse) {
  using A = std::conditional_t<kIsFloat<T>, double, int64_t>;
  KILN_GRID_LOOP(line, outer * inner) {
    const int64_t o = line / inner, i = line % inner;
    A sum = A(0);
    for (int64_t step = 0; step < dim; ++step) {
      const int64_t at = (o * dim + (reverse ? dim - 1 - step : step)) * inner + i;
      const A before = sum;
      sum = SumCombine{}(sum, static_cast<A>(Num<T>::load(x[at])));
      y[at] = Num<T>::store(static_cast<typename Num<T>::C>(exclusive ? before : sum));
    }
  }
}

// topk's order as a strict "comes before": by value, NaN above every number, then lower index.
template <class C>
__device__ inline bool ranks_before(C a, int64_t ia, C b, int64_t ib, bool largest) {
  const bool an = is_nan(a), bn = is_nan(b);
  if (an != bn) return largest ? an : bn;
  if (!an && a != b) return largest ? a > b : a < b;
  return ia < ib;
}

// Step j finds the best element that ranks after step j - 1's: the order is total, so the
// steps list the line's first k in order with no memory of what was taken.
template <class T>
__global__ void topk_kernel(const T* x, T* values, int64_t* indices, int64_t outer, int64_t dim,
                            int64_t inner, int64_t k, bool largest) {
  using C = typename Num<T>::C;
  KILN_GRID_LOOP(line, outer * inner) {
    const int64_t o = line / inner, i = line % inner;
    const T* row = x + o * dim * inner + i;  // element a at row[a * inner]
    int64_t previous = -1;
    C previous_value = C(0);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      C best_value = C(0);
      for (int64_t a = 0; a < dim; ++a) {
        const C v = Num<T>::load(row[a * inner]);
        if (previous >= 0 && !ranks_before(previous_value, previous, v, a, largest)) continue;
        if (best < 0 || ranks_before(v, a, best_value, best, largest)) {
          best = a;
          best_value = v;
        }
      }
      values[(o * k + j) * inner + i] = row[best * inner];
      indices[(o * k + j) * inner + i] = best;
      previous = best;
      previous_value = best_value;
    }
  }
}

// ---- softmax, norms, cross entropy: one block per line ------------------------------------------

template <class T>
__global__ void softmax_kernel(bool log, const T* x, T* y, int64_t outer, int64_t dim,
                               int64_t inner) {
  using C = typename Num<T>::C;
  for (int64_t line = blockIdx.x; line < outer * inner; line += gridDim.x) {
    const int64_t base = (line / inner) * dim * inner + line % inner;
    C max = lowest<C>();
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
      max = m_max(max, Num<T>::load(x[base + j * inner]));
    max = block_max(max);
    C sum = 0;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
      sum += DeviceMath::exp(Num<T>::load(x[base + j * inner]) - max);
    sum = block_sum(sum);
    const C log_sum = DeviceMath::log(sum);
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const C shifted = Num<T>::load(x[base + j * inner]) - max;
      y[base + j * inner] = Num<T>::store(log ? shifted - log_sum : DeviceMath::exp(shifted) / sum);
    }
  }
}

template <class T>
__global__ void softmax_grad_kernel(bool log, const T* y, const T* dy, T* dx, int64_t outer,
                                    int64_t dim, int64_t inner) {
  using C = typename Num<T>::C;
  for (int64_t line = blockIdx.x; line < outer * inner; line += gridDim.x) {
    const int64_t base = (line / inner) * dim * inner + line % inner;
    C total = 0;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const int64_t at = base + j * inner;
      total += log ? Num<T>::load(dy[at]) : Num<T>::load(dy[at]) * Num<T>::load(y[at]);
    }
    total = block_sum(total);
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const int64_t at = base + j * inner;
      const C yj = Num<T>::load(y[at]), dyj = Num<T>::load(dy[at]);
      dx[at] = Num<T>::store(log ? dyj - DeviceMath::exp(yj) * total : yj * (dyj - total));
    }
  }
}

// Row statistics of layer_norm (mean, inverse std) or rms_norm (0, inverse rms).
template <class T>
__device__ void row_stats(const T* x, int64_t cols, double epsilon, bool rms,
                          typename Num<T>::C& mean, typename Num<T>::C& inv) {
  using C = typename Num<T>::C;
  mean = 0;
  if (!rms) {
    C sum = 0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += Num<T>::load(x[c]);
    mean = block_sum(sum) / C(cols);
  }
  C squares = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C centered = Num<T>::load(x[c]) - mean;
    squares += centered * centered;
  }
  inv = C(1) / DeviceMath::sqrt(block_sum(squares) / C(cols) + C(epsilon));
}

template <class T>
__global__ void norm_kernel(const T* x, const T* gamma, const T* beta, T* y, int64_t rows,
                            int64_t cols, double epsilon) {
  using C = typename Num<T>::C;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    C mean, inv;
    row_stats(xr, cols, epsilon, beta == nullptr, mean, inv);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      C v = (Num<T>::load(xr[c]) - mean) * inv * Num<T>::load(gamma[c]);
      if (beta != nullptr) v += Num<T>::load(beta[c]);
      y[r * cols + c] = Num<T>::store(v);
    }
  }
}

// dx per row; the row's (mean, inv) go to `stats` for the column sums of dgamma/dbeta.
// layer_norm: dx = inv (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma.
// rms_norm:   dx = inv g - inv^3 x sum(g x) / C.
template <class T>
__global__ void norm_grad_rows_kernel(const T* x, const T* gamma, const T* dy, T* dx,
                                      typename Num<T>::C* stats, int64_t rows, int64_t cols,
                                      double epsilon, bool rms) {
  using C = typename Num<T>::C;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *xr = x + r * cols, *dyr = dy + r * cols;
    C mean, inv;
    row_stats(xr, cols, epsilon, rms, mean, inv);
    C sum_g = 0, sum_gx = 0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const C g = Num<T>::load(dyr[c]) * Num<T>::load(gamma[c]);
      sum_g += g;
      sum_gx += g * (rms ? Num<T>::load(xr[c]) : (Num<T>::load(xr[c]) - mean) * inv);
    }
    sum_g = block_sum(sum_g);
    sum_gx = block_sum(sum_gx);
    const C n = C(cols);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const C g = Num<T>::load(dyr[c]) * Num<T>::load(gamma[c]);
      const C xv = Num<T>::load(xr[c]);
      const C v = rms ? inv * g - inv * inv * inv * xv * sum_gx / n
                      : inv * (g - sum_g / n - (xv - mean) * inv * sum_gx / n);
      dx[r * cols + c] = Num<T>::store(v);
    }
    if (threadIdx.x == 0) {
      stats[2 * r] = mean;
      stats[2 * r + 1] = inv;
    }
  }
}

// One thread per column: dgamma = sum_r dy x_hat, dbeta = sum_r dy (f64 accumulation).
template <class T>
__global__ void norm_grad_columns_kernel(const T* x, const T* dy,
                                         const typename Num<T>::C* stats, T* dgamma, T* dbeta,
                                         int64_t rows, int64_t cols) {
  KILN_GRID_LOOP(c, cols) {
    double sum_gamma = 0, sum_beta = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const double d = Num<T>::load(dy[r * cols + c]);
      const double x_hat = (static_cast<double>(Num<T>::load(x[r * cols + c])) - stats[2 * r]) *
                           static_cast<double>(stats[2 * r + 1]);
      sum_gamma += d * x_hat;
      sum_beta += d;
    }
    dgamma[c] = Num<T>::store(static_cast<typename Num<T>::C>(sum_gamma));
    if (dbeta != nullptr) dbeta[c] = Num<T>::store(static_cast<typename Num<T>::C>(sum_beta));
  }
}

// Label of row r, or ignore_index; an out-of-range label is a data error (treated as ignored),
// recorded as `code` (the forward's or the gradient's).
template <class I>
__device__ int64_t row_label(const I* labels, int64_t r, int64_t vocab, int64_t ignore_index,
                             int code) {
  const int64_t label = static_cast<int64_t>(labels[r]);
  if (label != ignore_index && (label < 0 || label >= vocab)) {
    record_device_error(code, label, r, vocab, ignore_index);
    return ignore_index;
  }
  return label;
}

// max and log-sum-exp of a row, in the block.
template <class T>
__device__ void row_logsumexp(const T* row, int64_t vocab, typename Num<T>::C& max,
                              typename Num<T>::C& sum) {
  using C = typename Num<T>::C;
  max = lowest<C>();
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) max = m_max(max, Num<T>::load(row[c]));
  max = block_max(max);
  sum = 0;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) sum += DeviceMath::exp(Num<T>::load(row[c]) - max);
  sum = block_sum(sum);
}

// Per-row losses: to out (reduction "none") or to scratch (loss, counted) pairs in f64.
template <class T, class I>
__global__ void cross_entropy_rows_kernel(const T* logits, const I* labels, T* out,
                                          double* scratch, int64_t rows, int64_t vocab,
                                          int64_t ignore_index) {
  using C = typename Num<T>::C;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t label = row_label(labels, r, vocab, ignore_index, kCrossEntropyLabelError);
    if (label == ignore_index) {  // uniform in the block
      if (threadIdx.x == 0) {
        if (out != nullptr) out[r] = Num<T>::store(C(0));
        if (scratch != nullptr) scratch[2 * r] = scratch[2 * r + 1] = 0;
      }
      continue;
    }
    const T* row = logits + r * vocab;
    C max, sum;
    row_logsumexp(row, vocab, max, sum);
    if (threadIdx.x == 0) {
      const C loss = max + DeviceMath::log(sum) - Num<T>::load(row[label]);
      if (out != nullptr) out[r] = Num<T>::store(loss);
      if (scratch != nullptr) {
        scratch[2 * r] = loss;
        scratch[2 * r + 1] = 1;
      }
    }
  }
}

// One block: total (sum) or total / counted (mean, 0 when nothing is counted).
template <class T>
__global__ void cross_entropy_total_kernel(const double* scratch, T* out, int64_t rows, bool mean) {
  double total = 0, counted = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    total += scratch[2 * r];
    counted += scratch[2 * r + 1];
  }
  total = block_sum(total);
  counted = block_sum(counted);
  if (threadIdx.x == 0) {
    const double v = !mean ? total : (counted == 0 ? 0.0 : total / counted);
    out[0] = Num<T>::store(static_cast<typename Num<T>::C>(v));
  }
}

template <class I>
__global__ void count_labels_kernel(const I* labels, int64_t rows, int64_t vocab,
                                    int64_t ignore_index, int64_t* counted) {
  int64_t count = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const int64_t label = row_label(labels, r, vocab, ignore_index, kCrossEntropyGradLabelError);
    count += label != ignore_index ? 1 : 0;
  }
  count = block_sum(count);
  if (threadIdx.x == 0) *counted = count;
}

// dlogits = (softmax - one_hot(label)) * scale; ignored rows get 0.
template <class T, class I>
__global__ void cross_entropy_grad_kernel(const T* logits, const I* labels, const T* dloss,
                                          T* dlogits, const int64_t* counted, int64_t rows,
                                          int64_t vocab, int64_t ignore_index, int reduction) {
  using C = typename Num<T>::C;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t label = static_cast<int64_t>(labels[r]);
    const bool ignored = label == ignore_index || label < 0 || label >= vocab;
    T* out = dlogits + r * vocab;
    if (ignored) {
      for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) out[c] = Num<T>::store(C(0));
      continue;
    }
    const T* row = logits + r * vocab;
    const C scale = reduction == 2   ? Num<T>::load(dloss[r])
                    : reduction == 1 ? Num<T>::load(dloss[0])
                                     : Num<T>::load(dloss[0]) / C(*counted);
    C max, sum;
    row_logsumexp(row, vocab, max, sum);
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
      const C p = DeviceMath::exp(Num<T>::load(row[c]) - max) / sum;
      out[c] = Num<T>::store((p - (c == label ? C(1) : C(0))) * scale);
    }
  }
}

// ---- optimizers -----------------------------------------------------------------------------------

__device__ inline double load_scalar(DType type, const void* p) {
  switch (type) {
    case DType::kF32: return *static_cast<const float*>(p);
    case DType::kF64: return *static_cast<const double*>(p);
    case DType::kF16: return __half2float(*static_cast<const __half*>(p));
    case DType::kBF16: return __bfloat162float(*static_cast<const __nv_bfloat16*>(p));
    default: return 0;  // inference accepts float scalars only
  }
}

// Param, gradient and slots of one type T, computed in double (Num<T>::C for the stores); the
// element update is the rule's (ops/optimizer/rules.h).
template <class Rule, class T>
__global__ void update_kernel(nn::UpdateTensor x, optim::HyperValues h, DType lr_type, const void* lr_ptr,
                              DType step_type, const void* step_ptr) {
  using C = typename Num<T>::C;
  const auto c = Rule::template prepare<double>(h, load_scalar(lr_type, lr_ptr), load_scalar(step_type, step_ptr));
  KILN_GRID_LOOP(i, x.n) {
    double s[Rule::kSlots];
    for (int j = 0; j < Rule::kSlots; ++j) s[j] = Num<T>::load(static_cast<const T*>(x.slots[j])[i]);
    const double p = Rule::apply(c, static_cast<double>(Num<T>::load(static_cast<const T*>(x.param)[i])),
                                 static_cast<double>(Num<T>::load(static_cast<const T*>(x.grad)[i])), s);
    static_cast<T*>(x.param_out)[i] = Num<T>::store(static_cast<C>(p));
    for (int j = 0; j < Rule::kSlots; ++j) static_cast<T*>(x.slots_out[j])[i] = Num<T>::store(static_cast<C>(s[j]));
  }
}

// ---- matmul ---------------------------------------------------------------------------------------

constexpr int kTile = 16;

template <class T>
__global__ void matmul_kernel(const T* a, const T* b, T* c, MatmulLayout L) {
  using C = typename Num<T>::C;
  __shared__ C a_tile[kTile][kTile];
  __shared__ C b_tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kTile + ty;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx;
  for (int64_t z = blockIdx.z; z < L.batch; z += gridDim.z) {
    int64_t a_index = 0, b_index = 0, rest = z;
    for (int d = L.batch_rank - 1; d >= 0; --d) {
      const int64_t index = rest % L.batch_shape[d];
      rest /= L.batch_shape[d];
      a_index += index * L.a_batch_strides[d];
      b_index += index * L.b_batch_strides[d];
    }
    const T* a0 = a + a_index * L.m * L.k;
    const T* b0 = b + b_index * L.k * L.n;
    C acc = 0;
    for (int64_t k0 = 0; k0 < L.k; k0 += kTile) {
      const int64_t ka = k0 + tx, kb = k0 + ty;
      a_tile[ty][tx] = row < L.m && ka < L.k
                           ? Num<T>::load(a0[L.transpose_a ? ka * L.m + row : row * L.k + ka])
                           : C(0);
      b_tile[ty][tx] = kb < L.k && col < L.n
                           ? Num<T>::load(b0[L.transpose_b ? col * L.k + kb : kb * L.n + col])
                           : C(0);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTile; ++kk) acc += a_tile[ty][kk] * b_tile[kk][tx];
      __syncthreads();
    }
    if (row < L.m && col < L.n) c[z * L.m * L.n + row * L.n + col] = Num<T>::store(acc);
  }
}

// ---- attention ------------------------------------------------------------------------------------

constexpr int64_t kMaxKeys = 4096;

// Normalized weights P_j of query i (masked keys 0) into `weights`; block-wide. Returns the
// log-sum-exp of the scores (every thread gets it; -inf when a key bias masked every key, whose
// weights are then 0/0, NaN, as softmax's). `bias`: the row of key_bias, or null.
template <class T>
__device__ typename Num<T>::C attention_weights(const T* q_row, const T* k_mat, const T* bias,
                                                typename Num<T>::C* weights, int64_t i,
                                                int64_t tk, int64_t d, bool causal,
                                                double scale) {
  using C = typename Num<T>::C;
  C max = lowest<C>();
  for (int64_t j = threadIdx.x; j < tk; j += blockDim.x) {
    C s = lowest<C>();
    if (!causal || j <= i) {
      s = 0;
      for (int64_t c = 0; c < d; ++c) s += Num<T>::load(q_row[c]) * Num<T>::load(k_mat[j * d + c]);
      s *= C(scale);
      if (bias != nullptr) s += Num<T>::load(bias[j]);
    }
    weights[j] = s;
    max = m_max(max, s);
  }
  max = block_max(max);
  C sum = 0;
  for (int64_t j = threadIdx.x; j < tk; j += blockDim.x) {
    const C w = (causal && j > i) || weights[j] == -C(INFINITY) ? C(0) : DeviceMath::exp(weights[j] - max);
    weights[j] = w;
    sum += w;
  }
  sum = block_sum(sum);
  for (int64_t j = threadIdx.x; j < tk; j += blockDim.x) weights[j] /= sum;
  __syncthreads();
  return max + DeviceMath::log(sum);
}

// P_j = exp(s_j - lse) of query i from the saved log-sum-exp (masked keys 0); block-wide.
template <class T>
__device__ void attention_weights_from_lse(const T* q_row, const T* k_mat, const T* bias,
                                           typename Num<T>::C* weights, typename Num<T>::C lse,
                                           int64_t i, int64_t tk, int64_t d, bool causal,
                                           double scale) {
  using C = typename Num<T>::C;
  for (int64_t j = threadIdx.x; j < tk; j += blockDim.x) {
    C w = 0;
    if (!causal || j <= i) {
      C s = 0;
      for (int64_t c = 0; c < d; ++c) s += Num<T>::load(q_row[c]) * Num<T>::load(k_mat[j * d + c]);
      s *= C(scale);
      if (bias != nullptr) s += Num<T>::load(bias[j]);
      w = s == -C(INFINITY) ? C(0) : DeviceMath::exp(s - lse);
    }
    weights[j] = w;
  }
  __syncthreads();
}

// lse is f32 (f64 for f64 inputs): Num<T>::C.
template <class T>
__global__ void attention_kernel(const T* q, const T* k, const T* v, const T* bias, T* out,
                                 typename Num<T>::C* lse, int64_t batch, int64_t tq, int64_t tk,
                                 int64_t d, int64_t dv, int64_t bias_heads, bool causal, double scale) {
  using C = typename Num<T>::C;
  extern __shared__ unsigned char shared_bytes[];
  C* weights = reinterpret_cast<C*>(shared_bytes);
  for (int64_t item = blockIdx.x; item < batch * tq; item += gridDim.x) {
    const int64_t b = item / tq, i = item % tq;
    const T* bias_row = bias != nullptr ? bias + b / bias_heads * tk : nullptr;
    const C row_lse = attention_weights(q + item * d, k + b * tk * d, bias_row, weights, i, tk, d,
                                        causal, scale);
    if (threadIdx.x == 0) lse[item] = row_lse;
    const T* v0 = v + b * tk * dv;
    for (int64_t c = threadIdx.x; c < dv; c += blockDim.x) {
      C acc = 0;
      for (int64_t j = 0; j < tk; ++j) acc += weights[j] * Num<T>::load(v0[j * dv + c]);
      out[item * dv + c] = Num<T>::store(acc);
    }
    __syncthreads();
  }
}

__device__ inline void atomic_add_acc(float* p, float v) { atomicAdd(p, v); }
__device__ inline void atomic_add_acc(double* p, double v) { atomicAdd(p, v); }

// dq directly; dk and dv summed over queries with atomics into the accumulators. P from the
// given lse, D_i = dout_i . out_i from the given out (the op's definition).
template <class T>
__global__ void attention_grad_kernel(const T* q, const T* k, const T* v, const T* bias, const T* out,
                                      const T* dout, const typename Num<T>::C* lse, T* dq,
                                      typename Num<T>::C* dk_acc, typename Num<T>::C* dv_acc,
                                      int64_t batch, int64_t tq, int64_t tk, int64_t d,
                                      int64_t dv, int64_t bias_heads, bool causal, double scale) {
  using C = typename Num<T>::C;
  extern __shared__ unsigned char shared_bytes[];
  C* weights = reinterpret_cast<C*>(shared_bytes);
  C* ds = weights + tk;
  for (int64_t item = blockIdx.x; item < batch * tq; item += gridDim.x) {
    const int64_t b = item / tq, i = item % tq;
    const T *q_row = q + item * d, *k0 = k + b * tk * d, *v0 = v + b * tk * dv;
    const T *g_row = dout + item * dv, *o_row = out + item * dv;
    const T* bias_row = bias != nullptr ? bias + b / bias_heads * tk : nullptr;
    attention_weights_from_lse(q_row, k0, bias_row, weights, lse[item], i, tk, d, causal, scale);
    C weighted = 0;  // D_i = dout_i . out_i
    for (int64_t c = threadIdx.x; c < dv; c += blockDim.x)
      weighted += Num<T>::load(g_row[c]) * Num<T>::load(o_row[c]);
    weighted = block_sum(weighted);
    for (int64_t j = threadIdx.x; j < tk; j += blockDim.x) {
      C dp = 0;  // dP_j = dout_i . v_j
      for (int64_t c = 0; c < dv; ++c) dp += Num<T>::load(g_row[c]) * Num<T>::load(v0[j * dv + c]);
      ds[j] = dp;
    }
    for (int64_t j = threadIdx.x; j < tk; j += blockDim.x)
      ds[j] = weights[j] * (ds[j] - weighted) * C(scale);
    __syncthreads();
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      C acc = 0;
      for (int64_t j = 0; j < tk; ++j) acc += ds[j] * Num<T>::load(k0[j * d + c]);
      dq[item * d + c] = Num<T>::store(acc);
    }
    for (int64_t e = threadIdx.x; e < tk * d; e += blockDim.x) {
      const int64_t j = e / d, c = e % d;
      if (ds[j] != C(0)) atomic_add_acc(&dk_acc[b * tk * d + e], ds[j] * Num<T>::load(q_row[c]));
    }
    for (int64_t e = threadIdx.x; e < tk * dv; e += blockDim.x) {
      const int64_t j = e / dv, c = e % dv;
      if (weights[j] != C(0))
        atomic_add_acc(&dv_acc[b * tk * dv + e], weights[j] * Num<T>::load(g_row[c]));
    }
    __syncthreads();
  }
}

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------

void launch_unary(math::Fn fn, DType type, const void* x, void* y, int64_t n,
                  cudaStream_t stream) {
  if (n == 0) return;
  math::visit(fn, [&](auto line) {
    using F = decltype(line);
    if constexpr (F::arity() == 1) {
      unary<F>(type, x, y, n, stream);
    } else {
      fail("cuda generic: {} is not a unary line", F::name());
    }
  });
}

void launch_binary(math::Fn fn, DType type, const void* a, const void* b, void* out,
                   const Layout& layout, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  math::visit(fn, [&](auto line) {
    using F = decltype(line);
    if constexpr (F::arity() == 2) {
      binary<F>(type, a, b, out, layout, n, stream);
    } else {
      fail("cuda generic: {} is not a binary line", F::name());
    }
  });
}

void launch_where(int elem_size, const void* cond, const void* a, const void* b, void* out,
                  const Layout& layout, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  visit_size(elem_size, [&](auto tag) {
    using U = typename decltype(tag)::type;
    where_kernel<U><<<grid_for(n), kThreads, 0, stream>>>(
        static_cast<const bool*>(cond), static_cast<const U*>(a), static_cast<const U*>(b),
        static_cast<U*>(out), layout, n);
    check_launch();
  });
}

void launch_cast(DType from, DType to, const void* x, void* y, int64_t n,
                 cudaStream_t stream) {
  if (n == 0) return;
  visit(from, [&](auto from_tag) {
    visit(to, [&](auto to_tag) {
      using From = typename decltype(from_tag)::type;
      using To = typename decltype(to_tag)::type;
      cast_kernel<From, To><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const From*>(x),
                                                         static_cast<To*>(y), n);
      check_launch();
    });
  });
}

void launch_dropout(DType type, const void* x, void* y, int64_t n, double p,
                    uint32_t threshold, uint64_t seed, const int64_t* offset,
                    cudaStream_t stream) {
  if (n == 0) return;
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = typename Num<T>::C;
    dropout_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x),
                                                          static_cast<T*>(y), n, C(1.0 - p),
                                                          threshold, seed, offset);
    check_launch();
  });
}

void launch_fill(int elem_size, uint64_t bits, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  // All-zero bits (0 of every dtype, +0.0): the copy engine's memset runs at full bandwidth (the
  // f32 gradient buffer of GPT-2's embedding: 154 MB, 118 us through the kernel).
  if (bits == 0) {
    KILN_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(n) * elem_size, stream));
    return;
  }
  visit_size(elem_size, [&](auto tag) {
    using U = typename decltype(tag)::type;
    fill_kernel<U><<<grid_for(n), kThreads, 0, stream>>>(static_cast<U>(bits), static_cast<U*>(out),
                                                       n);
    check_launch();
  });
}

void launch_iota(DType type, void* out, int64_t n, int64_t dim, int64_t inner,
                 cudaStream_t stream) {
  if (n == 0) return;
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    iota_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<T*>(out), n, dim, inner);
    check_launch();
  });
}

void launch_copy(int elem_size, const void* in, void* out, const Layout& layout, int64_t n,
                 cudaStream_t stream) {
  if (n == 0) return;
  visit_size(elem_size, [&](auto tag) {
    using U = typename decltype(tag)::type;
    copy_kernel<U><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const U*>(in),
                                                       static_cast<U*>(out), layout, n);
    check_launch();
  });
}

void launch_one_hot(DType index_type, const void* indices, DType out_type, void* out,
                    int64_t n_indices, int64_t depth, cudaStream_t stream) {
  const int64_t n = n_indices * depth;
  if (n == 0) return;
  visit(index_type, [&](auto index_tag) {
    visit(out_type, [&](auto out_tag) {
      using I = typename decltype(index_tag)::type;
      using To = typename decltype(out_tag)::type;
      if constexpr (std::is_integral_v<I> && !std::is_same_v<I, bool>) {
        one_hot_kernel<I, To><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const I*>(indices),
                                                              static_cast<To*>(out), n, depth);
        check_launch();
      } else {
        fail("cuda generic: one_hot indices must be integers");
      }
    });
  });
}

// Index types are i32 or i64 (inference checks it).
template <class Fn>
void visit_index(DType t, Fn&& fn) {
  if (t == DType::kI32) return fn(Tag<int32_t>{});
  if (t == DType::kI64) return fn(Tag<int64_t>{});
  fail("cuda generic: indices must be i32 or i64, got {}", dtype_name(t));
}

void launch_gather(int elem_size, const void* table, DType index_type, const void* indices,
                   void* out, int64_t outer, int64_t dim, int64_t inner, int64_t n_indices,
                   cudaStream_t stream) {
  const int64_t n = outer * n_indices * inner;
  if (n == 0) return;
  visit_size(elem_size, [&](auto tag) {
    visit_index(index_type, [&](auto index_tag) {
      using U = typename decltype(tag)::type;
      using I = typename decltype(index_tag)::type;
      gather_kernel<U, I><<<grid_for(n), kThreads, 0, stream>>>(
          static_cast<const U*>(table), static_cast<const I*>(indices), static_cast<U*>(out),
          outer, dim, inner, n_indices);
      check_launch();
    });
  });
}

void launch_scatter_add(DType type, const void* base, DType index_type, const void* indices,
                        const void* updates, void* out, int64_t outer, int64_t dim,
                        int64_t inner, int64_t n_indices, cudaStream_t stream) {
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, uint8_t>) {
      fail("cuda generic: scatter_add does not take bool or u8 (no byte-wide atomics)");
    } else {
      const int64_t base_n = outer * dim * inner;
      if (out != base && base_n > 0)
        KILN_CUDA_CHECK(cudaMemcpyAsync(out, base, base_n * sizeof(T), cudaMemcpyDeviceToDevice,
                                        stream));
      const int64_t n = outer * n_indices * inner;
      if (n == 0) return;
      visit_index(index_type, [&](auto index_tag) {
        using I = typename decltype(index_tag)::type;
        scatter_add_kernel<T, I><<<grid_for(n), kThreads, 0, stream>>>(
            static_cast<const I*>(indices), static_cast<const T*>(updates), static_cast<T*>(out),
            outer, dim, inner, n_indices);
        check_launch();
      });
    }
  });
}

void launch_gather_elements(int elem_size, const void* data, DType index_type, const void* indices,
                            void* out, const ElementsLayout& layout, int64_t n,
                            cudaStream_t stream) {
  if (n == 0) return;
  visit_size(elem_size, [&](auto tag) {
    visit_index(index_type, [&](auto index_tag) {
      using U = typename decltype(tag)::type;
      using I = typename decltype(index_tag)::type;
      gather_elements_kernel<U, I><<<grid_for(n), kThreads, 0, stream>>>(
          static_cast<const U*>(data), static_cast<const I*>(indices), static_cast<U*>(out),
          layout, n);
      check_launch();
    });
  });
}

void launch_scatter_elements(DType type, const void* data, int64_t data_n, DType index_type,
                             const void* indices, const void* updates, void* out,
                             const ElementsLayout& layout, int reduction, cudaStream_t stream) {
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (out != data && data_n > 0)
      KILN_CUDA_CHECK(cudaMemcpyAsync(out, data, data_n * sizeof(T), cudaMemcpyDeviceToDevice,
                                      stream));
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < layout.axis; ++d) outer *= layout.index_shape[d];
    for (int d = layout.axis + 1; d < layout.rank; ++d) inner *= layout.index_shape[d];
    const int64_t m = layout.index_shape[layout.axis];
    if (outer * inner == 0 || m == 0) return;
    visit_index(index_type, [&](auto index_tag) {
      using I = typename decltype(index_tag)::type;
      scatter_elements_kernel<T, I><<<grid_for(outer * inner), kThreads, 0, stream>>>(
          static_cast<const I*>(indices), static_cast<const T*>(updates), static_cast<T*>(out),
          layout, reduction, outer, m, inner);
      check_launch();
    });
  });
}

void launch_cumsum(DType type, const void* x, void* y, int64_t outer, int64_t dim, int64_t inner,
                   bool exclusive, bool reverse, cudaStream_t stream) {
  if (outer * dim * inner == 0) return;
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      fail("cuda generic: cumsum does not take bool");
    } else {
      cumsum_kernel<T><<<grid_for(outer * inner), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), outer, dim, inner, exclusive, reverse);
      check_launch();
    }
  });
}

void launch_topk(DType type, const void* x, void* values, int64_t* indices, int64_t outer,
                 int64_t dim, int64_t inner, int64_t k, bool largest, cudaStream_t stream) {
  if (outer * k * inner == 0) return;
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      fail("cuda generic: topk does not take bool");
    } else {
      topk_kernel<T><<<grid_for(outer * inner), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(values), indices, outer, dim, inner, k,
          largest);
      check_launch();
    }
  });
}

void launch_reduce(Op op, DType type, const void* x, void* out, const ReduceLayout& layout,
                   cudaStream_t stream) {
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (op) {
      case Op::kSum: return run_reduce<T>(SumReduce<T, false>{}, x, out, layout, stream);
      case Op::kMean:
        if constexpr (kIsFloat<T>) return run_reduce<T>(SumReduce<T, true>{}, x, out, layout, stream);
        break;
      case Op::kMax: return run_reduce<T>(MaxReduce<T>{}, x, out, layout, stream);
      case Op::kProd: return run_reduce<T>(ProdReduce<T>{}, x, out, layout, stream);
      default: break;
    }
    fail("cuda generic: {} is not a reduction that takes {}", op_name(op), dtype_name(type));
  });
}

void launch_argmax(DType type, const void* x, int64_t* out, int64_t outer, int64_t dim,
                   int64_t inner, cudaStream_t stream) {
  ReduceLayout layout;
  layout.kept_rank = 2;
  layout.kept_shape[0] = outer;
  layout.kept_strides[0] = dim * inner;
  layout.kept_shape[1] = inner;
  layout.kept_strides[1] = 1;
  layout.reduced_rank = 1;
  layout.reduced_shape[0] = dim;
  layout.reduced_strides[0] = inner;
  layout.outputs = outer * inner;
  layout.count = dim;
  visit(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_reduce<T>(ArgmaxReduce<T>{}, x, out, layout, stream);
  });
}

void launch_matmul(DType type, const void* a, const void* b, void* c,
                   const MatmulLayout& layout, cudaStream_t stream) {
  if (layout.m == 0 || layout.n == 0 || layout.batch == 0) return;
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const dim3 block(kTile, kTile);
    const dim3 grid(static_cast<unsigned>((layout.n + kTile - 1) / kTile),
                    static_cast<unsigned>((layout.m + kTile - 1) / kTile),
                    static_cast<unsigned>(std::min<int64_t>(layout.batch, 65535)));
    KILN_CHECK(grid.y <= 65535, "cuda generic matmul: m = {} is too large", layout.m);
    matmul_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                              static_cast<T*>(c), layout);
    check_launch();
  });
}

void launch_softmax(DType type, bool log, const void* x, void* y, int64_t outer, int64_t dim,
                    int64_t inner, cudaStream_t stream) {
  if (outer * inner * dim == 0) return;
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_kernel<T><<<grid_items(outer * inner), kThreads, 0, stream>>>(
        log, static_cast<const T*>(x), static_cast<T*>(y), outer, dim, inner);
    check_launch();
  });
}

void launch_softmax_grad(DType type, bool log, const void* y, const void* dy, void* dx,
                         int64_t outer, int64_t dim, int64_t inner, cudaStream_t stream) {
  if (outer * inner * dim == 0) return;
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_grad_kernel<T><<<grid_items(outer * inner), kThreads, 0, stream>>>(
        log, static_cast<const T*>(y), static_cast<const T*>(dy), static_cast<T*>(dx), outer, dim,
        inner);
    check_launch();
  });
}

void launch_norm(DType type, const void* x, const void* gamma, const void* beta, void* y,
                 int64_t rows, int64_t cols, double epsilon, cudaStream_t stream) {
  if (rows * cols == 0) return;
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    norm_kernel<T><<<grid_items(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(beta),
        static_cast<T*>(y), rows, cols, epsilon);
    check_launch();
  });
}

void launch_norm_grad(DType type, const void* x, const void* gamma, const void* dy, void* dx,
                      void* dgamma, void* dbeta, int64_t rows, int64_t cols, double epsilon,
                      cudaStream_t stream) {
  if (cols == 0) return;
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = typename Num<T>::C;
    Scratch stats(2 * rows * sizeof(C), stream);
    if (rows > 0) {
      norm_grad_rows_kernel<T><<<grid_items(rows), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(dy),
          static_cast<T*>(dx), stats.as<C>(), rows, cols, epsilon, dbeta == nullptr);
      check_launch();
    }
    norm_grad_columns_kernel<T><<<grid_for(cols), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(dy), stats.as<C>(),
        static_cast<T*>(dgamma), static_cast<T*>(dbeta), rows, cols);
    check_launch();
  });
}

void launch_cross_entropy(DType type, const void* logits, DType label_type,
                          const void* labels, void* out, int64_t rows, int64_t vocab,
                          int64_t ignore_index, int reduction, cudaStream_t stream) {
  visit_float(type, [&](auto tag) {
    visit_index(label_type, [&](auto label_tag) {
      using T = typename decltype(tag)::type;
      using I = typename decltype(label_tag)::type;
      const bool none = reduction == 2;
      Scratch scratch(none ? 0 : 2 * rows * sizeof(double), stream);
      if (rows > 0) {
        cross_entropy_rows_kernel<T, I><<<grid_items(rows), kThreads, 0, stream>>>(
            static_cast<const T*>(logits), static_cast<const I*>(labels),
            none ? static_cast<T*>(out) : nullptr, none ? nullptr : scratch.as<double>(), rows,
            vocab, ignore_index);
        check_launch();
      }
      if (!none) {
        cross_entropy_total_kernel<T><<<1, kThreads, 0, stream>>>(
            scratch.as<double>(), static_cast<T*>(out), rows, reduction == 0);
        check_launch();
      }
    });
  });
}

void launch_cross_entropy_grad(DType type, const void* logits, DType label_type,
                               const void* labels, const void* dloss, void* dlogits,
                               int64_t rows, int64_t vocab, int64_t ignore_index, int reduction,
                               cudaStream_t stream) {
  if (rows * vocab == 0) return;
  visit_float(type, [&](auto tag) {
    visit_index(label_type, [&](auto label_tag) {
      using T = typename decltype(tag)::type;
      using I = typename decltype(label_tag)::type;
      Scratch counted(sizeof(int64_t), stream);
      count_labels_kernel<I><<<1, kThreads, 0, stream>>>(static_cast<const I*>(labels), rows, vocab,
                                                      ignore_index, counted.as<int64_t>());
      check_launch();
      cross_entropy_grad_kernel<T, I><<<grid_items(rows), kThreads, 0, stream>>>(
          static_cast<const T*>(logits), static_cast<const I*>(labels),
          static_cast<const T*>(dloss), static_cast<T*>(dlogits), counted.as<int64_t>(), rows,
          vocab, ignore_index, reduction);
      check_launch();
    });
  });
}

void launch_optimizer_update(const char* optimizer, const optim::HyperValues& h, DType type,
                             const nn::UpdateTensor& x, DType lr_type, const void* lr, DType step_type,
                             const void* step, cudaStream_t stream) {
  if (x.n == 0) return;
  const bool known = optim::visit_rule(optimizer, [&](auto rule) {
    visit_float(type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      update_kernel<decltype(rule), T><<<grid_for(x.n), kThreads, 0, stream>>>(x, h, lr_type, lr, step_type, step);
      check_launch();
    });
  });
  KILN_CHECK(known, "cuda optimizer_update: no rule for optimizer '{}'", optimizer);
}

int64_t attention_max_keys() { return kMaxKeys; }

// Dynamic shared memory for `bytes`; above the default 48 KiB the kernel must opt in.
template <class Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)));
}

void launch_attention(DType type, const void* q, const void* k, const void* v, const void* key_bias,
                      void* out, void* lse, int64_t batch, int64_t tq, int64_t tk, int64_t d, int64_t dv,
                      int64_t bias_heads, bool causal, double scale, cudaStream_t stream) {
  if (batch * tq == 0) return;
  KILN_CHECK(tk >= 1 && tk <= kMaxKeys, "cuda generic attention: tk = {}, expected 1..{}", tk,
             kMaxKeys);
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const size_t shared = tk * sizeof(typename Num<T>::C);
    allow_shared(attention_kernel<T>, shared);
    attention_kernel<T><<<grid_items(batch * tq), kThreads, shared, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<const T*>(key_bias), static_cast<T*>(out), static_cast<typename Num<T>::C*>(lse),
        batch, tq, tk, d, dv, bias_heads, causal, scale);
    check_launch();
  });
}

void launch_attention_grad(DType type, const void* q, const void* k, const void* v, const void* key_bias,
                           const void* out, const void* dout, const void* lse, void* dq, void* dk,
                           void* dv_out, int64_t batch,
                           int64_t tq, int64_t tk, int64_t d, int64_t dv, int64_t bias_heads, bool causal,
                           double scale, cudaStream_t stream) {
  KILN_CHECK(tk <= kMaxKeys, "cuda generic attention_grad: tk = {}, expected at most {}", tk,
             kMaxKeys);
  visit_float(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = typename Num<T>::C;
    const DType acc_type = std::is_same_v<C, double> ? DType::kF64 : DType::kF32;
    const int64_t nk = batch * tk * d, nv = batch * tk * dv;
    Scratch dk_acc(nk * sizeof(C), stream), dv_acc(nv * sizeof(C), stream);
    KILN_CUDA_CHECK(cudaMemsetAsync(dk_acc.as<C>(), 0, nk * sizeof(C), stream));
    KILN_CUDA_CHECK(cudaMemsetAsync(dv_acc.as<C>(), 0, nv * sizeof(C), stream));
    if (batch * tq > 0 && tk > 0) {
      const size_t shared = 2 * tk * sizeof(C);
      allow_shared(attention_grad_kernel<T>, shared);
      attention_grad_kernel<T><<<grid_items(batch * tq), kThreads, shared, stream>>>(
          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
          static_cast<const T*>(key_bias), static_cast<const T*>(out), static_cast<const T*>(dout),
          static_cast<const C*>(lse), static_cast<T*>(dq), dk_acc.as<C>(), dv_acc.as<C>(), batch, tq,
          tk, d, dv, bias_heads, causal, scale);
      check_launch();
    } else if (batch * tq * d > 0) {
      KILN_CUDA_CHECK(cudaMemsetAsync(dq, 0, batch * tq * d * sizeof(T), stream));
    }
    launch_cast(acc_type, type, dk_acc.as<C>(), dk, nk, stream);
    launch_cast(acc_type, type, dv_acc.as<C>(), dv_out, nv, stream);
  });
}

}  // namespace kiln::cuda::generic
