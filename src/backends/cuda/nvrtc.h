// The "nvrtc" dialect's back half: compiles generated kernels (codegen.h) with NVRTC, loads them
// with the runtime's library API and launches them on the kernel's stream; and binds "gemm-epilogue" fused
// nodes to cuda::Gemm with the matching cuBLASLt epilogue (cublaslt.h).
//
// Compilation needs no GPU (NVRTC is a host library): nvrtc_compile() works on a machine without
// one, which is how CI catches syntax errors in generated code. Loading and launching need one.
// Compiled images are cached by source text (one compile per distinct body, thread-safe; two
// threads asking for the same new source compile it once); modules are loaded once per device.
#pragma once

#include <nvrtc.h>

#include <cstddef>
#include <string>

#include "backends/cuda/codegen.h"
#include "ir/op_def.h"
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
// kiln::Error with NVRTC's log and the source line it names. Uncached.
std::string nvrtc_compile(const std::string& source, const std::string& arch);

// Launches `kernel` on args.stream with the node's tensors (device pointers): compiles it on
// first use (cached by source), loads it on the current device, picks the vectorized entry when
// every pointer is aligned for it.
void launch_generated(const GeneratedKernel& kernel, const KernelArgs& args);
// Distinct sources compiled so far (for tests).
size_t nvrtc_cache_size();

// GEMM-epilogue bodies: whether `body` is matmul (+ bias add) (+ gelu tanh, with or without the
// pre-activation as a second output), gelu_grad{tanh}(aux, matmul) (+ its bias gradient, a sum
// over rows), or matmul with the bias gradient of one operand; `why` says why not.
bool gemm_epilogue_supported(const Graph& body, std::string* why = nullptr);
// What `kiln compile --dump-kernels` writes for a fused node of `kind`: the generated source, a
// comment naming the cuBLASLt product for "gemm-epilogue" bodies, or a comment saying why the
// body is not generated (it then runs on a lower-priority dialect). Needs no GPU.
std::string fused_kernel_listing(const Graph& body, const std::string& kind);
// A one-line description of the Gemm a supported body binds to ("m 64 n 128 k 32 bf16 gelu_bias").
std::string describe_gemm_epilogue(const Graph& body);

}  // namespace kiln::cuda
