// align-matmul: a product with many output columns, but not a multiple of 8 of them (a vocabulary
// of 30522 or 50257 words), computed over its columns padded with zeros to the next multiple of 8.
//
// cuBLASLt's fast Hopper kernels want every matrix's rows to start 16-byte aligned (8 bf16
// elements); an output of N columns with N % 8 != 0 gets an sm80-era fallback kernel instead,
// for the product and both of its gradients: BERT-base's masked-LM head (8192 x 768 x 30522, H200,
// bf16) ran 1.5-1.6 ms per GEMM where the aligned product takes about 0.6. So
//   y = matmul(x, w)  ->  y = slice(matmul(x, concat(w, zeros)), last axis [0, N))
// with w's N axis (its last, or its second to last under transpose_b) padded to a multiple of 8:
// the product writes the padded rows, the slice and its gradient (a zero pad) copy the logits
// once each way, and the weight gradient comes back as the first N rows of the padded one.
// Padded columns are exact zeros, so y is bit-for-bit what it was.
//
// Why before autodiff (the forward pipeline): the backward then follows from the rules of slice,
// concat and matmul. CUDA only (pipeline.cc): the CPU's kernels have no alignment cliff, and the
// copies would only cost. Only from 1024 columns: a narrow head's GEMM is cheap either way.
#pragma once

#include "passes/pass.h"

namespace kiln {

inline constexpr int64_t kAlignMatmulMinColumns = 1024;

class AlignMatmul : public Pass {
 public:
  std::string name() const override { return "align-matmul"; }
  bool run(Graph& graph) override;
  std::vector<std::string> notes() const override;

 private:
  int padded_ = 0;
};

}  // namespace kiln
