#include "device/communicator.h"

#include "support/error.h"

namespace kiln {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

ReduceOp parse_reduce_op(std::string_view name) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax})
    if (reduce_op_name(op) == name) return op;
  fail("unknown reduction '{}' (expected sum, avg or max)", name);
}

}  // namespace kiln
