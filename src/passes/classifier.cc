#include "passes/classifier.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "ops/fused/classifier.h"
#include "ops/fused/kind.h"
#include "passes/fusion/fusion.h"
#include "passes/uses.h"
#include "support/error.h"

namespace kiln {
namespace {

bool is_16bit_float(DType d) { return d == DType::kBF16 || d == DType::kF16; }

// The nodes of one match, in node order: [cast in], cross_entropy, cross_entropy_grad, [cast out].
struct Match {
  std::vector<int> members;
};

// Whether outlining `members` into one node would create a cycle: a path that leaves the group
// and comes back into it. Nodes are in topological order, so one sweep finds every node
// downstream of the group through outside nodes.
bool would_cycle(const Graph& graph, const Uses& uses, const std::vector<int>& members) {
  std::vector<char> member(graph.nodes.size(), 0), downstream(graph.nodes.size(), 0);
  for (int m : members) member[static_cast<size_t>(m)] = 1;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    bool reads_group = false;
    for (ValueId in : graph.nodes[n].inputs) {
      const int p = uses.producer[static_cast<size_t>(in)];
      if (p < 0) continue;
      reads_group = reads_group || (member[static_cast<size_t>(p)] && !member[n]) ||
                    downstream[static_cast<size_t>(p)];
    }
    if (!reads_group) continue;
    if (member[n]) return true;  // a member reads something computed from the group outside it
    downstream[n] = 1;
  }
  return false;
}

std::optional<Match> match_at(const Graph& graph, const Uses& uses, int ce_index) {
  const Node& ce = graph.nodes[static_cast<size_t>(ce_index)];
  const ValueId logits = ce.inputs[0], labels = ce.inputs[1];
  if (graph.type(logits).dtype != DType::kF32) return std::nullopt;
  // Exactly one gradient of this loss: same logits, labels and attributes.
  int grad_index = -1;
  for (int reader : uses.readers[static_cast<size_t>(logits)]) {
    const Node& node = graph.nodes[static_cast<size_t>(reader)];
    if (node.op != Op::kCrossEntropyGrad || node.inputs[0] != logits || node.inputs[1] != labels ||
        !same_values(node.attrs, ce.attrs))
      continue;
    if (grad_index >= 0 && grad_index != reader) return std::nullopt;  // two gradients
    grad_index = reader;
  }
  // The loss first: the body's outputs are (loss, gradient) in node order.
  if (grad_index < ce_index) return std::nullopt;
  const Node& grad = graph.nodes[static_cast<size_t>(grad_index)];
  Match match;
  // The cast of 16-bit logits to f32, when the two loss ops are its only readers.
  const int cast_in = uses.producer[static_cast<size_t>(logits)];
  if (cast_in >= 0) {
    const Node& cast = graph.nodes[static_cast<size_t>(cast_in)];
    const std::vector<int>& readers = uses.readers[static_cast<size_t>(logits)];
    const bool only_loss_ops =
        !uses.escapes[static_cast<size_t>(logits)] && readers.size() == 2 &&
        std::all_of(readers.begin(), readers.end(),
                    [&](int r) { return r == ce_index || r == grad_index; }) &&
        readers[0] != readers[1];
    if (cast.op == Op::kCast && is_16bit_float(graph.type(cast.inputs[0]).dtype) && only_loss_ops)
      match.members.push_back(cast_in);
  }
  match.members.push_back(ce_index);
  match.members.push_back(grad_index);
  // The cast of the gradient back to 16 bits, when it is the gradient's only reader.
  const ValueId g = grad.outputs[0];
  const std::vector<int>& g_readers = uses.readers[static_cast<size_t>(g)];
  if (!uses.escapes[static_cast<size_t>(g)] && g_readers.size() == 1) {
    const Node& cast = graph.nodes[static_cast<size_t>(g_readers[0])];
    if (cast.op == Op::kCast && is_16bit_float(graph.type(cast.outputs[0]).dtype))
      match.members.push_back(g_readers[0]);
  }
  std::sort(match.members.begin(), match.members.end());
  if (would_cycle(graph, uses, match.members)) return std::nullopt;
  return match;
}

}  // namespace

bool ClassifierPass::run(Graph& graph) {
  int fired = 0;
  for (;;) {
    const Uses uses(graph);
    std::optional<Match> match;
    for (size_t n = 0; n < graph.nodes.size() && !match; ++n)
      if (graph.nodes[n].op == Op::kCrossEntropy) match = match_at(graph, uses, static_cast<int>(n));
    if (!match) break;
    // One group id per node: the match shares one, every other node has its own.
    std::vector<int> group_of(graph.nodes.size());
    for (size_t n = 0; n < group_of.size(); ++n) group_of[n] = static_cast<int>(n);
    for (int m : match->members) group_of[static_cast<size_t>(m)] = match->members.front();
    const int first = match->members.front();
    // outline() keeps the other nodes in their order; the new node is the only fused node
    // whose body holds this cross_entropy: find it by its first member's position in order.
    std::vector<const Graph*> before;
    for (const Node& node : graph.nodes)
      if (node.op == Op::kFused) before.push_back(node.body.get());
    KILN_CHECK(fusion::outline(graph, group_of) == 1,
               "classifier: outlining the loss at node {} did not make one fused node", first);
    for (Node& node : graph.nodes) {
      if (node.op != Op::kFused ||
          std::find(before.begin(), before.end(), node.body.get()) != before.end())
        continue;
      auto body = std::make_shared<Graph>(*node.body);
      body->name = fmt::format("classifier_{}", fired);
      node.body = std::move(body);
      node.attrs = fused_attrs(FusedKind::kClassifier);
      std::string why;
      KILN_CHECK(match_classifier_body(*node.body, &why).has_value(),
                 "classifier: the outlined body is not of the classifier form: {}", why);
    }
    ++fired;
  }
  return fired > 0;
}

}  // namespace kiln
