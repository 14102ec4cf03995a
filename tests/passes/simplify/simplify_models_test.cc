// Every simplify pass, and the default pipeline, on the training graphs of models::mlp and
// models::gpt (gpt2-tiny, batch 1): one training step (outputs and every param/state update)
// is bitwise unchanged by the exact passes and within 1e-6 relative by the rewrites, and the
// node counts are printed (the exact passes must shrink the graph; the decompositions of
// training-rewrites add nodes, which the rest of the pipeline must then trim).
#include <fmt/format.h>

#include <functional>
#include <memory>

#include "models/models.h"
#include "passes/pipeline.h"
#include "passes/simplify/algebraic.h"
#include "passes/simplify/constant_fold.h"
#include "passes/simplify/cse.h"
#include "passes/simplify/dead_code.h"
#include "passes/simplify/training_rewrites.h"
#include "simplify_test_util.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

struct PassCase {
  std::string name;
  std::function<void(Graph&)> run;
  bool exact;  // bitwise; otherwise within 1e-6 relative
};

std::vector<PassCase> pass_cases() {
  auto single = [](auto make) {
    return [make](Graph& g) {
      auto pass = make();
      pass->run(g);
    };
  };
  return {
      {"dead-code", single([] { return std::make_unique<DeadCodeElimination>(); }), true},
      {"cse", single([] { return std::make_unique<CommonSubexpressionElimination>(); }), true},
      {"constant-fold", single([] { return std::make_unique<ConstantFolding>(); }), true},
      {"algebraic", single([] { return std::make_unique<AlgebraicSimplifier>(); }), true},
      {"training-rewrites", single([] { return std::make_unique<TrainingRewrites>(); }), false},
      // The default pipeline without training-rewrites (its one inexact pass): bitwise, and the
      // graph must shrink.
      {"pipeline-exact",
       [](Graph& g) {
         PassOptions options;
         options.disabled = {"training-rewrites"};
         default_pipeline(options).run(g);
       },
       true},
      // The default pipeline, training-rewrites first: the decompositions add nodes (for
      // fusion); the rest must remove some.
      {"pipeline", [](Graph& g) { default_pipeline().run(g); }, false},
  };
}

void check_model(const std::string& model, const Graph& forward, int64_t int_high) {
  StepProgram training = build_training_graph(forward, OptimizerConfig{});
  const Graph& graph = training.graph;
  std::vector<Tensor> inputs = testing::random_inputs(graph, 21, 0, int_high);
  std::vector<Tensor> before = testing::run_step(graph, inputs);
  fmt::print("{}: training graph {} nodes\n", model, graph.nodes.size());
  size_t rewritten_nodes = 0;  // after training-rewrites alone
  for (const PassCase& pc : pass_cases()) {
    SCOPED_TRACE(model + " / " + pc.name);
    Graph g = graph;
    pc.run(g);
    verify(g);
    fmt::print("  {:<18} {:>5} -> {:>5} nodes\n", pc.name, graph.nodes.size(), g.nodes.size());
    std::vector<Tensor> after = testing::run_step(g, inputs);
    if (pc.exact) {
      EXPECT_TRUE(testing::bitwise_equal(after, before));
      EXPECT_LE(g.nodes.size(), graph.nodes.size());
    } else {
      EXPECT_TRUE(testing::relatively_close(after, before, 1e-6));
    }
    if (pc.name == "training-rewrites") rewritten_nodes = g.nodes.size();
    if (pc.name == "pipeline-exact") {
      EXPECT_LT(g.nodes.size(), graph.nodes.size());
    }
    if (pc.name == "pipeline") {
      EXPECT_LT(g.nodes.size(), rewritten_nodes);
    }
  }
}

TEST(SimplifyModels, DefaultPipelineRunsTheSimplifyPassesInOrder) {
  // Other passes may sit between them; these five keep their relative order, dead-code last
  // among them so it collects what the others leave.
  const std::vector<std::string> wanted = {"algebraic", "constant-fold", "cse", "dead-code"};
  size_t next = 0;
  for (const std::string& name : default_pipeline().names())
    if (next < wanted.size() && name == wanted[next]) ++next;
  EXPECT_EQ(next, wanted.size());
}

TEST(SimplifyModels, MlpTrainingStepUnchanged) {
  check_model("mlp", models::mlp({4, 16, {8, 8}, 5, DType::kF32}), 5);
}

TEST(SimplifyModels, GptTrainingStepUnchanged) {
  models::GptConfig config = models::gpt_config("gpt2-tiny");
  config.batch = 1;
  check_model("gpt2-tiny", models::gpt(config), config.vocab);
}

}  // namespace
}  // namespace kiln
