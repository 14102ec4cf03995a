// The trainer's evaluation is the forward step compiled like the training step (compile_step,
// StepKind::kForward, the step's mixed precision): its loss, logits and accuracy against the
// forward graph run as given by the reference kernels on the same params, for an MLP and
// gpt2-tiny, in f32 (tight) and bf16 (loose); evaluate_batches against evaluate.
#include <cmath>
#include <map>

#include "models/models.h"
#include "runtime/executor.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

// A batch for `forward`'s data inputs: floats in [-1, 1), integers (labels, tokens) in [0, high).
std::vector<Tensor> random_batch(const Graph& forward, uint64_t seed, double high) {
  std::vector<Tensor> out;
  for (const GraphInput& in : forward.inputs) {
    if (in.role != Role::kData) continue;
    const TensorType& type = forward.type(in.value);
    const bool integer = is_integer(type.dtype);
    out.push_back(random_tensor(type, seed + out.size(), integer ? 0.0 : -1.0, integer ? high : 1.0));
  }
  return out;
}

// The forward graph as given (no passes, no mixed precision) by the reference kernels, on the
// trainer's params and state: the oracle of evaluation.
std::vector<Tensor> reference_forward(const Graph& forward, const Trainer& trainer, const std::vector<Tensor>& data) {
  const std::map<std::string, Tensor> tensors = trainer.host_tensors();
  std::vector<Tensor> inputs;
  size_t d = 0;
  for (const GraphInput& in : forward.inputs)
    inputs.push_back(in.role == Role::kData ? data.at(d++) : tensors.at(forward.value(in.value).name));
  ExecutorOptions options;
  options.dialects = {"reference"};
  return Executor(forward, options).run(inputs);
}

// Rows of (rows, classes) logits whose largest entry is the same in both.
double argmax_agreement(const Tensor& a, const Tensor& b) {
  const int64_t classes = a.shape().back(), rows = a.numel() / classes;
  int64_t same = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best_a = 0, best_b = 0;
    for (int64_t k = 1; k < classes; ++k) {
      if (a.get(r * classes + k) > a.get(r * classes + best_a)) best_a = k;
      if (b.get(r * classes + k) > b.get(r * classes + best_b)) best_b = k;
    }
    same += best_a == best_b;
  }
  return static_cast<double>(same) / static_cast<double>(rows);
}

struct Case {
  const char* name;
  Graph forward;
  std::vector<Tensor> init;
  double high;  // labels or tokens in [0, high)
};

Case mlp_case() {
  models::MlpConfig mc{32, 24, {48}, 10};
  Graph g = models::mlp(mc);
  return {"mlp", g, models::init_params_fan_in(g, 5), 10.0};
}

Case gpt_case() {
  models::GptConfig c = models::gpt_config("gpt2-tiny");
  c.batch = 2;
  c.seq = 16;
  Graph g = models::gpt(c);
  return {"gpt2-tiny", g, models::init_params(g, 7, c.layers), static_cast<double>(c.vocab)};
}

// One training step first, so the params evaluated are the trainer's updated ones.
void check_evaluation(const Case& c, const std::string& amp, double loss_rtol, double logits_tol,
                      double min_agreement) {
  SCOPED_TRACE(std::string(c.name) + " amp " + amp);
  OptimizerConfig config;
  config.lr = 1e-3;
  config.amp = amp;
  Trainer trainer(c.forward, config, c.init);
  trainer.step(random_batch(c.forward, 1, c.high));
  const std::vector<Tensor> data = random_batch(c.forward, 50, c.high);
  const std::vector<Tensor> got = trainer.evaluate(data);
  const std::vector<Tensor> want = reference_forward(c.forward, trainer, data);
  ASSERT_EQ(got.size(), want.size());
  const double loss = want[0].get(0);
  EXPECT_NEAR(got[0].get(0), loss, loss_rtol * std::abs(loss));
  EXPECT_LE(max_scaled_error(got[1], want[1], logits_tol, logits_tol), 1.0);
  EXPECT_GE(argmax_agreement(got[1], want[1]), min_agreement);

  // The step that ran is the compiled one, in the training step's precision.
  const Graph& eval = trainer.eval_executor().graph();
  bool has_bf16 = false;
  for (const Value& v : eval.values) has_bf16 = has_bf16 || v.type.dtype == DType::kBF16;
  EXPECT_EQ(has_bf16, amp == "bf16");

  // The loss-only step, over several batches read at once, agrees with evaluate()'s loss.
  const std::vector<Tensor> losses =
      trainer.evaluate_batches(3, [&](int64_t i) { return random_batch(c.forward, 50 + 1000 * i, c.high); });
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_NEAR(losses[0].get(0), got[0].get(0), 1e-6 * std::abs(loss));
  for (int i = 1; i < 3; ++i) {
    const double expected = trainer.evaluate(random_batch(c.forward, 50 + 1000 * i, c.high))[0].get(0);
    EXPECT_NEAR(losses[i].get(0), expected, 1e-6 * std::abs(expected)) << "batch " << i;
  }
  EXPECT_EQ(trainer.eval_executor(/*loss_only=*/true).graph().outputs.size(), 1u);
  // Output 1 (the logits) of each batch, as evaluate() gives it.
  const std::vector<Tensor> logits = trainer.evaluate_batches(1, [&](int64_t) { return data; }, 1);
  ASSERT_EQ(logits.size(), 1u);
  EXPECT_LE(max_scaled_error(logits[0], got[1], 1e-6, 1e-6), 1.0);
}

TEST(TrainEvaluate, CompiledForwardMatchesTheReferenceInF32) {
  check_evaluation(mlp_case(), "off", 1e-5, 1e-4, 1.0);
  check_evaluation(gpt_case(), "off", 1e-5, 1e-4, 1.0);
}

TEST(TrainEvaluate, CompiledForwardUnderBf16TracksTheF32Reference) {
  // bf16 products (8 bits of mantissa) against the f32 reference: the loss within a few percent,
  // the logits within bf16's rounding, the predicted class mostly the same.
  check_evaluation(mlp_case(), "bf16", 3e-2, 5e-2, 0.9);
  check_evaluation(gpt_case(), "bf16", 3e-2, 5e-2, 0.9);
}

TEST(TrainEvaluate, BadBatchesAreClearErrors) {
  Case c = mlp_case();
  Trainer trainer(c.forward, OptimizerConfig{}, c.init);
  EXPECT_THROW(trainer.evaluate_batches(-1, [&](int64_t) { return random_batch(c.forward, 1, c.high); }), Error);
  EXPECT_THROW(trainer.evaluate_batches(1, [&](int64_t) { return random_batch(c.forward, 1, c.high); }, 7), Error);
  EXPECT_THROW(trainer.evaluate_batches(1, [&](int64_t) { return std::vector<Tensor>{}; }), Error);
  EXPECT_TRUE(trainer.evaluate_batches(0, [&](int64_t) { return random_batch(c.forward, 1, c.high); }).empty());
}

}  // namespace
}  // namespace kiln::train
