// The "nvrtc" dialect's back half: compiles generated kernels (codegen.h) with NVRTC, loads them
// with the runtime's library API and launches them on the kernel's stream (with column
// reductions: the main kernel, then the finish kernel, sharing a stream-ordered scratch buffer of
// partial sums); and binds "gemm-epilogue" fused nodes to cuda::Gemm with the matching cuBLASLt
// epilogue (cublaslt.h), or to a product followed by a generated epilogue kernel.
//
// Compilation needs no GPU (NVRTC is a host library): nvrtc_compile() works on a machine without
// one, which is how CI catches syntax errors in generated code. Loading and launching need one.
// Compiled images are cached by source text (one compile per distinct body, thread-safe; two
// threads asking for the same new source compile it once); modules are loaded once per device.
// Across processes, CUBINs are kept in the on-disk compile cache (support/compile_cache.h), so
// a second run of a model loads its kernels from disk instead of compiling them.
#pragma once

#include <nvrtc.h>

#include <cstddef>
#include <string>

#include "backends/cuda/nvrtc/codegen.h"
#include "ir/op_def.h"
#include "support/compile_cache.h"
#include "support/error.h"

// Every NVRTC call goes through this: a failure throws kiln::Error with file:line and the name.
#define KILN_NVRTC_CHECK(call)                                                              \
  do {                                                                                      \
    nvrtcResult kiln_nvrtc_status_ = (call);                                                \
    if (kiln_nvrtc_status_ != NVRTC_SUCCESS)                                                \
      ::kiln::fail("{}:{}: {} failed: {}", __FILE__, __LINE__, #call,                      \
                   nvrtcGetErrorString(kiln_nvrtc_status_));                                \
  } while (0)

namespace kiln::cuda {

// The directory holding cuda_fp16.h / cuda_bf16.h for NVRTC: $CUDA_HOME/include,
// $CUDA_PATH/include, /usr/local/cuda/include, or next to the nvcc found on $PATH. Throws
// kiln::Error naming the places tried when none has them.
const std::string& cuda_include_dir();
// The --gpu-architecture for `device`: "sm_90a" on Hopper, else "sm_<major><minor>".
std::string gpu_architecture(int device);

// Compiles `source` with NVRTC for `arch` ("sm_90a") to a CUBIN. A compile error throws
// kiln::Error with NVRTC's log and the source line it names. Uncached (nvrtc_compile_cached is
// the cached path).
std::string nvrtc_compile(const std::string& source, const std::string& arch);
// nvrtc_compile through the on-disk compile cache (support/compile_cache.h): `cache`, or when
// null CompileCache::global("nvrtc") ($KILN_CACHE_DIR/nvrtc, ~/.cache/kiln/nvrtc;
// KILN_CACHE_DIR=off disables it). A hit returns the stored CUBIN without compiling; a miss
// compiles and stores. The key is nvrtc_cache_key's text. A compile error stores nothing.
std::string nvrtc_compile_cached(const std::string& source, const std::string& arch,
                                 CompileCache* cache = nullptr);
// Everything that determines the CUBIN: kiln's key version, NVRTC's version, the arch, the
// compile options (the CUDA include folder among them) and the source.
std::string nvrtc_cache_key(const std::string& source, const std::string& arch);

// Launches `kernel` on args.stream with the node's tensors (device pointers): compiles it on
// first use (cached by source in memory, and on disk by nvrtc_compile_cached), loads it on the
// current device, picks the vectorized entry when every pointer is aligned for it.
void launch_generated(const GeneratedKernel& kernel, const KernelArgs& args);
// Distinct sources compiled so far (for tests).
size_t nvrtc_cache_size();

// GEMM-epilogue bodies, mapped in this order:
//  1. One cuBLASLt product with a fused epilogue (gemm_epilogue_supported): matmul, then a bias
//     add ((n,), the BIAS epilogue) and/or an add of a tensor of the product's shape (C,
//     beta = 1), each at most once, with a cast of a bf16/f16 value to f32 absorbed before,
//     between or after them (cuBLASLt writes f32 from its f32 accumulator: nothing is rounded to
//     16 bits first; a bias before the cast stays 16-bit, C is read in f32: GPT-2's residual
//     projection x + f32(y W + b) under amp is one call), then gelu{tanh} (with or without the
//     pre-activation as a second output), or gelu_grad{tanh}(aux, product) (+ its bias gradient,
//     a sum over rows); or the product with the bias gradient of one operand. The epilogue is
//     computed from the f32 accumulator and rounded once per stored output.
//  2. Otherwise a product + generated epilogue (gemm_split_supported): the product (with a cast
//     to f32 absorbed as above) written to its output or to a stream-ordered scratch buffer,
//     then one generated elementwise or rows kernel (codegen.h; column sums included) over the
//     rest of the body, which reads the product as one more input: one extra pass over the
//     product instead of the per-op cuda-body fallback.
// `why` says why not.
bool gemm_epilogue_supported(const Graph& body, std::string* why = nullptr);
bool gemm_split_supported(const Graph& body, std::string* why = nullptr);
// What the nvrtc dialect's supports() decides for a fused node of `kind` with `body` (needs no
// GPU); `why` says why not. A node it refuses runs on the cuda-body fallback.
bool nvrtc_supports(const Graph& body, FusedKind kind, std::string* why = nullptr);
// What `kiln compile --dump-kernels` writes for a fused node of `kind`: the generated source, a
// comment naming the cuBLASLt product for "gemm-epilogue" bodies (followed by the generated
// epilogue kernel for a product + generated epilogue), or a comment saying why the body is not
// generated (it then runs on a lower-priority dialect): `grep -l "not generated" DIR/*` lists
// the refused nodes. Needs no GPU.
std::string fused_kernel_listing(const Graph& body, FusedKind kind);
// Whether case 1 takes a bias in the product's 16-bit dtype on a product cast to f32 (GPT-2's
// residual projections under amp, x + f32(y W + b): then one product, D (f32) = y W + b + x).
// Off by default: cuBLASLt refused the 16-bit bias on an f32 D on the H100 (CUDA 13), so the
// product widens the bias to f32 first (a cast of n elements, cuda::GemmPlan::widens_bias), a path
// no GPU has run yet; off, such bodies run as case 2. The environment variable
// KILN_MIXED_BIAS_GEMM=1 turns it on; this overrides it.
bool mixed_bias_gemm();
void set_mixed_bias_gemm(bool on);
// A one-line description of the Gemm a body of case 1 binds to ("gemm (m 64, n 128, k 32) ...",
// ending in " + c (beta 1)" when the product adds a C input).
std::string describe_gemm_epilogue(const Graph& body);

}  // namespace kiln::cuda
