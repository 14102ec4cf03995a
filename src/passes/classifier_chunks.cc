#include "passes/classifier_chunks.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "ops/fp8.h"
#include "ops/fused/classifier.h"
#include "ops/fused/kind.h"
#include "passes/fusion/fusion.h"
#include "passes/simplify/compact.h"
#include "passes/uses.h"
#include "support/error.h"

namespace kiln {
namespace {

// Chunk boundaries are multiples of this many rows: every slice then starts at a multiple of 16
// bytes (a view, not a copy: memory_plan.h) whatever the row width, and GEMM tiles stay whole.
constexpr int64_t kRowQuantum = 64;

bool transposed(const Node& matmul, const char* which) {
  return matmul.attrs.has(which) && matmul.attrs.b(which);
}

// A contraction over the rows: matmul(Gf, Xf) or matmul(Xf, Gf) with transpose_a.
struct Contraction {
  int node = -1;
  bool g_first = true;
  int cast = -1;  // its only reader, a cast of the 16-bit product to f32, absorbed; or -1
  // The (f32) gradient's only reader add(gradient, scatter_add(zeros, i, u)) (a tied
  // embedding's two gradients), and that scatter: the add becomes scatter_add(sum, i, u).
  int tied_add = -1, tied_scatter = -1;
};

struct Head {
  int producer = -1;    // L = matmul(X, W)
  int classifier = -1;  // loss, G = classifier(L, labels, dloss)
  ValueId x = -1, w = -1;
  ClassifierBody body;
  std::vector<int> row_readers;  // matmul(G, B)
  std::vector<Contraction> contractions;
  std::vector<int> g_reshapes;  // G's flat views, read only by the above
};

int64_t rows_of(const TensorType& t) {
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < t.shape.size(); ++d) rows *= t.shape[d];
  return rows;
}

// Whether `v` is `base` seen as (rows, last dim): itself when of rank 2, or a reshape of it.
bool is_flat_view(const Graph& graph, const Uses& uses, ValueId v, ValueId base) {
  const TensorType& bt = graph.type(base);
  const Shape flat{rows_of(bt), bt.shape.back()};
  if (graph.type(v).shape != flat) return false;
  if (v == base) return true;
  const int p = uses.producer[static_cast<size_t>(v)];
  return p >= 0 && graph.nodes[static_cast<size_t>(p)].op == Op::kReshape &&
         graph.nodes[static_cast<size_t>(p)].inputs[0] == base;
}

// scatter_add(full(0), i, u) with the zeros read by nothing else.
bool is_scatter_into_zeros(const Graph& graph, const Uses& uses, int n) {
  const Node& node = graph.nodes[static_cast<size_t>(n)];
  if (node.op != Op::kScatterAdd || !uses.single(node.inputs[0])) return false;
  const int z = uses.producer[static_cast<size_t>(node.inputs[0])];
  if (z < 0) return false;
  const Node& zeros = graph.nodes[static_cast<size_t>(z)];
  return zeros.op == Op::kFull && zeros.attrs.f("value") == 0.0;
}

std::optional<Head> match_head(const Graph& graph, const Uses& uses, int c) {
  const Node& cls = graph.nodes[static_cast<size_t>(c)];
  if (!is_fused(cls, FusedKind::kClassifier)) return std::nullopt;
  Head h;
  h.classifier = c;
  std::optional<ClassifierBody> body = match_classifier_body(*cls.body);
  if (!body || body->reduction == "none") return std::nullopt;
  h.body = *body;
  const ValueId logits = cls.inputs[0], g = cls.outputs[1];
  h.producer = uses.producer[static_cast<size_t>(logits)];
  if (h.producer < 0 || !uses.single(logits)) return std::nullopt;
  const Node& mm = graph.nodes[static_cast<size_t>(h.producer)];
  // An fp8 product's scale is its whole operand's: chunks would each scale their own.
  if (mm.op != Op::kMatmul || transposed(mm, "transpose_a") || matmul_fp8(mm.attrs).on())
    return std::nullopt;
  h.x = mm.inputs[0];
  h.w = mm.inputs[1];
  const TensorType& xt = graph.type(h.x);
  if (graph.type(h.w).rank() != 2 || xt.rank() < 2 || rows_of(xt) != h.body.rows ||
      graph.type(cls.inputs[1]).rank() + 1 != xt.rank())
    return std::nullopt;
  if (uses.escapes[static_cast<size_t>(g)]) return std::nullopt;
  // Everything a chunk reads must exist before the classifier: the chunks take its place.
  auto defined_before_classifier = [&](ValueId v) {
    return uses.producer[static_cast<size_t>(v)] < c;
  };
  // A reader of G (or of one of its flat views `gv`).
  auto take = [&](int r, ValueId gv) {
    const Node& n = graph.nodes[static_cast<size_t>(r)];
    if (n.op != Op::kMatmul || n.inputs[0] == n.inputs[1] || matmul_fp8(n.attrs).on()) return false;
    if (!transposed(n, "transpose_a")) {
      if (n.inputs[0] != gv || !defined_before_classifier(n.inputs[1]) ||
          graph.type(n.inputs[1]).rank() != 2)
        return false;
      h.row_readers.push_back(r);
      return true;
    }
    // transpose_a: a contraction of the flat G with the flat X, in either order.
    Contraction k;
    k.node = r;
    k.g_first = n.inputs[0] == gv;
    const ValueId other = k.g_first ? n.inputs[1] : n.inputs[0];
    if ((n.inputs[0] != gv && n.inputs[1] != gv) || transposed(n, "transpose_b") ||
        graph.type(gv).rank() != 2 || !is_flat_view(graph, uses, other, h.x))
      return false;
    const ValueId out = n.outputs[0];
    const std::vector<int>& readers = uses.readers[static_cast<size_t>(out)];
    if (graph.type(out).dtype != DType::kF32 && uses.single(out)) {
      const Node& cast = graph.nodes[static_cast<size_t>(readers[0])];
      if (cast.op == Op::kCast && cast.attrs.dtype("dtype") == DType::kF32) k.cast = readers[0];
    }
    const ValueId f32 = k.cast >= 0 ? graph.nodes[static_cast<size_t>(k.cast)].outputs[0] : out;
    if (graph.type(f32).dtype == DType::kF32 && uses.single(f32)) {
      const int a = uses.readers[static_cast<size_t>(f32)][0];
      const Node& add = graph.nodes[static_cast<size_t>(a)];
      const ValueId addend = add.op == Op::kAdd ? (add.inputs[0] == f32 ? add.inputs[1] : add.inputs[0]) : -1;
      const int sc = addend >= 0 ? uses.producer[static_cast<size_t>(addend)] : -1;
      if (sc >= 0 && addend != f32 && uses.single(addend) && graph.type(addend) == graph.type(f32) &&
          is_scatter_into_zeros(graph, uses, sc)) {
        k.tied_add = a;
        k.tied_scatter = sc;
      }
    }
    h.contractions.push_back(k);
    return true;
  };
  for (int r : uses.readers[static_cast<size_t>(g)]) {
    const Node& n = graph.nodes[static_cast<size_t>(r)];
    if (n.op == Op::kReshape && is_flat_view(graph, uses, n.outputs[0], g) &&
        graph.type(g).rank() > 2) {
      const ValueId gf = n.outputs[0];
      if (uses.escapes[static_cast<size_t>(gf)]) return std::nullopt;
      for (int rr : uses.readers[static_cast<size_t>(gf)])
        if (!take(rr, gf)) return std::nullopt;
      h.g_reshapes.push_back(r);
    } else if (!take(r, g)) {
      return std::nullopt;
    }
  }
  return h;
}

// The classifier body for a chunk of `rows` rows, reduction "sum": the original body with its
// row dims replaced (values of the labels' rank are labels-like, one more dim logits-like).
std::shared_ptr<Graph> chunk_body(const Graph& original, int64_t rows) {
  auto body = std::make_shared<Graph>(original);
  const size_t label_rank = original.type(original.inputs[1].value).rank();
  for (Value& v : body->values) {
    Shape& s = v.type.shape;
    if (s.size() == label_rank + 1) {
      s = Shape{rows, s.back()};
    } else if (s.size() == label_rank && label_rank > 0) {
      s = Shape{rows};
    }
  }
  for (Node& n : body->nodes)
    if (n.op == Op::kCrossEntropy || n.op == Op::kCrossEntropyGrad)
      n.attrs.set("reduction", std::string("sum"));
  return body;
}

// The rows per chunk (a multiple of the quantum; the last chunk may be shorter) for logits of
// `type` over `rows` rows in chunks of at most `cap` bytes: 0 when they fit, or when the
// quantum leaves nothing to split.
int64_t chunk_rows_for(const TensorType& type, int64_t rows, size_t cap) {
  const int64_t bytes = static_cast<int64_t>(type.bytes()), limit = static_cast<int64_t>(cap);
  if (bytes <= limit || rows <= kRowQuantum) return 0;
  const int64_t row_bytes = bytes / rows;
  // As many rows as fit the cap, rounded down to the quantum (up to one quantum at least), then
  // spread evenly over the chunks that takes.
  const int64_t fit = std::max<int64_t>(limit / row_bytes / kRowQuantum, 1) * kRowQuantum;
  const int64_t chunks = (rows + fit - 1) / fit;
  const int64_t even = ((rows + chunks - 1) / chunks + kRowQuantum - 1) / kRowQuantum * kRowQuantum;
  return even >= rows ? 0 : even;
}

}  // namespace

bool ClassifierChunksPass::run(Graph& graph) {
  if (chunk_bytes_ == 0) return false;
  bool changed = false;
  // One head per round: the chunks' own classifiers fit the cap and are left alone.
  for (;;) {
    const Uses uses(graph);
    std::optional<Head> head;
    int64_t chunk_rows = 0;
    for (size_t n = 0; n < graph.nodes.size() && !head; ++n) {
      head = match_head(graph, uses, static_cast<int>(n));
      if (head) chunk_rows = chunk_rows_for(graph.type(graph.nodes[n].inputs[0]), head->body.rows, chunk_bytes_);
      if (chunk_rows == 0) head.reset();
    }
    if (!head) break;
    // Copies: emitting nodes below reallocates graph.nodes.
    const Node cls = graph.nodes[static_cast<size_t>(head->classifier)];
    const Node mm = graph.nodes[static_cast<size_t>(head->producer)];
    struct Reader {
      Attributes attrs;
      ValueId b = -1, out = -1;
      std::vector<ValueId> parts;
    };
    std::vector<Reader> row_readers;
    for (int r : head->row_readers) {
      const Node& n = graph.nodes[static_cast<size_t>(r)];
      row_readers.push_back({n.attrs, n.inputs[1], n.outputs[0], {}});
    }
    struct Sum {
      Attributes attrs;
      bool g_first = true;
      ValueId out = -1;       // the product, or its absorbed cast to f32
      ValueId sum = -1;       // f32
      const Contraction* k = nullptr;
    };
    std::vector<Sum> sums;
    for (const Contraction& k : head->contractions) {
      const Node& n = graph.nodes[static_cast<size_t>(k.node)];
      sums.push_back({n.attrs, k.g_first,
                      k.cast >= 0 ? graph.nodes[static_cast<size_t>(k.cast)].outputs[0] : n.outputs[0], -1, &k});
    }
    // Per new node (in emission order): its group for outlining; each chunk's weight-gradient
    // product, cast and accumulating add are one GEMM group (fusion would otherwise merge the
    // casts and adds of every chunk into one product's epilogue, the others' products written
    // out in 16 bits).
    std::vector<int> group;
    const int64_t rows = head->body.rows, width = graph.type(head->x).shape.back();

    // The new nodes, emitted at the end and then moved to the classifier's place.
    const size_t first_new = graph.nodes.size();
    int next_group = 0;
    auto emit_in = [&](int g, Op op, std::vector<ValueId> in, Attributes attrs = {}) {
      const ValueId out = graph.add(op, std::move(in), std::move(attrs));
      group.push_back(g);
      return out;
    };
    auto emit = [&](Op op, std::vector<ValueId> in, Attributes attrs = {}) {
      return emit_in(next_group++, op, std::move(in), std::move(attrs));
    };
    auto reshaped = [&](ValueId v, const Shape& shape) {
      return graph.type(v).shape == shape ? v : emit(Op::kReshape, {v}, {{"shape", shape}});
    };
    const ValueId labels = reshaped(cls.inputs[1], Shape{rows});
    const ValueId xf = reshaped(head->x, Shape{rows, width});
    const ValueId dloss = cls.inputs[2];
    const bool mean = head->body.reduction == "mean";
    ValueId denom = -1, scale = dloss;
    if (mean) {
      const ValueId ignore =
          emit(Op::kFull, {}, {{"shape", Shape{}}, {"dtype", graph.type(labels).dtype},
                               {"value", static_cast<double>(head->body.ignore_index)}});
      const ValueId counted = emit(Op::kCast, {emit(Op::kNe, {labels, ignore})}, {{"dtype", DType::kF32}});
      const ValueId one = emit(Op::kFull, {}, {{"shape", Shape{}}, {"dtype", DType::kF32}, {"value", 1.0}});
      denom = emit(Op::kMaximum, {emit(Op::kSum, {counted}), one});
      scale = emit(Op::kDiv, {dloss, denom});
    }
    ValueId loss = -1;
    int chunk = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows, ++chunk) {
      const int64_t r1 = std::min(rows, r0 + chunk_rows);
      const ValueId xc = emit(Op::kSlice, {xf}, {{"starts", std::vector<int64_t>{r0, 0}},
                                                 {"ends", std::vector<int64_t>{r1, width}}});
      const ValueId lc = emit(Op::kSlice, {labels}, {{"starts", std::vector<int64_t>{r0}},
                                                     {"ends", std::vector<int64_t>{r1}}});
      const ValueId logits = emit(Op::kMatmul, {xc, head->w}, mm.attrs);
      auto body = chunk_body(*cls.body, r1 - r0);
      body->name = fmt::format("{}_chunk{}", cls.body->name, chunk);
      KILN_CHECK(match_classifier_body(*body).has_value(),
                 "classifier-chunks: a chunk's body is not of the classifier form");
      const std::vector<ValueId> outs = graph.add_node(Op::kFused, {logits, lc, scale}, cls.attrs, body);
      group.push_back(next_group++);
      loss = loss < 0 ? outs[0] : emit(Op::kAdd, {loss, outs[0]});
      const ValueId gc = outs[1];
      for (Reader& r : row_readers) r.parts.push_back(emit(Op::kMatmul, {gc, r.b}, r.attrs));
      for (Sum& s : sums) {
        const int g = next_group++;
        ValueId part = emit_in(g, Op::kMatmul, s.g_first ? std::vector<ValueId>{gc, xc} : std::vector<ValueId>{xc, gc},
                               s.attrs);
        if (graph.type(part).dtype != DType::kF32) part = emit_in(g, Op::kCast, {part}, {{"dtype", DType::kF32}});
        s.sum = s.sum < 0 ? part : emit_in(g, Op::kAdd, {part, s.sum});
      }
    }
    if (mean) loss = emit(Op::kDiv, {loss, denom});

    // Every replaced value's readers read the new one.
    std::vector<std::pair<ValueId, ValueId>> swaps;
    auto replace = [&](ValueId from, ValueId to) {
      move_name(graph, from, to);
      swaps.emplace_back(from, to);
    };
    replace(cls.outputs[0], loss);
    for (const Reader& r : row_readers)
      replace(r.out, reshaped(emit(Op::kConcat, r.parts, {{"axis", int64_t{0}}}), graph.type(r.out).shape));
    std::set<int> dropped{head->producer, head->classifier};
    std::map<int, Node> late;  // new nodes that take the place of a later one (the tied add)
    for (const Sum& s : sums) {
      if (s.k->tied_add >= 0) {
        const Node add = graph.nodes[static_cast<size_t>(s.k->tied_add)];
        const Node scatter = graph.nodes[static_cast<size_t>(s.k->tied_scatter)];
        replace(add.outputs[0],
                graph.add(Op::kScatterAdd, {s.sum, scatter.inputs[1], scatter.inputs[2]}, scatter.attrs));
        late.emplace(s.k->tied_add, std::move(graph.nodes.back()));
        graph.nodes.pop_back();
        dropped.insert(s.k->tied_scatter);
        continue;
      }
      const DType dtype = graph.type(s.out).dtype;
      replace(s.out, dtype == DType::kF32 ? s.sum : emit(Op::kCast, {s.sum}, {{"dtype", dtype}}));
    }
    dropped.insert(head->row_readers.begin(), head->row_readers.end());
    dropped.insert(head->g_reshapes.begin(), head->g_reshapes.end());
    for (const Contraction& k : head->contractions) {
      dropped.insert(k.node);
      if (k.cast >= 0) dropped.insert(k.cast);
    }

    // The node list: the new nodes where the classifier was, the replaced ones gone. Group ids
    // for outlining: the new nodes' from `group`, offset past one id per old node.
    std::vector<Node> fresh(std::make_move_iterator(graph.nodes.begin() + static_cast<std::ptrdiff_t>(first_new)),
                            std::make_move_iterator(graph.nodes.end()));
    graph.nodes.resize(first_new);
    std::vector<Node> nodes;
    std::vector<int> group_of;
    nodes.reserve(graph.nodes.size() + fresh.size());
    const int offset = static_cast<int>(first_new);
    for (size_t n = 0; n < graph.nodes.size(); ++n) {
      if (static_cast<int>(n) == head->classifier)
        for (size_t f = 0; f < fresh.size(); ++f) {
          nodes.push_back(std::move(fresh[f]));
          group_of.push_back(offset + group[f]);
        }
      if (auto it = late.find(static_cast<int>(n)); it != late.end()) {
        nodes.push_back(std::move(it->second));
        group_of.push_back(static_cast<int>(n));
      } else if (!dropped.count(static_cast<int>(n))) {
        nodes.push_back(std::move(graph.nodes[n]));
        group_of.push_back(static_cast<int>(n));
      }
    }
    graph.nodes = std::move(nodes);
    std::vector<ValueId> replacement(graph.values.size());
    for (size_t v = 0; v < replacement.size(); ++v) replacement[v] = static_cast<ValueId>(v);
    for (const auto& [from, to] : swaps) replacement[static_cast<size_t>(from)] = to;
    replace_uses(graph, replacement);
    compact(graph);
    fusion::outline(graph, group_of);
    changed = true;
  }
  return changed;
}

}  // namespace kiln
