#include "passes/sharding.h"

#include <algorithm>
#include <map>

#include "ops/collective.h"
#include "passes/uses.h"
#include "support/error.h"

namespace kiln {

std::string_view shard_mode_name(ShardMode mode) {
  switch (mode) {
    case ShardMode::kNone: return "none";
    case ShardMode::kDp: return "dp";
    case ShardMode::kZero1: return "zero1";
    case ShardMode::kZero2: return "zero2";
    case ShardMode::kZero3: return "zero3";
  }
  return "?";
}

ShardMode parse_shard_mode(std::string_view name) {
  for (ShardMode m : {ShardMode::kNone, ShardMode::kDp, ShardMode::kZero1, ShardMode::kZero2, ShardMode::kZero3})
    if (shard_mode_name(m) == name) return m;
  fail("unknown shard mode '{}' (expected none, dp, zero1, zero2 or zero3)", name);
}

void validate(const ShardingOptions& options) {
  KILN_CHECK(options.world_size >= 1, "world size must be >= 1, got {}", options.world_size);
}

ParamShard param_shard(const TensorType& full, int world_size) {
  ParamShard s;
  s.full = full;
  s.world_size = world_size;
  s.shard_numel = (full.numel() + world_size - 1) / world_size;
  return s;
}

namespace {

// x flattened and zero-padded to `padded` elements.
Expr flat_padded(const Expr& x, int64_t padded) {
  Expr flat = reshape(x, {x.type().numel()});
  const int64_t pad = padded - x.type().numel();
  if (pad == 0) return flat;
  return concat({flat, x.builder().full({pad}, 0.0, x.dtype())});
}

// The full-shape value of a flat padded tensor.
Expr unpadded(const Expr& flat, const TensorType& full) {
  Expr x = flat;
  if (flat.type().numel() != full.numel()) x = slice_axis(x, 0, 0, full.numel());
  return reshape(x, full.shape);
}

}  // namespace

void move_nodes_before(Graph& graph, size_t first_new, size_t position) {
  KILN_CHECK(first_new <= graph.nodes.size() && position <= first_new, "internal: bad node move");
  std::rotate(graph.nodes.begin() + static_cast<std::ptrdiff_t>(position),
              graph.nodes.begin() + static_cast<std::ptrdiff_t>(first_new), graph.nodes.end());
}

std::vector<std::vector<ValueId>> gather_sharded_params(Graph& forward, int world_size) {
  std::vector<int> param_inputs;
  for (size_t i = 0; i < forward.inputs.size(); ++i)
    if (forward.inputs[i].role == Role::kParam) param_inputs.push_back(static_cast<int>(i));
  // A node is named by its first output (indices move as chains are inserted).
  auto index_of = [&](ValueId first_output) {
    for (size_t n = 0; n < forward.nodes.size(); ++n)
      if (forward.nodes[n].outputs[0] == first_output) return n;
    fail("internal: zero3 lost a node");
  };
  std::vector<std::vector<ValueId>> gathered(param_inputs.size());
  for (size_t p = 0; p < param_inputs.size(); ++p) {
    const ValueId param = forward.inputs[static_cast<size_t>(param_inputs[p])].value;
    const TensorType full = forward.type(param);
    KILN_CHECK(full.dtype == DType::kF32, "zero3 shards f32 params; '{}' is {}", forward.value(param).name,
               to_string(full));
    const ParamShard where = param_shard(full, world_size);
    // Readers by what they want: a 16-bit cast of the param (mixed precision), or the f32 value.
    const Uses uses(forward);
    KILN_CHECK(!uses.escapes[static_cast<size_t>(param)],
               "zero3: param '{}' is a graph output or update value of the forward graph", forward.value(param).name);
    std::map<DType, std::vector<ValueId>> readers;  // kF32: readers of the param itself
    for (int n : uses.readers[static_cast<size_t>(param)]) {
      const Node& node = forward.nodes[static_cast<size_t>(n)];
      const DType to = node.op == Op::kCast ? forward.type(node.outputs[0]).dtype : DType::kF32;
      const bool low_cast = node.op == Op::kCast && is_float(to) && to != DType::kF32 && !uses.escapes[node.outputs[0]];
      std::vector<ValueId>& group = readers[low_cast ? to : DType::kF32];
      if (std::find(group.begin(), group.end(), node.outputs[0]) == group.end()) group.push_back(node.outputs[0]);
    }
    // The input becomes the shard; its readers are rewired below (value ids stay).
    forward.values[static_cast<size_t>(param)].type = TensorType{DType::kF32, {where.shard_numel}};
    for (const auto& [dtype, group] : readers) {
      size_t position = forward.nodes.size();
      for (ValueId r : group) position = std::min(position, index_of(r));
      const size_t first_new = forward.nodes.size();
      Builder b(std::move(forward));
      Expr shard = b.wrap(param);
      if (dtype != DType::kF32) shard = cast(shard, dtype);
      const ValueId full_value = unpadded(all_gather(shard, world_size), TensorType{dtype, full.shape}).id();
      forward = b.take();
      move_nodes_before(forward, first_new, position);
      // A direct reader now reads the gathered f32; a cast reader's readers read the gathered
      // 16-bit value (the cast is left dead for dead-code elimination).
      for (Node& node : forward.nodes) {
        if (node.outputs[0] == full_value) continue;
        const bool direct_reader = dtype == DType::kF32 && std::find(group.begin(), group.end(), node.outputs[0]) != group.end();
        for (ValueId& in : node.inputs)
          if ((dtype == DType::kF32 && direct_reader && in == param) ||
              (dtype != DType::kF32 && std::find(group.begin(), group.end(), in) != group.end()))
            in = full_value;
      }
      gathered[p].push_back(full_value);
      // The casts of the whole param are dead now, and no longer type-check against the shard.
      if (dtype != DType::kF32)
        std::erase_if(forward.nodes, [&](const Node& node) {
          return std::find(group.begin(), group.end(), node.outputs[0]) != group.end();
        });
    }
  }
  return gathered;
}

void regather_for_backward(Graph& graph, size_t forward_nodes) {
  const Uses uses(graph);
  // A gathered value is the end of a chain: [cast] -> all_gather -> collective_wait -> [slice] ->
  // reshape, rooted at a param input. Walk each all_gather of a forward node down its chain.
  struct Found {
    std::vector<int> chain;  // node indices, producer first
    ValueId value;           // the chain's last value
  };
  std::vector<Found> chains;
  for (size_t n = 0; n < forward_nodes; ++n) {
    if (graph.nodes[n].op != Op::kAllGather) continue;
    Found f;
    const ValueId source = graph.nodes[n].inputs[0];
    const int cast_node = uses.producer[static_cast<size_t>(source)];
    if (cast_node >= 0) {
      const Node& c = graph.nodes[static_cast<size_t>(cast_node)];
      if (c.op != Op::kCast || graph.input_index(c.inputs[0]) < 0) continue;  // not a param's gather
      f.chain.push_back(cast_node);
    } else if (graph.input_index(source) < 0 || graph.inputs[static_cast<size_t>(graph.input_index(source))].role != Role::kParam) {
      continue;
    }
    int at = static_cast<int>(n);
    f.chain.push_back(at);
    // Follow single readers through wait, slice and reshape.
    for (;;) {
      const ValueId out = graph.nodes[static_cast<size_t>(at)].outputs[0];
      const auto& readers = uses.readers[static_cast<size_t>(out)];
      if (readers.size() != 1) break;
      const Op op = graph.nodes[static_cast<size_t>(readers[0])].op;
      if (op != Op::kCollectiveWait && op != Op::kSlice && op != Op::kReshape) break;
      at = readers[0];
      f.chain.push_back(at);
      if (op == Op::kReshape) break;
    }
    f.value = graph.nodes[static_cast<size_t>(at)].outputs[0];
    chains.push_back(std::move(f));
  }
  for (const Found& f : chains) {
    std::vector<int> backward_readers;
    const Uses now(graph);
    for (int r : now.readers[static_cast<size_t>(f.value)])
      if (static_cast<size_t>(r) >= forward_nodes) backward_readers.push_back(r);
    if (backward_readers.empty()) continue;
    std::sort(backward_readers.begin(), backward_readers.end());
    backward_readers.erase(std::unique(backward_readers.begin(), backward_readers.end()), backward_readers.end());
    // The chain again, its first input the same shard (or its cast's input), appended then moved.
    const size_t first_new = graph.nodes.size();
    std::map<ValueId, ValueId> renamed;
    for (int c : f.chain) {
      Node copy = graph.nodes[static_cast<size_t>(c)];
      for (ValueId& in : copy.inputs)
        if (renamed.count(in)) in = renamed[in];
      std::vector<ValueId> outs = graph.add_node(copy.op, copy.inputs, copy.attrs);
      for (size_t i = 0; i < outs.size(); ++i) renamed[copy.outputs[i]] = outs[i];
    }
    const ValueId again = renamed.at(f.value);
    const size_t position = static_cast<size_t>(backward_readers.front());
    move_nodes_before(graph, first_new, position);
    const size_t moved = graph.nodes.size() - first_new;
    for (int r : backward_readers)
      for (ValueId& in : graph.nodes[static_cast<size_t>(r) + moved].inputs)
        if (in == f.value) in = again;
    // Later chains' node indices past `position` moved too; forward nodes (before it) did not,
    // and the readers are found afresh per chain.
  }
}

Expr reduce_gradient(const Expr& full_grad, const ShardingOptions& options) {
  const int world = options.world_size;
  Expr g = full_grad.dtype() == DType::kF32 ? full_grad : cast(full_grad, DType::kF32);
  switch (options.mode) {
    case ShardMode::kNone: return g;
    case ShardMode::kDp: return all_reduce(g, world, ReduceOp::kAvg);
    case ShardMode::kZero1: return shard_of(all_reduce(g, world, ReduceOp::kAvg), world);
    case ShardMode::kZero2:
    case ShardMode::kZero3: {
      const ParamShard where = param_shard(g.type(), world);
      return reduce_scatter(flat_padded(g, where.padded_numel()), world, ReduceOp::kAvg);
    }
  }
  return g;
}

Expr shard_of(const Expr& full, int world_size) {
  const ParamShard where = param_shard(full.type(), world_size);
  return local_shard(flat_padded(full, where.padded_numel()), world_size);
}

Expr unshard(const Expr& shard, const ParamShard& where) {
  return unpadded(all_gather(shard, where.world_size), TensorType{shard.dtype(), where.full.shape});
}

Expr sum_over_ranks(const Expr& partial, int world_size) { return all_reduce(partial, world_size, ReduceOp::kSum); }

}  // namespace kiln
