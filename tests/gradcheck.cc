#include "gradcheck.h"

#include <algorithm>

#include "ir/builder.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"

namespace kiln::testing {

void expect_graph_gradients(const Graph& graph, int loss_output, const std::vector<int>& wrt,
                            const std::vector<Tensor>& inputs, GradCheckOptions options) {
  ValueId loss = graph.outputs.at(loss_output);
  std::vector<ValueId> wrt_values;
  for (int i : wrt) wrt_values.push_back(graph.inputs.at(i).value);
  AutodiffResult result = autodiff(graph, loss, wrt_values);
  Graph joint = result.graph;
  joint.outputs = {loss};
  joint.outputs.insert(joint.outputs.end(), result.gradients.begin(), result.gradients.end());
  const ExecutorOptions reference{Device::kCpu, {"reference"}};
  std::vector<Tensor> analytic = Executor(joint, reference).run(inputs);

  Graph forward = graph;
  forward.outputs = {loss};
  Executor forward_exec(forward, reference);
  auto loss_at = [&](std::vector<Tensor>& in) { return forward_exec.run(in)[0].get(0); };

  for (size_t w = 0; w < wrt.size(); ++w) {
    std::vector<Tensor> perturbed = inputs;
    Tensor& x = perturbed[wrt[w]];
    x = x.clone();
    const Tensor& grad = analytic[1 + w];
    const std::string& name = graph.value(wrt_values[w]).name;
    int64_t n = x.numel();
    int64_t step = std::max<int64_t>(1, n / options.max_elements);
    for (int64_t j = 0; j < n; j += step) {
      double original = x.get(j);
      x.set(j, original + options.epsilon);
      double plus = loss_at(perturbed);
      x.set(j, original - options.epsilon);
      double minus = loss_at(perturbed);
      x.set(j, original);
      double numeric = (plus - minus) / (2 * options.epsilon);
      double got = grad.get(j);
      EXPECT_LE(std::abs(got - numeric), options.atol + options.rtol * std::abs(numeric))
          << "d loss / d " << name << "[" << j << "]: autodiff " << got << ", finite difference " << numeric;
    }
  }
}

void expect_op_gradients(Op op, const std::vector<Tensor>& inputs, Attributes attrs,
                         GradCheckOptions options) {
  Builder b("gradcheck");
  std::vector<Expr> xs;
  for (size_t i = 0; i < inputs.size(); ++i) xs.push_back(b.data(fmt::format("x{}", i), inputs[i].shape(), inputs[i].dtype()));
  std::vector<Expr> ys = b.apply(op, xs, std::move(attrs));
  std::vector<Tensor> all_inputs = inputs;
  Expr loss;
  for (size_t k = 0; k < ys.size(); ++k) {
    if (!is_float(ys[k].dtype())) continue;
    Expr w = b.data(fmt::format("w{}", k), ys[k].shape(), ys[k].dtype());
    all_inputs.push_back(random_tensor(ys[k].type(), 1000 + k, -1.0, 1.0));
    Expr term = sum(ys[k] * w);
    loss = loss.id() < 0 ? term : loss + term;
  }
  ASSERT_GE(loss.id(), 0) << op_name(op) << " has no float output";
  Graph g = b.finish({loss});
  std::vector<int> wrt;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (is_float(inputs[i].dtype()) &&
        std::find(options.skip_inputs.begin(), options.skip_inputs.end(), static_cast<int>(i)) == options.skip_inputs.end())
      wrt.push_back(static_cast<int>(i));
  expect_graph_gradients(g, 0, wrt, all_inputs, options);
}

}  // namespace kiln::testing
