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

void place_appended(Graph& graph, size_t original, const std::vector<AppendedRange>& ranges) {
  // Bucket the ranges by position, keeping their order (a stable pass over them).
  std::vector<std::vector<const AppendedRange*>> before(original + 1);
  size_t appended = 0;
  for (const AppendedRange& r : ranges) {
    KILN_CHECK(r.position <= original && original <= r.first && r.first <= r.end && r.end <= graph.nodes.size(),
               "internal: bad node placement");
    before[r.position].push_back(&r);
    appended += r.end - r.first;
  }
  KILN_CHECK(appended == graph.nodes.size() - original, "internal: appended nodes left unplaced");
  std::vector<Node> nodes;
  nodes.reserve(graph.nodes.size());
  for (size_t n = 0; n <= original; ++n) {
    for (const AppendedRange* r : before[n])
      for (size_t i = r->first; i < r->end; ++i) nodes.push_back(std::move(graph.nodes[i]));
    if (n < original) nodes.push_back(std::move(graph.nodes[n]));
  }
  graph.nodes = std::move(nodes);
}

std::vector<std::vector<ValueId>> gather_sharded_params(Graph& forward, int world_size) {
  // One pass: the readers are found once, every chain is appended, every reader rewired by a
  // table, and the chains placed before their first readers in one reordering (per param
  // lookups and moves made this quadratic: seconds at a hundred layers).
  const Uses uses(forward);
  const size_t original = forward.nodes.size();
  std::vector<AppendedRange> ranges;
  std::vector<char> dead_cast(original, 0);
  std::map<ValueId, ValueId> cast_replaced;              // a 16-bit cast of a param -> its gathered value
  std::map<std::pair<int, ValueId>, ValueId> direct;     // (reader node, param) -> the gathered f32 value
  std::vector<std::vector<ValueId>> gathered;
  for (size_t i = 0; i < forward.inputs.size(); ++i) {
    if (forward.inputs[i].role != Role::kParam) continue;
    const ValueId param = forward.inputs[i].value;
    gathered.emplace_back();
    const TensorType full = forward.type(param);
    KILN_CHECK(full.dtype == DType::kF32, "zero3 shards f32 params; '{}' is {}", forward.value(param).name,
               to_string(full));
    const ParamShard where = param_shard(full, world_size);
    KILN_CHECK(!uses.escapes[static_cast<size_t>(param)],
               "zero3: param '{}' is a graph output or update value of the forward graph", forward.value(param).name);
    // Readers by what they want: a 16-bit cast of the param (mixed precision), or the f32 value.
    std::map<DType, std::vector<int>> readers;  // kF32: readers of the param itself
    for (int n : uses.readers[static_cast<size_t>(param)]) {
      const Node& node = forward.nodes[static_cast<size_t>(n)];
      const DType to = node.op == Op::kCast ? forward.type(node.outputs[0]).dtype : DType::kF32;
      const bool low_cast = node.op == Op::kCast && is_float(to) && to != DType::kF32 && !uses.escapes[node.outputs[0]];
      std::vector<int>& group = readers[low_cast ? to : DType::kF32];
      if (std::find(group.begin(), group.end(), n) == group.end()) group.push_back(n);
    }
    // The input becomes the shard (value ids stay).
    forward.values[static_cast<size_t>(param)].type = TensorType{DType::kF32, {where.shard_numel}};
    for (const auto& [dtype, group] : readers) {
      const size_t first_new = forward.nodes.size();
      Builder b(std::move(forward));
      Expr shard = b.wrap(param);
      if (dtype != DType::kF32) shard = cast(shard, dtype);
      const ValueId full_value = unpadded(all_gather(shard, world_size), TensorType{dtype, full.shape}).id();
      forward = b.take();
      ranges.push_back({first_new, forward.nodes.size(), static_cast<size_t>(*std::min_element(group.begin(), group.end()))});
      gathered.back().push_back(full_value);
      // A direct reader now reads the gathered f32; a cast reader's readers read the gathered
      // 16-bit value (the cast, which no longer type-checks against the shard, is dropped).
      for (int n : group) {
        if (dtype == DType::kF32) {
          direct[{n, param}] = full_value;
        } else {
          cast_replaced[forward.nodes[static_cast<size_t>(n)].outputs[0]] = full_value;
          dead_cast[static_cast<size_t>(n)] = 1;
        }
      }
    }
  }
  for (size_t n = 0; n < original; ++n)
    for (ValueId& in : forward.nodes[n].inputs) {
      if (auto it = direct.find({static_cast<int>(n), in}); it != direct.end()) in = it->second;
      else if (auto c = cast_replaced.find(in); c != cast_replaced.end()) in = c->second;
    }
  place_appended(forward, original, ranges);
  std::erase_if(forward.nodes, [&](const Node& node) {
    return node.outputs.size() == 1 && cast_replaced.count(node.outputs[0]) != 0;
  });
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
  // Each chain again, its first input the same shard (or its cast's input), appended; its
  // backward readers rewired; then all placed before their first backward readers at once.
  const size_t original = graph.nodes.size();
  std::vector<AppendedRange> ranges;
  for (const Found& f : chains) {
    std::vector<int> backward_readers;
    for (int r : uses.readers[static_cast<size_t>(f.value)])
      if (static_cast<size_t>(r) >= forward_nodes) backward_readers.push_back(r);
    if (backward_readers.empty()) continue;
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
    for (int r : backward_readers)
      for (ValueId& in : graph.nodes[static_cast<size_t>(r)].inputs)
        if (in == f.value) in = again;
    ranges.push_back({first_new, graph.nodes.size(),
                      static_cast<size_t>(*std::min_element(backward_readers.begin(), backward_readers.end()))});
  }
  place_appended(graph, original, ranges);
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
