#include "train/job.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "models/models.h"
#include "support/error.h"
#include "train/data/fashion_mnist.h"
#include "train/data/loader.h"
#include "train/data/text.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

using Clock = std::chrono::steady_clock;

bool is_language_model(const std::string& model) { return model.rfind("gpt2", 0) == 0; }

// The task: how to make batch `step`, how to evaluate, what the model is.
struct Task {
  Graph forward;
  std::vector<Tensor> init;
  std::function<Batch(int64_t step)> train_batch;
  std::function<std::pair<std::string, double>(const Trainer&)> evaluate;
  std::string description;
  int64_t items_per_step = 0;  // samples or tokens
  std::string item_name;
};

Task classification_task(const JobOptions& o) {
  KILN_CHECK(o.data == "fashion-mnist" || o.data.empty(),
             "model {} trains on fashion-mnist, got --data '{}'", o.model, o.data);
  FashionMnist fm = load_fashion_mnist(o.data_dir.empty() ? kFashionMnistDir : o.data_dir);
  Task t;
  t.forward = models::by_name(o.model, o.batch);
  t.init = models::init_params_fan_in(t.forward, o.seed);
  if (o.model == "cnn") {
    fm.train = fm.train.with_sample_shape(kFashionMnistImageShape);
    fm.test = fm.test.with_sample_shape(kFashionMnistImageShape);
  }
  auto batcher = std::make_shared<Batcher>(Batcher::training(fm.train, o.batch, o.seed));
  t.train_batch = [batcher](int64_t step) { return batcher->batch_at_step(step); };
  auto test = std::make_shared<ClassificationDataset>(fm.test);
  const int64_t B = o.batch;
  t.evaluate = [test, B](const Trainer& trainer) {
    // Fixed-shape graph: the last partial batch is padded with sample 0 and only real rows count.
    Batcher eval = Batcher::evaluation(*test, B);
    int64_t correct = 0, total = 0;
    for (int64_t i = 0; i < eval.batches_per_epoch(); ++i) {
      Batch b = eval.batch(0, i);
      int64_t rows = b.targets.numel();
      if (rows < B) {
        std::vector<int64_t> idx;
        for (int64_t r = 0; r < B; ++r) idx.push_back(r < rows ? i * B + r : 0);
        b = test->gather(idx);
      }
      Tensor logits = trainer.evaluate({b.inputs, b.targets})[1];
      const int64_t classes = logits.shape()[1];
      const float* l = logits.data<float>();
      for (int64_t r = 0; r < rows; ++r) {
        int64_t best = 0;
        for (int64_t k = 1; k < classes; ++k)
          if (l[r * classes + k] > l[r * classes + best]) best = k;
        correct += best == b.targets.data<int64_t>()[r];
      }
      total += rows;
    }
    return std::pair<std::string, double>{"accuracy", static_cast<double>(correct) / static_cast<double>(total)};
  };
  t.description = fmt::format("{} on Fashion-MNIST ({} train / {} test images)", o.model,
                              fm.train.size(), fm.test.size());
  t.items_per_step = o.batch;
  t.item_name = "samples";
  return t;
}

Task language_model_task(const JobOptions& o) {
  models::GptConfig config = models::gpt_config(o.model);
  config.batch = o.batch;
  if (o.seq > 0) config.seq = o.seq;
  std::string path = o.data.empty() || o.data == "fashion-mnist" ? kDefaultTextPath : o.data;
  KILN_CHECK(o.data != "fashion-mnist", "model {} is a language model: give --data a text or .tok file", o.model);
  std::vector<int32_t> tokens;
  if (path.size() > 4 && path.substr(path.size() - 4) == ".tok") tokens = read_token_file(path);
  else tokens = ByteTokenizer().encode(read_text_file(path));
  for (int32_t tok : tokens)
    KILN_CHECK(tok >= 0 && tok < config.vocab, "token {} in '{}' is outside the model's vocabulary of {}", tok,
               path, config.vocab);
  // Hold out the last 10% for evaluation.
  int64_t split = static_cast<int64_t>(tokens.size()) * 9 / 10;
  KILN_CHECK(split > config.seq + 1 && static_cast<int64_t>(tokens.size()) - split > config.seq + 1,
             "'{}' has {} tokens: too few for sequences of {} (need more than {})", path, tokens.size(),
             config.seq, 10 * (config.seq + 2));
  auto train_tokens = std::make_shared<TokenBatcher>(std::vector<int32_t>(tokens.begin(), tokens.begin() + split), config.batch, config.seq);
  auto eval_tokens = std::make_shared<TokenBatcher>(std::vector<int32_t>(tokens.begin() + split, tokens.end()), config.batch, config.seq);
  Task t;
  t.forward = models::gpt(config);
  t.init = models::init_params(t.forward, o.seed, config.layers);
  uint64_t seed = o.seed;
  t.train_batch = [train_tokens, seed](int64_t step) { return train_tokens->random_batch(seed, step); };
  int64_t eval_batches = o.eval_batches > 0 ? o.eval_batches : 10;
  t.evaluate = [eval_tokens, eval_batches, seed](const Trainer& trainer) {
    double total = 0;
    for (int64_t i = 0; i < eval_batches; ++i) {
      Batch b = eval_tokens->random_batch(seed + 1, i);
      total += trainer.evaluate({b.inputs, b.targets})[0].get(0);
    }
    return std::pair<std::string, double>{"perplexity", std::exp(total / static_cast<double>(eval_batches))};
  };
  t.description = fmt::format("{} ({} layers, d={}, T={}, vocab {}) on '{}' ({} tokens)", o.model, config.layers,
                              config.d_model, config.seq, config.vocab, path, tokens.size());
  t.items_per_step = config.batch * config.seq;
  t.item_name = "tokens";
  return t;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s / 60) % 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

}  // namespace

JobResult run_training_job(const JobOptions& o) {
  KILN_CHECK(o.device == "cpu", "device '{}' is not available in this build (expected cpu)", o.device);
  KILN_CHECK(o.steps > 0, "--steps must be > 0, got {}", o.steps);
  KILN_CHECK(o.batch > 0, "--batch must be > 0, got {}", o.batch);
  KILN_CHECK(o.model == "mlp" || o.model == "cnn" || is_language_model(o.model),
             "unknown model '{}' (expected mlp, cnn, gpt2-tiny, gpt2 or gpt2-medium)", o.model);
  validate(o.optimizer);
  const Clock::time_point start = Clock::now();
  Task task = is_language_model(o.model) ? language_model_task(o) : classification_task(o);

  Trainer trainer(task.forward, o.optimizer, task.init);
  std::string checkpoint = o.checkpoint_dir.empty() ? "" : (std::filesystem::path(o.checkpoint_dir) / "last.safetensors").string();
  if (!checkpoint.empty()) std::filesystem::create_directories(o.checkpoint_dir);
  if (o.resume) {
    KILN_CHECK(!checkpoint.empty(), "--resume needs --checkpoint-dir");
    KILN_CHECK(std::filesystem::exists(checkpoint), "--resume: no checkpoint at '{}'", checkpoint);
    auto metadata = trainer.load(checkpoint);
    KILN_CHECK(metadata["kiln.model"] == o.model, "checkpoint '{}' is of model '{}', not '{}'", checkpoint,
               metadata["kiln.model"], o.model);
  }
  std::ofstream metrics;
  if (!o.metrics_path.empty()) {
    metrics.open(o.metrics_path, std::ios::app);
    KILN_CHECK(metrics.good(), "cannot open metrics file '{}'", o.metrics_path);
  }
  auto save = [&] {
    if (!checkpoint.empty()) trainer.save(checkpoint, {{"kiln.model", o.model}, {"kiln.seed", std::to_string(o.seed)}});
  };

  const bool tty = isatty(fileno(o.out)) != 0;
  fmt::print(o.out, "kiln train: {}\n  {} steps of batch {}, {} lr {}, seed {}, device {}{}\n", task.description, o.steps,
             o.batch, o.optimizer.name, o.optimizer.lr, o.seed, o.device,
             trainer.steps_done() > 0 ? fmt::format(", resumed at step {}", trainer.steps_done()) : "");
  std::fflush(o.out);

  const int64_t first = trainer.steps_done();
  KILN_CHECK(first < o.steps, "the checkpoint is already at step {}; ask for more --steps than that", first);
  BatchPrefetcher prefetcher([&](int64_t i) { return task.train_batch(first + i); }, o.steps - first);
  JobResult result;
  Clock::time_point loop_start = Clock::now();
  double ema_loss = NAN;
  std::string eval_note;
  for (int64_t step = first; step < o.steps; ++step) {
    std::optional<Batch> batch = prefetcher.next();
    KILN_CHECK(batch.has_value(), "the data loader ended early at step {}", step);
    double lr = trainer.current_lr();
    double loss = trainer.step({batch->inputs, batch->targets})[0].get(0);
    if (!std::isfinite(loss)) {
      if (tty) fmt::print(o.out, "\n");
      fail("loss is {} at step {}; stopped{}", loss, step + 1,
           checkpoint.empty() ? "" : fmt::format(" (last good checkpoint: '{}')", checkpoint));
    }
    ema_loss = std::isnan(ema_loss) ? loss : 0.9 * ema_loss + 0.1 * loss;
    result.final_loss = loss;
    const int64_t done = step + 1;
    double elapsed = std::chrono::duration<double>(Clock::now() - loop_start).count();
    double rate = static_cast<double>((done - first) * task.items_per_step) / elapsed;
    double eta = elapsed / static_cast<double>(done - first) * static_cast<double>(o.steps - done);

    nlohmann::json record{{"step", done}, {"loss", loss}, {"lr", lr}, {task.item_name + "_per_s", rate}};
    bool eval_now = done == o.steps || (o.eval_every > 0 && done % o.eval_every == 0);
    if (eval_now) {
      auto [name, value] = task.evaluate(trainer);
      result.eval_name = name;
      result.eval_metric = value;
      record["eval_" + name] = value;
      eval_note = name == "accuracy" ? fmt::format("  test acc {:.2f}%", 100 * value) : fmt::format("  eval ppl {:.2f}", value);
      save();
    }
    if (metrics.is_open()) metrics << record.dump() << "\n" << std::flush;
    std::string line = fmt::format("step {:>{}}/{}  loss {:.4f}{}  {:.0f} {}/s  eta {}", done,
                                   std::to_string(o.steps).size(), o.steps, ema_loss, eval_note, rate,
                                   task.item_name, format_duration(eta));
    if (tty) fmt::print(o.out, "\r{:<100}", line);
    else if (done % std::max<int64_t>(o.log_every, 1) == 0 || eval_now || done == first + 1) fmt::print(o.out, "{}\n", line);
    std::fflush(o.out);
  }
  if (tty) fmt::print(o.out, "\n");
  result.steps_done = trainer.steps_done();
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  fmt::print(o.out, "done: {} steps in {}, final loss {:.4f}, test {} {}\n", result.steps_done,
             format_duration(result.seconds), result.final_loss, result.eval_name,
             result.eval_name == "accuracy" ? fmt::format("{:.2f}%", 100 * result.eval_metric)
                                            : fmt::format("{:.2f}", result.eval_metric));
  if (!checkpoint.empty()) fmt::print(o.out, "checkpoint: {}\n", checkpoint);
  return result;
}

}  // namespace kiln::train
