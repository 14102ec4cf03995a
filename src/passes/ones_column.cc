#include "passes/ones_column.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "ir/op_def.h"
#include "ops/fused/group.h"
#include "passes/fusion/fusion.h"
#include "passes/simplify/compact.h"
#include "passes/uses.h"
#include "support/error.h"

namespace kiln {
namespace {

// The value whose bytes `id` is, looking through reshapes.
ValueId reshape_root(const Graph& graph, const Uses& uses, ValueId id) {
  for (;;) {
    const int p = uses.producer[id];
    if (p < 0 || graph.nodes[p].op != Op::kReshape) return id;
    id = graph.nodes[p].inputs[0];
  }
}

// D: matmul(a, b) {transpose_a}, alone (f32 training) or as the body matmul(in0, in1)
// {transpose_a} [-> cast f32] with one output (mixed precision).
bool is_transposed_a_product(const Node& mm) {
  return mm.op == Op::kMatmul && mm.attrs.b("transpose_a") && !mm.attrs.b("transpose_b");
}
bool is_weight_gradient(const Node& node) {
  if (is_transposed_a_product(node)) return true;
  if (!is_fused(node, FusedKind::kGemmEpilogue)) return false;
  const Graph& body = *node.body;
  if (body.inputs.size() != 2 || body.outputs.size() != 1) return false;
  if (body.nodes.empty() || body.nodes.size() > 2) return false;
  const Node& mm = body.nodes[0];
  if (!is_transposed_a_product(mm)) return false;
  if (mm.inputs[0] != body.inputs[0].value || mm.inputs[1] != body.inputs[1].value) return false;
  if (body.nodes.size() == 1) return body.outputs[0] == mm.outputs[0];
  const Node& cast = body.nodes[1];
  return cast.op == Op::kCast && cast.inputs[0] == mm.outputs[0] &&
         cast.attrs.dtype("dtype") == DType::kF32 && body.outputs[0] == cast.outputs[0];
}

// Whether `node` sums over every axis but the last, without keepdims.
bool is_column_sum(const Graph& graph, const Node& node) {
  if (node.op != Op::kSum || node.attrs.b("keepdims")) return false;
  const int rank = graph.type(node.inputs[0]).rank();
  const std::vector<int64_t>& axes = node.attrs.ints("axes");
  if (rank < 2 || static_cast<int>(axes.size()) != rank - 1) return false;
  std::vector<bool> hit(static_cast<size_t>(rank), false);
  for (int64_t a : axes) hit[static_cast<size_t>(normalize_axis(a, rank))] = true;
  return std::count(hit.begin(), hit.end(), true) == rank - 1 && !hit.back();
}

// F: the body's one matmul reads body input `input` as its untransposed A, and nothing else
// in the body reads it.
bool reads_as_a(const Node& node, size_t input) {
  if (!is_fused(node, FusedKind::kGemmEpilogue)) return false;
  const Graph& body = *node.body;
  const std::optional<GroupBody> group = match_group_body(FusedKind::kGemmEpilogue, body);
  if (!group) return false;
  const Node& mm = body.nodes[static_cast<size_t>(group->matmul)];
  const ValueId in = body.inputs[input].value;
  int reads = 0;
  for (const Node& n : body.nodes)
    reads += static_cast<int>(std::count(n.inputs.begin(), n.inputs.end(), in));
  for (ValueId out : body.outputs) reads += out == in;
  return mm.inputs[0] == in && mm.inputs[1] != in && !mm.attrs.b("transpose_a") && reads == 1;
}

// A lone row op (an f32 LayerNorm, which fusion left alone): outlined as a "rows" node of one
// op, so that its generated kernel can store padded rows.
bool lone_row_op(const Graph& graph, const Node& node) {
  return node.op != Op::kFused && node.outputs.size() == 1 &&
         fusion::classify_node(graph, node).kind == fusion::ItemKind::kRowOp;
}
void outline_alone(Graph& graph, size_t n) {
  Node& node = graph.nodes[n];
  auto body = std::make_shared<Graph>();
  body->name = fmt::format("ones_column_{}", n);
  std::vector<ValueId> inputs;
  for (size_t k = 0; k < node.inputs.size(); ++k)
    inputs.push_back(body->add_input(fmt::format("in{}", k), graph.type(node.inputs[k]), Role::kData));
  body->outputs = body->add_node(node.op, inputs, node.attrs);
  node.op = Op::kFused;
  node.attrs = fused_attrs(FusedKind::kRows);
  node.body = std::move(body);
}

// P: a body with a row op (so its kernel is a generated rows kernel, which stores padded rows)
// computing body output `output`, which no other output slot repeats.
bool writes_padded(const Node& node, size_t output) {
  if (!is_fused(node, FusedKind::kRows) && !is_fused(node, FusedKind::kGemmEpilogue)) return false;
  const Graph& body = *node.body;
  const ValueId x = body.outputs[output];
  if (body.input_index(x) >= 0) return false;
  if (std::count(body.outputs.begin(), body.outputs.end(), x) != 1) return false;
  const std::optional<GroupBody> group = match_group_body(fused_kind(node), body);
  return group && group->row_ops > 0;
}

// One weight gradient D to rewrite: its reshape of X, and the bias gradient to replace.
struct Gradient {
  int d = -1;         // node D
  int reshape = -1;   // reshape(X) -> (M, K), read by D alone
  std::vector<int> dead;  // S and its cast
  ValueId bias = -1;  // the old bias gradient (S's value, or its cast's)
};

std::optional<Gradient> match_gradient(const Graph& graph, const Uses& uses, int reshape) {
  const Node& r = graph.nodes[reshape];
  const ValueId a = r.outputs[0];
  if (!uses.single(a)) return std::nullopt;
  const int d = uses.readers[a][0];
  const Node& dn = graph.nodes[d];
  if (!is_weight_gradient(dn) || dn.inputs[0] != a) return std::nullopt;
  const TensorType& at = graph.type(a);
  const TensorType& xt = graph.type(r.inputs[0]);
  if (at.rank() != 2 || xt.rank() < 1 || at.shape[1] != xt.shape.back()) return std::nullopt;
  const ValueId b = dn.inputs[1];
  const int64_t n = graph.type(b).shape.back();
  const DType out_dtype = graph.type(dn.outputs[0]).dtype;
  const ValueId root = reshape_root(graph, uses, b);
  // S: a column sum of a value with dY's bytes, rows of N.
  for (size_t s = 0; s < graph.nodes.size(); ++s) {
    const Node& sum = graph.nodes[s];
    if (!is_column_sum(graph, sum) || reshape_root(graph, uses, sum.inputs[0]) != root) continue;
    const TensorType& st = graph.type(sum.inputs[0]);
    if (st.shape.back() != n || st.bytes() != graph.type(b).bytes()) continue;
    Gradient g;
    g.d = d;
    g.reshape = reshape;
    g.dead = {static_cast<int>(s)};
    g.bias = sum.outputs[0];
    if (graph.type(g.bias).dtype != out_dtype) {
      if (!uses.single(g.bias)) return std::nullopt;
      const int c = uses.readers[g.bias][0];
      const Node& cast = graph.nodes[c];
      if (cast.op != Op::kCast || cast.attrs.dtype("dtype") != out_dtype) return std::nullopt;
      g.dead.push_back(c);
      g.bias = cast.outputs[0];
    }
    for (int reader : uses.readers[g.bias])
      if (reader <= d) return std::nullopt;
    return g;
  }
  return std::nullopt;
}

std::vector<int64_t> zeros_like(const Shape& s) { return std::vector<int64_t>(s.size(), 0); }

// A copy of `body` for editing.
std::shared_ptr<Graph> copy_body(const Node& node) { return std::make_shared<Graph>(*node.body); }

}  // namespace

int64_t ones_column_pad(int64_t k, DType dtype) {
  const int64_t size = static_cast<int64_t>(dtype_size(dtype));
  int64_t p = 1;
  while ((k + p) * size % 16 != 0) ++p;
  return p;
}

bool OnesColumnPass::run(Graph& graph) {
  const Uses uses(graph);
  // Nodes to put right after a node, uses to redirect (in the original nodes, the outputs and
  // the updates only: the new nodes read the old values on purpose), nodes to drop.
  std::map<int, std::vector<Node>> after;
  std::map<ValueId, ValueId> redirect;
  std::set<int> dropped;
  bool changed = false;

  for (size_t p = 0; p < graph.nodes.size(); ++p) {
    for (size_t o = 0; o < graph.nodes[p].outputs.size(); ++o) {
      const ValueId x = graph.nodes[p].outputs[o];
      const TensorType xt = graph.type(x);
      const bool alone = lone_row_op(graph, graph.nodes[p]);
      if (uses.escapes[x] || xt.rank() < 1 || (!alone && !writes_padded(graph.nodes[p], o)))
        continue;
      // Every reader an F or the reshape of a D.
      std::vector<std::pair<int, size_t>> forward;  // (F, its input slot)
      std::vector<Gradient> gradients;
      bool ok = !uses.readers[x].empty();
      for (int reader : uses.readers[x]) {
        const Node& rn = graph.nodes[reader];
        if (rn.op == Op::kReshape) {
          std::optional<Gradient> g = match_gradient(graph, uses, reader);
          ok = ok && g.has_value();
          if (g) gradients.push_back(*g);
          continue;
        }
        const auto slot = static_cast<size_t>(
            std::find(rn.inputs.begin(), rn.inputs.end(), x) - rn.inputs.begin());
        ok = ok && reads_as_a(rn, slot);
        forward.emplace_back(reader, slot);
      }
      if (!ok || gradients.empty()) continue;
      changed = true;
      const int64_t k = xt.shape.back();
      const int64_t pad = ones_column_pad(k, xt.dtype);
      Shape padded_shape = xt.shape;
      padded_shape.back() = k + pad;
      const TensorType padded{xt.dtype, padded_shape};

      // P writes X' = concat(X, ones).
      if (alone) outline_alone(graph, p);
      {
        Node& pn = graph.nodes[p];
        std::shared_ptr<Graph> body = copy_body(pn);
        Shape ones_shape = xt.shape;
        ones_shape.back() = pad;
        const ValueId ones = body->add(
            Op::kFull, {}, {{"dtype", xt.dtype}, {"shape", ones_shape}, {"value", 1.0}});
        body->outputs[o] = body->add(Op::kConcat, {body->outputs[o], ones}, {{"axis", int64_t{-1}}});
        pn.body = std::move(body);
        graph.values[x].type = padded;
      }
      // F reads x[..., :K] of X'.
      for (const auto& [f, slot] : forward) {
        Node& fn = graph.nodes[f];
        std::shared_ptr<Graph> body = copy_body(fn);
        const ValueId in = body->inputs[slot].value;
        body->values[in].type = padded;
        Shape ends = padded_shape;
        ends.back() = k;
        const ValueId sliced = body->add(
            Op::kSlice, {in}, {{"starts", zeros_like(padded_shape)}, {"ends", ends}});
        Node slice = std::move(body->nodes.back());
        body->nodes.pop_back();
        for (Node& n : body->nodes)
          for (ValueId& id : n.inputs)
            if (id == in) id = sliced;
        body->nodes.insert(body->nodes.begin(), std::move(slice));
        fn.body = std::move(body);
      }
      // Each D multiplies reshape(X') and hands out dW and db as slices of its product.
      for (const Gradient& g : gradients) {
        Node& r = graph.nodes[g.reshape];
        const int64_t m = graph.type(r.outputs[0]).shape[0];
        r.attrs.set("shape", std::vector<int64_t>{m, k + pad});
        graph.values[r.outputs[0]].type = TensorType{xt.dtype, {m, k + pad}};

        Node& dn = graph.nodes[g.d];
        const ValueId old_dw = dn.outputs[0];
        const TensorType dwt = graph.type(old_dw);
        const int64_t n = dwt.shape[1];
        const Shape product{k + pad, n};
        if (dn.op == Op::kFused) {
          std::shared_ptr<Graph> body = copy_body(dn);
          body->values[body->inputs[0].value].type = graph.type(r.outputs[0]);
          for (Node& bn : body->nodes) body->values[bn.outputs[0]].type.shape = product;
          dn.body = std::move(body);
        }
        // The product takes D's output value (its readers are redirected to dW below).
        graph.values[old_dw].type = TensorType{dwt.dtype, product};
        std::vector<Node>& tail = after[g.d];
        auto emit = [&](Op op, std::vector<ValueId> in, Attributes attrs) {
          const ValueId out = graph.add(op, std::move(in), std::move(attrs));
          tail.push_back(std::move(graph.nodes.back()));
          graph.nodes.pop_back();
          return out;
        };
        const ValueId dw = emit(Op::kSlice, {old_dw},
                                {{"starts", std::vector<int64_t>{0, 0}},
                                 {"ends", std::vector<int64_t>{k, n}}});
        const ValueId row = emit(Op::kSlice, {old_dw},
                                 {{"starts", std::vector<int64_t>{k, 0}},
                                  {"ends", std::vector<int64_t>{k + 1, n}}});
        const ValueId db = emit(Op::kReshape, {row}, {{"shape", std::vector<int64_t>{n}}});
        KILN_CHECK(graph.type(db) == graph.type(g.bias),
                   "ones-column: the bias gradient would change type from {} to {}",
                   to_string(graph.type(g.bias)), to_string(graph.type(db)));
        redirect[old_dw] = dw;
        redirect[g.bias] = db;
        dropped.insert(g.dead.begin(), g.dead.end());
      }
    }
  }
  if (!changed) return false;

  // Rebuild the node list: drop S and its cast, put each D's slices right after it, and
  // redirect the old gradients' readers (original nodes only).
  auto redirected = [&](ValueId id) {
    const auto it = redirect.find(id);
    return it == redirect.end() ? id : it->second;
  };
  std::vector<Node> nodes;
  nodes.reserve(graph.nodes.size());
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    if (dropped.count(static_cast<int>(n))) continue;
    Node node = std::move(graph.nodes[n]);
    for (ValueId& id : node.inputs) id = redirected(id);
    nodes.push_back(std::move(node));
    if (auto it = after.find(static_cast<int>(n)); it != after.end())
      for (Node& extra : it->second) nodes.push_back(std::move(extra));
  }
  graph.nodes = std::move(nodes);
  for (ValueId& id : graph.outputs) id = redirected(id);
  for (Update& u : graph.updates) u.value = redirected(u.value);
  compact(graph);
  return true;
}

}  // namespace kiln
