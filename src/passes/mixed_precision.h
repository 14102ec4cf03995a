// Pass "mixed-precision": runs the heavy ops of a FORWARD graph in a 16-bit float dtype (bf16 or
// f16) and keeps the numerically delicate ones in f32, by inserting casts.
//
// Why on the forward graph, before autodiff: autodiff then differentiates through the casts
// (cast's gradient casts back), so the backward of a low-precision matmul is itself a
// low-precision matmul, and every gradient comes back in its param's dtype (f32 master weights)
// with no extra rule. It is therefore a plain Pass that build_training_graph applies to the
// forward graph (compile/training_graph.h), not part of the default pipeline, which sees the joint
// training graph (where the optimizer state must stay f32 and the casts already exist).
//
// A policy table says, per op, how it runs (std::map<Op, Precision>; an op not in the table
// follows its inputs; users can override any entry). The default comes from the op table
// (OpTraits::precision, ir/op_def.h):
//   kLow:    float inputs are cast to the low dtype; the output is low. Default: matmul,
//            attention, conv2d (the ops tensor cores serve, where almost all the FLOPs are).
//   kF32:    16-bit float inputs are cast up to f32. Default: reductions (sum, mean, max,
//            argmax), softmax, log_softmax, layer_norm, rms_norm (statistics over many elements
//            lose the most in 16 bits) and cross_entropy (the loss).
//   kFollow: the op runs in the dtype of its inputs; when its float inputs differ they are all
//            cast to the widest of them (numpy/torch type promotion). Elementwise, shape and
//            every other op. One exception: a linear layer's bias, add(low matmul, 1-D bias),
//            adds in the low dtype (the bias is cast down), as torch.autocast's linear does.
// Casts are made once per (value, dtype) and reused, and only values of the input graph are
// cast, so no cast of a cast appears: a bf16 matmul output read by a softmax (cast up) and by
// the next matmul gives that matmul the bf16 value itself. Params and other graph inputs keep
// their types (f32 master weights, cast down at their low-precision uses).
//
// Expects: a verified graph. Guarantees: a verified graph with the same inputs, and graph outputs
// and update values of their original types and names (an output that became low, e.g. GPT's
// logits, is cast back), so callers and the loss (f32) are unaffected. Value names are kept;
// a cast of a named value is named "<name>.<dtype>" when that name is free.
#pragma once

#include <map>
#include <string>

#include "ir/dtype.h"
#include "ir/op_def.h"
#include "passes/pass.h"

namespace kiln {

using PrecisionPolicy = std::map<Op, Precision>;

// The default table described above: each op's OpTraits::precision other than kFollow.
PrecisionPolicy default_precision_policy();

struct MixedPrecisionOptions {
  DType low = DType::kBF16;  // kBF16 or kF16
  PrecisionPolicy policy = default_precision_policy();
};

class MixedPrecisionPass : public Pass {
 public:
  // Throws kiln::Error if options.low is not bf16 or f16.
  explicit MixedPrecisionPass(MixedPrecisionOptions options = {});
  std::string name() const override { return "mixed-precision"; }
  bool run(Graph& graph) override;

 private:
  MixedPrecisionOptions options_;
};

}  // namespace kiln
