// Whole-model gradient checks: autodiff of the MLP and a tiny GPT (float64) against central
// differences of the loss, for every parameter.
#include "gradcheck.h"
#include "models/models.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

std::vector<int> param_indices(const Graph& g) {
  std::vector<int> out;
  for (size_t i = 0; i < g.inputs.size(); ++i)
    if (g.inputs[i].role == Role::kParam) out.push_back(static_cast<int>(i));
  return out;
}

TEST(ModelGradients, MlpMatchesFiniteDifferences) {
  Graph g = models::mlp({3, 5, {4}, 3, DType::kF64});
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    const TensorType& t = g.type(g.inputs[i].value);
    inputs.push_back(t.dtype == DType::kI64 ? random_tensor(t, 50 + i, 0, 3) : random_tensor(t, 50 + i, -0.8, 0.8));
  }
  testing::expect_graph_gradients(g, 0, param_indices(g), inputs, {1e-6, 1e-8, 1e-5, 12});
}

TEST(ModelGradients, GptMatchesFiniteDifferences) {
  models::GptConfig c{2, 4, 7, 2, 2, 4, 0.0, DType::kF64};
  Graph g = models::gpt(c);
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    const TensorType& t = g.type(g.inputs[i].value);
    inputs.push_back(t.dtype == DType::kI64 ? random_tensor(t, 70 + i, 0, 7) : random_tensor(t, 70 + i, -0.5, 0.5));
  }
  testing::expect_graph_gradients(g, 0, param_indices(g), inputs, {1e-6, 1e-8, 1e-5, 8});
}

TEST(ModelGradients, GptWithDropoutAdvancesItsMaskCounterEveryStep) {
  models::GptConfig c{1, 4, 7, 1, 1, 4, 0.1};
  StepProgram t = build_training_graph(models::gpt(c), OptimizerConfig{});
  bool found = false;
  for (const Update& u : t.graph.updates)
    if (t.graph.value(u.target).name == "rng.offset") found = true;
  EXPECT_TRUE(found) << "the training step must advance rng.offset";
}

}  // namespace
}  // namespace kiln
