// offload and reload: a value copied to host memory and back (passes/offload.h moves optimizer
// state off the device with them). Both are plain copies of the same type; where the bytes live
// is the executor's business: a graph input read only by reload nodes is host-resident (pinned
// memory the caller allocates), and an offload's output is the update value of such an input,
// written straight into it. Inserted after autodiff, so they have no gradient.
#include <cstring>

#include "ops/registry.h"
#include "tensor/tensor.h"

namespace kiln::ops {

void define_transfer_ops(OpRegistry& registry) {
  for (Op op : {Op::kOffload, Op::kReload})
    registry.define(op, OpDef{
        {},
        [](std::span<const TensorType> in, const Attributes&) { return std::vector<TensorType>{in[0]}; },
        [](const KernelArgs& k) {
          if (k.inputs[0].raw() != k.outputs[0].raw())
            std::memcpy(k.outputs[0].raw(), k.inputs[0].raw(), k.outputs[0].bytes());
        },
        nullptr, false});
}

}  // namespace kiln::ops
