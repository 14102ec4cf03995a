// build_training_graph's optimizer part: the registry entry's state slots (names, shapes), param
// groups (own lr and hyperparameters per param), the no-decay rule, and the errors (a group
// naming no param, a param in two groups, a hyperparameter the optimizer lacks, state that
// cannot be sharded).
#include "compile/training_graph.h"

#include <gtest/gtest.h>

#include "ir/builder.h"
#include "test_util.h"

namespace kiln {
namespace {

// loss = sum((x + emb[ids]) w + b): a matrix, a bias and an embedding table.
Graph small_model() {
  Builder b("small");
  Expr x = b.data("x", {2, 3});
  Expr ids = b.data("ids", {2}, DType::kI64);
  Expr w = b.param("w", {3, 4}), bias = b.param("b", {4}), emb = b.param("emb", {10, 3});
  Expr h = matmul(x + gather(emb, ids), w) + bias;
  return b.finish({sum(h).named("loss")});
}

// The state inputs of a step by name, with their types.
std::map<std::string, TensorType> state_of(const StepProgram& p) {
  std::map<std::string, TensorType> out;
  for (int i : p.state_inputs) {
    const Value& v = p.graph.value(p.graph.inputs[static_cast<size_t>(i)].value);
    out[v.name] = v.type;
  }
  return out;
}

// The optimizer_update node of the param named `name`.
const Node& update_of(const StepProgram& p, const std::string& name) {
  for (const Node& node : p.graph.nodes)
    if (node.op == Op::kOptimizerUpdate && p.graph.value(node.inputs[0]).name == name) return node;
  ADD_FAILURE() << "no update of " << name;
  return p.graph.nodes[0];
}

TEST(TrainingGraph, StateSlotsComeFromTheOptimizersEntry) {
  OptimizerConfig config;
  config.name = "lion";
  std::map<std::string, TensorType> state = state_of(build_training_graph(small_model(), config));
  EXPECT_EQ(state.at("opt.m.w"), (TensorType{DType::kF32, {3, 4}}));
  EXPECT_EQ(state.count("opt.v.w"), 0u);
  config.name = "adafactor";
  state = state_of(build_training_graph(small_model(), config));
  EXPECT_EQ(state.at("opt.v_row.w"), (TensorType{DType::kF32, {3}}));
  EXPECT_EQ(state.at("opt.v_col.w"), (TensorType{DType::kF32, {4}}));
  EXPECT_EQ(state.at("opt.v.b"), (TensorType{DType::kF32, {4}}));
  EXPECT_EQ(state.count("opt.v.w") + state.count("opt.v_row.b"), 0u);
  EXPECT_EQ(state.count("opt.step"), 1u);
}

TEST(TrainingGraph, ParamGroupsHaveTheirOwnLrAndHyperparameters) {
  OptimizerConfig config;  // adamw, lr 1e-3
  config.hyper["beta2"] = 0.95;
  config.groups.push_back(ParamGroup{{"w"}, 5e-4, {{"weight_decay", 0.2}, {"beta1", 0.5}}});
  const StepProgram p = build_training_graph(small_model(), config);
  const Node& w = update_of(p, "w");
  EXPECT_EQ(w.attrs.f("weight_decay"), 0.2);
  EXPECT_EQ(w.attrs.f("beta1"), 0.5);
  EXPECT_EQ(w.attrs.f("beta2"), 0.95);
  const Node& b = update_of(p, "b");
  EXPECT_EQ(b.attrs.f("weight_decay"), 0.01);
  EXPECT_EQ(b.attrs.f("beta1"), 0.9);
  // The group's lr is the schedule's times 0.5: a multiply between the lr input and its update.
  const ValueId w_lr = w.inputs[w.inputs.size() - 2], b_lr = b.inputs[b.inputs.size() - 2];
  EXPECT_NE(w_lr, b_lr);
  bool scaled = false;
  for (const Node& node : p.graph.nodes)
    if (node.op == Op::kMul && node.outputs[0] == w_lr) scaled = true;
  EXPECT_TRUE(scaled);
}

TEST(TrainingGraph, NoDecayOnBiasesNormsAndEmbeddingsWhenAsked) {
  OptimizerConfig config;
  config.hyper["weight_decay"] = 0.1;
  config.decay_biases_norms_embeddings = false;
  const StepProgram p = build_training_graph(small_model(), config);
  EXPECT_EQ(update_of(p, "w").attrs.f("weight_decay"), 0.1);
  EXPECT_EQ(update_of(p, "b").attrs.f("weight_decay"), 0.0);
  EXPECT_EQ(update_of(p, "emb").attrs.f("weight_decay"), 0.0);
}

TEST(TrainingGraph, OptimizerErrorsNameWhatWasGiven) {
  OptimizerConfig config;
  config.groups.push_back(ParamGroup{{"w", "nope"}, std::nullopt, {}});
  EXPECT_KILN_ERROR(build_training_graph(small_model(), config), "a param group names 'nope'",
                    "its params: w, b, emb");
  config.groups = {ParamGroup{{"w"}, std::nullopt, {}}, ParamGroup{{"w"}, std::nullopt, {}}};
  EXPECT_KILN_ERROR(validate(config), "param 'w' is in two param groups");
  config.groups = {ParamGroup{{"w"}, std::nullopt, {{"momentum", 0.9}}}};
  EXPECT_KILN_ERROR(validate(config), "param group 0: optimizer adamw has no hyperparameter 'momentum'");
  config.groups.clear();
  config.name = "adam";
  EXPECT_KILN_ERROR(validate(config), "unknown optimizer 'adam' (expected sgd, adamw, lion, adafactor)");
  config.name = "adafactor";
  EXPECT_KILN_ERROR(build_training_graph(small_model(), config, ShardingOptions{ShardMode::kZero1, 2}),
                    "optimizer adafactor keeps state (v_row) that cannot be sharded");
}

}  // namespace
}  // namespace kiln
