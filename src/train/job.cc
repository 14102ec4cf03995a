#include "train/job.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <algorithm>

#include <nlohmann/json.hpp>

#include "device/device_runtime.h"
#include "distributed/comm_profile.h"
#include "distributed/env.h"
#include "distributed/process_group.h"
#include "ir/text.h"
#include "models/models.h"
#include "ops/optimizer/optimizers.h"
#include "runtime/profile.h"
#include "support/error.h"
#include "support/stopwatch.h"
#include "train/data/fashion_mnist.h"
#include "train/data/loader.h"
#include "train/data/text.h"
#include "train/checkpoint/reshard.h"
#include "train/checkpoint/safetensors.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {


bool is_onnx_model(const std::string& model) {
  return model.size() > 5 && model.compare(model.size() - 5, 5, ".onnx") == 0;
}

// Per data input of `forward`, in order: the bound random integers must stay under to be valid
// indices (token ids, labels): the smallest table, class count or depth an index derived from
// it reaches (gather, cross_entropy, one_hot); 2 for an integer input used otherwise.
std::vector<int64_t> data_index_bounds(const Graph& forward) {
  std::vector<uint64_t> from(forward.values.size(), 0);  // bit i: derives from data input i
  std::vector<int64_t> bounds;
  for (const GraphInput& in : forward.inputs) {
    if (in.role != Role::kData) continue;
    if (bounds.size() < 64) from[in.value] = uint64_t{1} << bounds.size();
    bounds.push_back(std::numeric_limits<int64_t>::max());
  }
  auto bound = [&](ValueId index, int64_t limit) {
    for (size_t i = 0; i < bounds.size() && i < 64; ++i)
      if (from[index] >> i & 1) bounds[i] = std::min(bounds[i], limit);
  };
  for (const Node& node : forward.nodes) {
    uint64_t deps = 0;
    for (ValueId in : node.inputs) deps |= from[in];
    for (ValueId out : node.outputs) from[out] = deps;
    if (node.op == Op::kGather)
      bound(node.inputs[1], forward.type(node.inputs[0]).shape[static_cast<size_t>(
                                normalize_axis(node.attrs.i("axis"), forward.type(node.inputs[0]).rank()))]);
    if (node.op == Op::kCrossEntropy) bound(node.inputs[1], forward.type(node.inputs[0]).shape.back());
    if (node.op == Op::kOneHot) bound(node.inputs[0], node.attrs.i("depth"));
  }
  for (int64_t& b : bounds)
    if (b == std::numeric_limits<int64_t>::max()) b = 2;
  return bounds;
}

// The options' model sizes with --seq among them.
models::ModelSizes sizes_of(models::ModelSizes sizes, int64_t seq) {
  if (seq > 0) sizes.seq = seq;
  return sizes;
}

// The sizes in the ranks' agreement check.
std::string sizes_text(const models::ModelSizes& s) {
  return fmt::format("{} {} {} {} {} {} {}", s.layers, s.d_model, s.heads, s.kv_heads, s.hidden, s.vocab, s.seq);
}

// The runtime of `--device`, or an error saying why there is none.
std::unique_ptr<DeviceRuntime> runtime_of(const std::string& device) {
  KILN_CHECK(device == "cpu" || device == "cuda", "unknown device '{}' (expected cpu or cuda)", device);
  try {
    return device_runtime(device == "cuda" ? Device::kCuda : Device::kCpu);
  } catch (const Error& e) {
    fail("--device {}: {}", device, e.what());
  }
}

// Where this process stands in a job: its rank of how many, and the group (null alone).
struct Place {
  int rank = 0;
  int world = 1;
  ProcessGroup* group = nullptr;
};

// Rows [rank * b, (rank + 1) * b) of a global batch's tensors (b = rows / world): this rank's
// slice. Alone: the batch itself.
Batch rows_of_rank(Batch global, const Place& place) {
  if (place.world == 1) return global;
  auto slice = [&](const Tensor& t) {
    const int64_t rows = t.shape()[0] / place.world;
    Shape shape = t.shape();
    shape[0] = rows;
    Tensor out(TensorType{t.dtype(), shape});
    std::memcpy(out.raw(), t.raw() + out.bytes() * static_cast<size_t>(place.rank), out.bytes());
    return out;
  };
  return Batch{slice(global.inputs), slice(global.targets)};
}

// The task: how to make batch `step`, how to evaluate, what the model is.
struct Task {
  Graph forward;
  std::vector<Tensor> init;                    // the params, in graph order
  std::map<std::string, Tensor> initial_state;  // state starting elsewhere than 0 (BatchNorm's)
  // The data inputs of step `step`, in graph order.
  std::function<std::vector<Tensor>(int64_t step)> train_batch;
  // The metric's name and value, and how many batches it ran.
  struct Evaluation {
    std::string name;
    double value = 0;
    int64_t batches = 0;
  };
  std::function<Evaluation(const Trainer&)> evaluate;
  std::string description;
  int64_t items_per_step = 0;  // samples or tokens
  std::string item_name;
  int64_t batch = 0;  // the global batch
};

Task classification_task(const JobOptions& o, const Place& place) {
  KILN_CHECK(o.data == "fashion-mnist" || o.data.empty(),
             "model {} trains on fashion-mnist, got --data '{}'", o.model, o.data);
  FashionMnist fm = load_fashion_mnist(o.data_dir.empty() ? kFashionMnistDir : o.data_dir);
  Task t;
  t.forward = models::by_name(o.model, o.batch / place.world);  // this rank's slice of the batch
  t.init = models::init_params_fan_in(t.forward, o.seed);
  if (o.model == "cnn") {
    fm.train = fm.train.with_sample_shape(kFashionMnistImageShape);
    fm.test = fm.test.with_sample_shape(kFashionMnistImageShape);
  }
  auto batcher = std::make_shared<Batcher>(Batcher::training(fm.train, o.batch, o.seed));
  t.train_batch = [batcher, place](int64_t step) {
    Batch b = rows_of_rank(batcher->batch_at_step(step), place);
    return std::vector<Tensor>{b.inputs, b.targets};
  };
  auto test = std::make_shared<ClassificationDataset>(fm.test);
  const int64_t B = o.batch, limit = o.eval_batches;
  t.evaluate = [test, B, limit, place](const Trainer& trainer) {
    // The test set in order, or its first `limit` batches. Fixed-shape graph: the last partial
    // batch is padded with sample 0 and only real rows count.
    const int64_t n = test->size(), all = (n + B - 1) / B;
    const int64_t count = limit > 0 ? std::min(limit, all) : all;
    // In a group each rank takes its rows of every batch, and the counts are summed over ranks.
    const int64_t b = B / place.world, first_row = b * place.rank;
    auto rows_of = [&](int64_t i) { return std::min(B, n - i * B); };
    std::vector<Tensor> logits = trainer.evaluate_batches(
        count,
        [&](int64_t i) {
          std::vector<int64_t> idx;
          for (int64_t r = first_row; r < first_row + b; ++r) idx.push_back(r < rows_of(i) ? i * B + r : 0);
          Batch batch = test->gather(idx);
          return std::vector<Tensor>{batch.inputs, batch.targets};
        },
        1);
    const int64_t* labels = test->labels().data<int64_t>();
    int64_t correct = 0, total = 0;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t classes = logits[i].shape()[1];
      const float* l = logits[i].data<float>();
      for (int64_t r = first_row; r < std::min(first_row + b, rows_of(i)); ++r) {
        const float* row = l + (r - first_row) * classes;
        int64_t best = 0;
        for (int64_t k = 1; k < classes; ++k)
          if (row[k] > row[best]) best = k;
        correct += best == labels[i * B + r];
        ++total;
      }
    }
    const double all_correct = trainer.reduce_over_ranks(static_cast<double>(correct));
    const double all_rows = trainer.reduce_over_ranks(static_cast<double>(total));
    return Task::Evaluation{"accuracy", all_correct / all_rows, count};
  };
  t.description = fmt::format("{} on Fashion-MNIST ({} train / {} test images)", o.model,
                              fm.train.size(), fm.test.size());
  t.items_per_step = o.batch;
  t.item_name = "samples";
  t.batch = o.batch;
  return t;
}

// A text (byte-tokenized) or .tok file's tokens, each checked against `vocab`, as batchers of
// B windows of T: the first 90% to train on, the last 10% held out.
struct TextData {
  std::string path;
  size_t tokens = 0;
  std::shared_ptr<TokenBatcher> train, eval;
};
TextData load_text(const std::string& path, int64_t vocab, int64_t batch, int64_t seq) {
  std::vector<int32_t> tokens;
  if (path.size() > 4 && path.substr(path.size() - 4) == ".tok") tokens = read_token_file(path);
  else tokens = ByteTokenizer().encode(read_text_file(path));
  for (int32_t tok : tokens)
    KILN_CHECK(tok >= 0 && tok < vocab, "token {} in '{}' is outside the model's vocabulary of {}", tok, path, vocab);
  // Hold out the last 10% for evaluation.
  int64_t split = static_cast<int64_t>(tokens.size()) * 9 / 10;
  KILN_CHECK(split > seq + 1 && static_cast<int64_t>(tokens.size()) - split > seq + 1,
             "'{}' has {} tokens: too few for sequences of {} (need more than {})", path, tokens.size(), seq,
             10 * (seq + 2));
  TextData d{path, tokens.size(), nullptr, nullptr};
  d.train = std::make_shared<TokenBatcher>(std::vector<int32_t>(tokens.begin(), tokens.begin() + split), batch, seq);
  d.eval = std::make_shared<TokenBatcher>(std::vector<int32_t>(tokens.begin() + split, tokens.end()), batch, seq);
  return d;
}

// A step's data inputs from a batch of a dataset.
using Bind = std::function<std::vector<Tensor>(const Batch&)>;
std::vector<Tensor> inputs_and_targets(const Batch& b) { return {b.inputs, b.targets}; }

// The perplexity of `count` held-out windows: the same windows at every evaluation, enqueued back
// to back; the losses are read once, at the end. In a group each rank runs its rows, and the
// step's loss is their mean.
Task::Evaluation held_out_perplexity(const Trainer& trainer, const TokenBatcher& eval, int64_t count, uint64_t seed,
                                     const Place& place, const Bind& bind) {
  std::vector<Tensor> losses = trainer.evaluate_batches(
      count, [&](int64_t i) { return bind(rows_of_rank(eval.random_batch(seed + 1, i), place)); });
  double total = 0;
  for (const Tensor& loss : losses) total += loss.get(0);
  return Task::Evaluation{"perplexity", std::exp(total / static_cast<double>(count)), count};
}

Task language_model_task(const JobOptions& o, const Place& place) {
  const models::ModelSizes sizes = sizes_of(o.sizes, o.seq);
  const models::LanguageModelInfo config = models::language_model_info(o.model, sizes);
  KILN_CHECK(o.data != "fashion-mnist" && o.data != "random", "model {} is a language model: give --data a text or "
             ".tok file", o.model);
  // The batchers draw the global batch; the model takes this rank's rows.
  const TextData text = load_text(o.data.empty() ? kDefaultTextPath : o.data, config.vocab, o.batch, config.seq);
  Task t;
  t.forward = models::by_name(o.model, o.batch / place.world, sizes);
  t.init = models::init_language_model(t.forward, o.model, o.seed, sizes);
  uint64_t seed = o.seed;
  auto train_tokens = text.train;
  t.train_batch = [train_tokens, seed, place](int64_t step) {
    return inputs_and_targets(rows_of_rank(train_tokens->random_batch(seed, step), place));
  };
  int64_t eval_batches = o.eval_batches > 0 ? o.eval_batches : 10;
  auto eval_tokens = text.eval;
  t.evaluate = [eval_tokens, eval_batches, seed, place](const Trainer& trainer) {
    return held_out_perplexity(trainer, *eval_tokens, eval_batches, seed, place, inputs_and_targets);
  };
  t.description = fmt::format("{} ({} layers, d={}, T={}, vocab {}) on '{}' ({} tokens)", o.model, config.layers,
                              config.d_model, config.seq, config.vocab, text.path, text.tokens);
  t.items_per_step = o.batch * config.seq;
  t.item_name = "tokens";
  t.batch = o.batch;
  return t;
}

// An ONNX model's forward graph, its params' initial values (in graph order) and its state's.
struct ImportedForward {
  Graph forward;
  std::vector<Tensor> params;
  std::map<std::string, Tensor> state;
};
ImportedForward import_forward(const std::string& path, const onnx::ImportOptions& options) {
  onnx::ImportedModel model = onnx::import_onnx(path, options);
  ImportedForward out{std::move(model.graph), {}, {}};
  for (const GraphInput& in : out.forward.inputs) {
    const std::string& name = out.forward.value(in.value).name;
    if (in.role == Role::kParam) out.params.push_back(model.initial_values.at(name));
    if (in.role == Role::kState) out.state[name] = model.initial_values.at(name);
  }
  return out;
}

// Random values for the data inputs of `forward`: floats uniform in [-1, 1), integers in
// [0, bounds[i]) (data_index_bounds: valid indices), from `seed`.
std::vector<Tensor> random_data(const Graph& forward, const std::vector<int64_t>& bounds, uint64_t seed) {
  std::vector<Tensor> data;
  for (const GraphInput& in : forward.inputs) {
    if (in.role != Role::kData) continue;
    const TensorType& type = forward.type(in.value);
    const bool integer = !is_float(type.dtype);
    const double high = integer ? static_cast<double>(bounds[data.size()]) : 1.0;
    data.push_back(random_tensor(type, seed * 7919 + 31 * data.size() + 1, integer ? 0.0 : -1.0, high));
  }
  return data;
}

// The mean of output 0 (the loss) over `count` batches.
Task::Evaluation mean_loss(const Trainer& trainer, int64_t count, const std::function<std::vector<Tensor>(int64_t)>& batch) {
  std::vector<Tensor> losses = trainer.evaluate_batches(count, batch);
  double total = 0;
  for (const Tensor& loss : losses) total += loss.get(0);
  return Task::Evaluation{"loss", total / static_cast<double>(count), count};
}

// An ONNX model trained on the dataset its data inputs bind to (bind_data_inputs).
Task onnx_task(const JobOptions& o, const Place& place) {
  KILN_CHECK(place.world == 1, "an ONNX model trains in one process (its batch is the file's): drop kiln launch");
  KILN_CHECK(o.seq == 0 && o.sizes.layers == 0 && o.sizes.d_model == 0 && o.sizes.heads == 0 &&
                 o.sizes.kv_heads == 0 && o.sizes.hidden == 0 && o.sizes.vocab == 0 && o.sizes.seq == 0,
             "an ONNX model's sizes are the file's: drop --seq, --layers, --d-model, --heads, --kv-heads, --hidden "
             "and --vocab");
  ImportedForward m = import_forward(o.model, o.onnx);
  Task t;
  t.forward = std::move(m.forward);
  t.init = std::move(m.params);
  t.initial_state = std::move(m.state);
  const Graph& g = t.forward;
  const DataBinding binding = bind_data_inputs(g, o.data);
  std::vector<TensorType> types;
  for (const GraphInput& in : g.inputs)
    if (in.role == Role::kData) types.push_back(g.type(in.value));
  const int64_t batch = types.empty() || types[0].rank() == 0 ? 1 : types[0].shape[0];
  KILN_CHECK(o.batch == 0 || o.batch == batch,
             "--batch {}: model '{}' takes batches of {} (its inputs' first dim; export it with a dynamic batch dim "
             "and give --shape NAME=N for another)", o.batch, o.model, batch);
  // The step's inputs from a dataset's batch, each shaped as its input.
  const std::vector<InputRole> roles = binding.roles;
  const Bind bind = [roles, types](const Batch& b) {
    std::vector<Tensor> data;
    for (size_t i = 0; i < roles.size(); ++i) {
      const bool from_inputs = roles[i] == InputRole::kImages || roles[i] == InputRole::kTokens;
      data.push_back((from_inputs ? b.inputs : b.targets).reshaped(types[i].shape));
    }
    return data;
  };
  const uint64_t seed = o.seed;
  std::string what;
  if (binding.data == "random") {
    const std::vector<int64_t> bounds = data_index_bounds(g);
    auto forward = std::make_shared<Graph>(t.forward);  // the lambdas outlive this Task's moves
    t.train_batch = [forward, bounds, seed](int64_t step) { return random_data(*forward, bounds, seed * 1000003 + step); };
    const int64_t count = o.eval_batches > 0 ? o.eval_batches : 10;
    t.evaluate = [forward, bounds, seed, count](const Trainer& trainer) {
      return mean_loss(trainer, count, [&](int64_t i) { return random_data(*forward, bounds, ~seed - i); });
    };
    what = "random inputs";
    t.items_per_step = batch;
    t.item_name = "samples";
  } else if (binding.data == "fashion-mnist") {
    FashionMnist fm = load_fashion_mnist(o.data_dir.empty() ? kFashionMnistDir : o.data_dir);
    auto batcher = std::make_shared<Batcher>(Batcher::training(fm.train, batch, seed));
    t.train_batch = [batcher, bind](int64_t step) { return bind(batcher->batch_at_step(step)); };
    // The test set's full batches in order (a partial one would count padding in the loss).
    auto test = std::make_shared<Batcher>(Batcher::evaluation(fm.test, batch));
    const int64_t full = fm.test.size() / batch;
    const int64_t count = o.eval_batches > 0 ? std::min(o.eval_batches, full) : full;
    t.evaluate = [test, bind, count](const Trainer& trainer) {
      return mean_loss(trainer, count, [&](int64_t i) { return bind(test->batch(0, i)); });
    };
    what = fmt::format("Fashion-MNIST ({} train / {} test images)", fm.train.size(), fm.test.size());
    t.items_per_step = batch;
    t.item_name = "samples";
  } else {
    // Text: the tokens' (and next tokens') index bounds are the model's vocabulary.
    const std::vector<int64_t> bounds = data_index_bounds(g);
    int64_t vocab = std::numeric_limits<int64_t>::max(), seq = 0;
    for (size_t i = 0; i < roles.size(); ++i) {
      vocab = std::min(vocab, bounds[i]);
      seq = types[i].shape[1];
    }
    const TextData text = load_text(binding.data, vocab, batch, seq);
    auto train_tokens = text.train, eval_tokens = text.eval;
    t.train_batch = [train_tokens, seed, bind](int64_t step) { return bind(train_tokens->random_batch(seed, step)); };
    const int64_t count = o.eval_batches > 0 ? o.eval_batches : 10;
    t.evaluate = [eval_tokens, count, seed, place, bind](const Trainer& trainer) {
      return held_out_perplexity(trainer, *eval_tokens, count, seed, place, bind);
    };
    what = fmt::format("'{}' ({} tokens, T={}, vocab {})", text.path, text.tokens, seq, vocab);
    t.items_per_step = batch * seq;
    t.item_name = "tokens";
  }
  t.description = fmt::format("{} (ONNX) on {}", o.model, what);
  t.batch = batch;
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

DeviceChoice choose_device(const std::string& device, const std::string& amp, const DeviceAvailability& cuda) {
  KILN_CHECK(device == "auto" || device == "cpu" || device == "cuda", "unknown device '{}' (expected auto, cpu or cuda)",
             device);
  KILN_CHECK(amp == "auto" || amp == "off" || amp == "bf16" || amp == "f16",
             "unknown amp mode '{}' (expected auto, off, bf16 or f16)", amp);
  DeviceChoice c;
  std::string device_why = "as asked", amp_why = "as asked";
  c.device = device;
  if (device == "auto") {
    const bool gpu = cuda.built && cuda.count > 0;
    c.device = gpu ? "cuda" : "cpu";
    device_why = "auto: " + cuda.description;
  }
  c.amp = amp;
  if (amp == "auto") {
    if (c.device == "cpu") {
      c.amp = "off";
      amp_why = "auto: f32 on the CPU";
    } else {
      // A device of compute capability 8.0 or more (A100, H100) has bf16 tensor cores.
      const int cc = cuda.compute_capability;
      c.amp = cc >= 80 ? "bf16" : "off";
      amp_why = cc >= 80 ? fmt::format("auto: sm_{} has bf16", cc)
                         : cc > 0 ? fmt::format("auto: sm_{} has no bf16 (it needs sm_80)", cc) : "auto: no CUDA device";
    }
  }
  c.note = fmt::format("device {} ({}), amp {} ({})", c.device, device_why, c.amp, amp_why);
  return c;
}

std::string choose_shard_mode(const std::string& shard, int world_size, int64_t params, const std::string& optimizer,
                              size_t device_bytes, std::string* note) {
  KILN_CHECK(shard == "auto" || shard == "none" || shard == "dp" || shard == "zero1" || shard == "zero2" ||
                 shard == "zero3",
             "unknown --shard '{}' (expected auto, dp, zero1, zero2 or zero3)", shard);
  KILN_CHECK(world_size > 1 || shard == "auto" || shard == "none",
             "--shard {} needs several processes (kiln launch -n N -- train ...)", shard);
  std::string mode = shard;
  // f32 param and gradient, and the optimizer's state like the param (AdamW's m and v)
  const optim::OptimizerDef& def = optim::optimizer_def(optimizer);
  const double state = (8.0 + 4.0 * def.state_per_param_element()) * static_cast<double>(params);
  if (shard == "auto") mode = world_size == 1 ? "none" : state <= 0.25 * static_cast<double>(device_bytes) ? "dp" : "zero3";
  if (note)
    *note = shard != "auto" ? mode
            : world_size == 1 ? "none (one process)"
            : fmt::format("{} (auto: params, gradients and {} state {} {} a quarter of the device's {})", mode,
                          def.name, format_bytes(static_cast<size_t>(state)), mode == "dp" ? "within" : "over", format_bytes(device_bytes));
  return mode;
}

std::string step_fingerprint(const Trainer& trainer, const std::string& extra) {
  const std::string text = print(trainer.program().graph) + extra + KILN_VERSION + __VERSION__ + __DATE__ + __TIME__;
  return fmt::format("{:016x}", std::hash<std::string>{}(text));
}

namespace {

// An error in a group: when a rank was lost meanwhile, say so first (the engine's own message,
// "connection reset by peer", does not name it). The store may learn of the loss a moment after
// the engine does: up to 2 s.
[[noreturn]] void fail_in_group(ProcessGroup* group, const Error& error) {
  for (int i = 0; group != nullptr && i < 20; ++i) {
    if (std::optional<int> lost = group->store().lost_rank())
      fail("rank {} was lost ({}); rank {} stops: {}", *lost, group->store().lost_reason(), group->rank(), error.what());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw error;
}

}  // namespace

std::unique_ptr<ProcessGroup> join_group(const std::string& device) {
  const std::optional<DistEnv> env = dist_env_from_environment();
  if (!env || env->world_size == 1) return nullptr;
  return init_process_group(*env, device == "cuda" ? Device::kCuda : Device::kCpu);
}

PassOptions passes_for(PassOptions passes, ProcessGroup* group, const DeviceRuntime& runtime) {
  if (group && !passes.costs) passes.costs = comm_cost_model(*group, runtime);
  // --offload auto fits the step into the device (the CPU's memory is the host's: nothing moves).
  if (runtime.device() != Device::kCpu && !passes.device_memory) passes.device_memory = runtime.memory_info().total_bytes;
  return passes;
}

namespace {

// The job once the device is chosen and, in a group, the group joined.
JobResult run_job(JobOptions o, const DeviceChoice& choice, ProcessGroup* group, const Stopwatch& run_time) {
  Place place;
  if (group) place = Place{group->rank(), group->world_size(), group};
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> sink(nullptr, &std::fclose);
  if (place.rank != 0) {
    sink.reset(std::fopen("/dev/null", "w"));
    KILN_CHECK(sink != nullptr, "cannot open /dev/null for rank {}'s output", place.rank);
    o.out = sink.get();
  }
  const bool tty = isatty(fileno(o.out)) != 0;
  // First, before anything slow: which device and precision, and why.
  fmt::print(o.out, "kiln train: {}\n", choice.note);
  std::fflush(o.out);
  const std::unique_ptr<DeviceRuntime> runtime = runtime_of(o.device);
  const bool on_cuda = runtime->device() == Device::kCuda;
  const bool from_onnx = is_onnx_model(o.model);
  KILN_CHECK(o.steps > 0, "--steps must be > 0, got {}", o.steps);
  KILN_CHECK(o.batch > 0 || (from_onnx && o.batch == 0), "--batch must be > 0, got {}", o.batch);
  KILN_CHECK(o.eval_batches >= 0, "--eval-batches must be >= 0 (0: the default), got {}", o.eval_batches);
  KILN_CHECK(from_onnx || std::find(models::model_names().begin(), models::model_names().end(), o.model) != models::model_names().end(),
             "unknown model '{}' (expected {}, or an ONNX file MODEL.onnx)", o.model, models::model_names_text());
  KILN_CHECK(o.batch % place.world == 0, "--batch {} (the global batch) does not split over {} ranks", o.batch,
             place.world);
  validate(o.optimizer);
  Task task = from_onnx                              ? onnx_task(o, place)
              : models::is_language_model(o.model) ? language_model_task(o, place)
                                                   : classification_task(o, place);
  if (!o.init_from.empty()) {
    // Params by name (kiln import-hf writes such a file; any checkpoint's params do too).
    const SafetensorsFile file = load_safetensors(o.init_from);
    size_t p = 0;
    for (const GraphInput& in : task.forward.inputs) {
      if (in.role != Role::kParam) continue;
      const Value& v = task.forward.value(in.value);
      auto it = file.tensors.find(v.name);
      KILN_CHECK(it != file.tensors.end(), "--init '{}' has no param '{}' of model {}", o.init_from, v.name, o.model);
      KILN_CHECK(it->second.type() == v.type, "--init '{}': '{}' is {}, model {} needs {}", o.init_from, v.name,
                 to_string(it->second.type()), o.model, to_string(v.type));
      task.init.at(p++) = it->second;
    }
  }
  int64_t param_count = 0;
  for (const Tensor& t : task.init) param_count += t.numel();
  // A group that its launcher restarted after a failure (kiln launch --max-restarts, torchrun)
  // resumes from its last checkpoint, if it wrote one before it failed; restarted on fewer
  // processes (--min-nproc) it may be down to one, where a shard mode means nothing.
  const std::optional<DistEnv> env = dist_env_from_environment();
  const int restart = env ? env->restart_count : 0;
  std::string shard_note;
  const std::string shard = choose_shard_mode(
      place.world == 1 && restart > 0 ? "none" : o.shard, place.world, param_count, o.optimizer.name,
      on_cuda ? runtime->memory_info().total_bytes : size_t{64} << 30, &shard_note);
  if (place.world > 1)
    fmt::print(o.out, "  {} ranks ({} on each), global batch {} ({} a rank), shard {}\n", place.world,
               group->communicator()->engine(), o.batch, o.batch / place.world, shard_note);

  JobResult result;
  result.device = o.device;
  result.amp = o.optimizer.amp;
  result.world_size = place.world;
  result.shard = shard;
  result.setup_seconds = run_time.seconds();
  Stopwatch phase;
  ExecutorOptions executor_options;
  executor_options.device = runtime->device();
  if (group) executor_options.communicator = group->communicator().get();
  const ShardingOptions sharding{parse_shard_mode(shard), place.world};
  Trainer trainer(task.forward, o.optimizer, task.init, executor_options, passes_for(o.passes, group, *runtime),
                  sharding);
  task.init.clear();  // the trainer has its own copy on its device
  for (const auto& [name, value] : task.initial_state) trainer.set_initial_value(name, value);
  // Every rank compiled the same step (same model, batch, flags and build), or none goes on.
  if (group)
    group->check_agreement("the compiled step (model, batch, flags, build)",
                           step_fingerprint(trainer, fmt::format("{} {} {} {} {}", o.model, o.batch, o.seq, sizes_text(o.sizes), o.seed)));
  // Checkpoints: one file alone; in a group one per rank (its shards), named for the group's
  // size, and on request a consolidated one. A group of any size and mode resumes from any of
  // them (checkpoint/reshard.h).
  const std::string checkpoint =
      o.checkpoint_dir.empty() ? "" : checkpoint_path(o.checkpoint_dir, place.rank, place.world);
  const std::string consolidated = o.checkpoint_dir.empty() ? "" : consolidated_path(o.checkpoint_dir);
  KILN_CHECK(!o.consolidate || !o.checkpoint_dir.empty(), "--consolidate needs --checkpoint-dir");
  if (!checkpoint.empty()) std::filesystem::create_directories(o.checkpoint_dir);
  KILN_CHECK(!o.resume || !checkpoint.empty(), "--resume needs --checkpoint-dir");
  if (o.resume || (restart > 0 && !checkpoint.empty())) {
    const std::optional<CheckpointFiles> from = find_checkpoint(o.checkpoint_dir, place.world);
    KILN_CHECK(from || !o.resume, "--resume: no checkpoint in '{}' (last.safetensors, last.rank*-of-N.safetensors or "
               "consolidated.safetensors)", o.checkpoint_dir);
    if (from) {
      auto metadata = trainer.load(from->paths);
      KILN_CHECK(metadata["kiln.model"] == o.model, "checkpoint '{}' is of model '{}', not '{}'", from->paths[0],
                 metadata["kiln.model"], o.model);
      fmt::print(o.out, "  {}resumed from {} at step {} (written by {} rank{}, shard {})\n",
                 restart > 0 ? fmt::format("restart {}: ", restart) : "",
                 from->world_size == 1 ? from->paths[0] : fmt::format("{} rank files", from->world_size),
                 from->steps_done, from->world_size, from->world_size == 1 ? "" : "s", from->shard);
    } else {
      fmt::print(o.out, "  restart {}: no checkpoint in '{}' yet: starting over\n", restart, o.checkpoint_dir);
    }
  }
  result.compile_seconds = phase.lap();
  std::ofstream metrics;
  if (!o.metrics_path.empty()) {
    metrics.open(o.metrics_path, std::ios::app);
    KILN_CHECK(metrics.good(), "cannot open metrics file '{}'", o.metrics_path);
  }
  auto save = [&] {
    if (checkpoint.empty()) return;
    const Stopwatch saving;
    std::map<std::string, std::string> metadata = {{"kiln.model", o.model}, {"kiln.seed", std::to_string(o.seed)}};
    if (o.model.rfind("llama", 0) == 0) {  // what the params' shapes do not say (kiln export-hf reads them)
      metadata["kiln.heads"] = std::to_string(o.sizes.heads > 0 ? o.sizes.heads : models::llama_config(o.model).heads);
      metadata["kiln.seq"] = std::to_string(models::language_model_info(o.model, sizes_of(o.sizes, o.seq)).seq);
    }
    keep_previous_checkpoint(o.checkpoint_dir, place.rank, place.world);
    trainer.save(checkpoint, metadata);
    if (o.consolidate) trainer.save_consolidated(consolidated, metadata);
    result.checkpoint_seconds += saving.seconds();
  };

  fmt::print(o.out, "  {}\n  {} steps of batch {}, {} lr {}, seed {}{}\n", task.description, o.steps, task.batch,
             o.optimizer.name, o.optimizer.lr, o.seed,
             trainer.steps_done() > 0 ? fmt::format(", resumed at step {}", trainer.steps_done()) : "");
  if (on_cuda)
    fmt::print(o.out, "  {}: params and state {}, step arena and outputs {}\n", runtime->name(),
               format_bytes(trainer.param_and_state_bytes()), format_bytes(trainer.step_executor().device_bytes()));
  std::fflush(o.out);

  const int64_t first = trainer.steps_done();
  KILN_CHECK(first < o.steps, "the checkpoint is already at step {}; ask for more --steps than that", first);
  Prefetcher<std::vector<Tensor>> prefetcher([&](int64_t i) { return task.train_batch(first + i); }, o.steps - first);
  const Stopwatch loop_time;
  double ema_loss = NAN;
  std::string eval_note;
  // On CUDA the loss is read only at the progress interval (and at evaluations and the end), so
  // the host issues steps ahead of the device in between; the CPU reads every step.
  std::vector<double> unread_lrs;
  const int64_t interval = std::max<int64_t>(o.log_every, 1);
  for (int64_t step = first; step < o.steps; ++step) {
    std::optional<std::vector<Tensor>> batch = prefetcher.next();
    KILN_CHECK(batch.has_value(), "the data loader ended early at step {}", step);
    unread_lrs.push_back(trainer.current_lr());
    trainer.step(*batch);
    const int64_t done = step + 1;
    bool eval_now = done == o.steps || (o.eval_every > 0 && done % o.eval_every == 0);
    if (on_cuda && !eval_now && done != first + 1 && done % interval != 0) continue;

    std::vector<double> losses = trainer.take_losses();
    KILN_CHECK(losses.size() == unread_lrs.size(), "internal: {} losses for {} steps", losses.size(), unread_lrs.size());
    if (done == first + 1) {
      // take_losses() waited for it: the step has run.
      result.first_step_seconds = run_time.seconds();
      fmt::print(o.out, "  first step done {:.2f} s after start (setup {:.2f} s, compile {:.2f} s, the step {:.2f} s)\n",
                 result.first_step_seconds, result.setup_seconds, result.compile_seconds, loop_time.seconds());
    }
    double elapsed = loop_time.seconds();
    double rate = static_cast<double>((done - first) * task.items_per_step) / elapsed;
    double eta = elapsed / static_cast<double>(done - first) * static_cast<double>(o.steps - done);
    std::vector<nlohmann::json> records;
    for (size_t k = 0; k < losses.size(); ++k) {
      const int64_t number = done - static_cast<int64_t>(losses.size() - k) + 1;
      const double loss = losses[k];
      if (!std::isfinite(loss)) {
        if (tty) fmt::print(o.out, "\n");
        fail("loss is {} at step {}; stopped{}", loss, number,
             checkpoint.empty() ? "" : fmt::format(" (last good checkpoint: '{}')", checkpoint));
      }
      ema_loss = std::isnan(ema_loss) ? loss : 0.9 * ema_loss + 0.1 * loss;
      result.final_loss = loss;
      records.push_back(nlohmann::json{{"step", number}, {"loss", loss}, {"lr", unread_lrs[k]}, {task.item_name + "_per_s", rate}});
    }
    unread_lrs.clear();
    if (eval_now) {
      const Stopwatch evaluating;
      const Task::Evaluation e = task.evaluate(trainer);
      result.eval_seconds += evaluating.seconds();
      ++result.evaluations;
      result.eval_name = e.name;
      result.eval_metric = e.value;
      result.eval_batches = e.batches;
      records.back()["eval_" + e.name] = e.value;
      eval_note = e.name == "accuracy"     ? fmt::format("  test acc {:.2f}%", 100 * e.value)
                  : e.name == "perplexity" ? fmt::format("  eval ppl {:.2f}", e.value)
                                           : fmt::format("  eval {} {:.4f}", e.name, e.value);
      save();
    }
    if (metrics.is_open())
      for (const nlohmann::json& record : records) metrics << record.dump() << "\n" << std::flush;
    std::string line = fmt::format("step {:>{}}/{}  loss {:.4f}{}  {:.0f} {}/s  eta {}", done,
                                   std::to_string(o.steps).size(), o.steps, ema_loss, eval_note, rate,
                                   task.item_name, format_duration(eta));
    if (tty) fmt::print(o.out, "\r{:<100}", line);
    else if (done % interval == 0 || eval_now || done == first + 1) fmt::print(o.out, "{}\n", line);
    std::fflush(o.out);
  }
  if (tty) fmt::print(o.out, "\n");
  result.steps_done = trainer.steps_done();
  result.step_seconds = loop_time.seconds() - result.eval_seconds - result.checkpoint_seconds;
  result.seconds = run_time.seconds();
  fmt::print(o.out, "done: {} steps in {}, final loss {:.4f}, test {} {}, evaluation {:.2f} s\n", result.steps_done,
             format_duration(result.seconds), result.final_loss, result.eval_name,
             result.eval_name == "accuracy" ? fmt::format("{:.2f}%", 100 * result.eval_metric)
                                            : fmt::format("{:.2f}", result.eval_metric),
             result.eval_seconds);
  fmt::print(o.out,
             "  wall time {:.2f} s: setup {:.2f} s, compile {:.2f} s, steps {:.2f} s ({:.1f} ms/step), evaluation "
             "{:.2f} s ({} x {} batches, compile {:.2f} s), checkpoints {:.2f} s\n",
             result.seconds, result.setup_seconds, result.compile_seconds, result.step_seconds,
             1e3 * result.step_seconds / static_cast<double>(o.steps - first), result.eval_seconds, result.evaluations,
             result.eval_batches, trainer.eval_compile_seconds(), result.checkpoint_seconds);
  if (!checkpoint.empty())
    fmt::print(o.out, "checkpoint: {}{}\n",
               place.world == 1 ? checkpoint
                                : (std::filesystem::path(o.checkpoint_dir) /
                                   fmt::format("last.rank*-of-{}.safetensors", place.world)).string(),
               o.consolidate ? fmt::format(" and {}", consolidated) : "");
  return result;
}

}  // namespace

namespace {

constexpr const char* kFashionMnistBinds =
    "Fashion-MNIST binds images f32 (B, 1, 28, 28), (B, 28, 28) or (B, 784) and labels i64 (B,)";
constexpr const char* kTextBinds = "a text binds token ids i64 (B, T) and, to a second such input, their next tokens";

// `name` (type) of each of `inputs`, for an error: "'mask' (f32[4,8]), 'labels' (i64[4])".
std::string describe(const Graph& g, const std::vector<ValueId>& inputs) {
  std::string out;
  for (ValueId v : inputs) out += fmt::format("{}'{}' ({})", out.empty() ? "" : ", ", g.value(v).name, to_string(g.type(v)));
  return out;
}

// The roles of `data` (the graph's data inputs) for Fashion-MNIST, or why none.
std::optional<std::vector<InputRole>> fashion_mnist_roles(const Graph& g, const std::vector<ValueId>& data,
                                                          std::string* why) {
  std::vector<InputRole> roles;
  std::vector<ValueId> unbound;
  int images = 0, labels = 0;
  const int64_t b = data.empty() || g.type(data[0]).rank() == 0 ? -1 : g.type(data[0]).shape[0];
  for (ValueId v : data) {
    const TensorType& t = g.type(v);
    const Shape& s = t.shape;
    const bool one_batch = t.rank() > 0 && s[0] == b;
    const bool image = t.dtype == DType::kF32 && one_batch &&
                       (s == Shape{b, 1, 28, 28} || s == Shape{b, 28, 28} || s == Shape{b, kFashionMnistPixels});
    if (image && images == 0) {
      ++images;
      roles.push_back(InputRole::kImages);
    } else if (t.dtype == DType::kI64 && t.rank() == 1 && one_batch && labels == 0) {
      ++labels;
      roles.push_back(InputRole::kLabels);
    } else {
      unbound.push_back(v);
    }
  }
  if (!unbound.empty()) *why = fmt::format("cannot bind {} ({})", describe(g, unbound), kFashionMnistBinds);
  else if (images == 0) *why = fmt::format("no input takes the images ({})", kFashionMnistBinds);
  else return roles;
  return std::nullopt;
}

// The roles of `data` for a text, or why none.
std::optional<std::vector<InputRole>> text_roles(const Graph& g, const std::vector<ValueId>& data, std::string* why) {
  std::vector<InputRole> roles;
  std::vector<ValueId> unbound;
  const Shape first = data.empty() ? Shape{} : g.type(data[0]).shape;
  for (ValueId v : data) {
    const TensorType& t = g.type(v);
    if (t.dtype == DType::kI64 && t.rank() == 2 && t.shape == first && roles.size() < 2)
      roles.push_back(roles.empty() ? InputRole::kTokens : InputRole::kNextTokens);
    else
      unbound.push_back(v);
  }
  if (!unbound.empty()) *why = fmt::format("cannot bind {} ({})", describe(g, unbound), kTextBinds);
  else if (roles.empty()) *why = fmt::format("no input takes the tokens ({})", kTextBinds);
  else return roles;
  return std::nullopt;
}

}  // namespace

DataBinding bind_data_inputs(const Graph& forward, const std::string& data) {
  std::vector<ValueId> inputs;
  for (const GraphInput& in : forward.inputs)
    if (in.role == Role::kData) inputs.push_back(in.value);
  if (data == "random") return DataBinding{data, std::vector<InputRole>(inputs.size(), InputRole::kRandom)};
  std::string fashion_why, text_why;
  if (data == "fashion-mnist" || data.empty())
    if (auto roles = fashion_mnist_roles(forward, inputs, &fashion_why)) return DataBinding{"fashion-mnist", *roles};
  if (data != "fashion-mnist")
    if (auto roles = text_roles(forward, inputs, &text_why)) return DataBinding{data.empty() ? kDefaultTextPath : data, *roles};
  if (data == "fashion-mnist") fail("--data fashion-mnist: {}; --data random binds any inputs", fashion_why);
  if (!data.empty()) fail("--data '{}' (a text): {}; --data random binds any inputs", data, text_why);
  fail("no built-in dataset fits the model's inputs {}: {}; {}; give --data random (random inputs of their shapes)",
       describe(forward, inputs), kFashionMnistBinds, kTextBinds);
}

JobResult run_training_job(const JobOptions& options) {
  const Stopwatch run_time;
  JobOptions o = options;
  const bool any_auto = o.device == "auto" || o.optimizer.amp == "auto";
  const DeviceChoice choice =
      choose_device(o.device, o.optimizer.amp, any_auto ? device_availability(Device::kCuda) : DeviceAvailability{});
  o.device = choice.device;
  o.optimizer.amp = choice.amp;
  // In a group: join it first (on CUDA that picks this rank's GPU, before the runtime takes the
  // current one); only rank 0 prints.
  const std::unique_ptr<ProcessGroup> group = join_group(o.device);
  try {
    return run_job(o, choice, group.get(), run_time);
  } catch (const Error& e) {
    fail_in_group(group.get(), e);
  }
}

namespace {

// Seconds since this process started (the kernel's start time, so it counts the dynamic loader
// and the CLI's re-exec too); falls back to 0 if /proc is unreadable.
double seconds_since_process_start() {
  std::ifstream stat("/proc/self/stat"), uptime("/proc/uptime");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  double up = 0;
  uptime >> up;
  size_t close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos || up <= 0) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return up - std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  return 0;
}

}  // namespace

double device_peak_flops(const std::string& name, const std::string& amp, std::string* note) {
  struct Peak {
    const char* match;
    const char* label;
    double half, tf32;  // dense tensor-core rates
  };
  // NVIDIA's datasheet numbers, dense (no sparsity). H200 has the H100 SXM's compute.
  static const Peak kPeaks[] = {
      {"H100 PCIe", "H100 PCIe", 756e12, 378e12}, {"H100 NVL", "H100 NVL", 835e12, 417.5e12},
      {"H100", "H100 SXM", 989e12, 494.7e12},     {"H200", "H200 (H100 SXM compute)", 989e12, 494.7e12},
      {"A100", "A100", 312e12, 156e12},
  };
  const bool half = amp == "bf16" || amp == "f16";
  for (const Peak& p : kPeaks) {
    if (name.find(p.match) == std::string::npos) continue;
    if (note) *note = fmt::format("{} dense {} peak {:.1f} TFLOP/s", p.label, half ? amp : "tf32", (half ? p.half : p.tf32) / 1e12);
    return half ? p.half : p.tf32;
  }
  if (note) *note = "peak unknown for this device (give --peak-tflops)";
  return 0;
}

namespace {

// The benchmark once the device is chosen and, in a group, the group joined.
BenchResult run_bench(BenchOptions o, ProcessGroup* group, double entered_s) {
  const int world = group ? group->world_size() : 1, rank = group ? group->rank() : 0;
  if (rank != 0) o.out = nullptr;
  KILN_CHECK(o.profile_path.empty() || world == 1, "--profile runs on one process (drop kiln launch; --timeline "
             "traces a group's steps)");
  const double group_joined_s = seconds_since_process_start();
  const std::unique_ptr<DeviceRuntime> runtime = runtime_of(o.device);
  const bool on_cuda = runtime->device() == Device::kCuda;
  const double runtime_s = seconds_since_process_start();
  const bool from_onnx = is_onnx_model(o.model);
  KILN_CHECK(from_onnx || std::find(models::model_names().begin(), models::model_names().end(), o.model) != models::model_names().end(),
             "unknown model '{}' (expected {}, or an ONNX file MODEL.onnx)", o.model, models::model_names_text());
  KILN_CHECK(o.profile_path.empty() || on_cuda, "--profile needs --device cuda (it times kernels with CUDA events)");
  KILN_CHECK(o.timeline_path.empty() || on_cuda, "--timeline needs --device cuda (it traces the GPU's work)");
  KILN_CHECK(o.timeline_path.empty() || runtime->can_trace(),
             "--timeline: this build cannot trace (no CUPTI at configure time); --profile times kernels without it");
  KILN_CHECK(o.timeline_path.empty() || o.cuda_graphs,
             "--timeline traces graph-replayed steps: drop --no-cuda-graphs (--profile times kernels without graphs)");
  KILN_CHECK(o.timeline_steps > 0, "--timeline-steps must be > 0, got {}", o.timeline_steps);
  KILN_CHECK(o.batch > 0 && o.steps > 0 && o.untimed_steps >= 0,
             "--batch and --steps must be > 0 and --untimed-steps >= 0, got {}, {}, {}", o.batch, o.steps, o.untimed_steps);
  KILN_CHECK(o.batch % world == 0, "--batch {} (the global batch) does not split over {} ranks", o.batch, world);
  BenchResult r;
  r.world_size = world;
  const models::ModelSizes sizes = sizes_of(o.sizes, o.seq);
  Graph forward;
  std::vector<Tensor> init;
  std::map<std::string, Tensor> onnx_state;  // an ONNX model's own state (BatchNorm statistics)
  int64_t int_high = 10, layers = 0, seq = 1, d_model = 0;
  std::vector<int64_t> index_bounds;  // per data input: integers are drawn from [0, bound)
  if (from_onnx) {
    KILN_CHECK(world == 1, "an ONNX model benchmarks in one process (its batch is the file's)");
    ImportedForward model = import_forward(o.model, o.onnx);
    forward = std::move(model.forward);
    init = std::move(model.params);
    onnx_state = std::move(model.state);
    index_bounds = data_index_bounds(forward);
    const Value& first = forward.value(forward.inputs.front().value);
    r.tokens_per_step = first.type.rank() > 0 ? first.type.shape[0] : 1;
  } else if (models::is_language_model(o.model)) {
    forward = models::by_name(o.model, o.batch / world, sizes);  // this rank's rows
    const models::LanguageModelInfo config = models::language_model_info(o.model, sizes);
    int_high = config.vocab;
    layers = config.layers;
    seq = config.seq;
    d_model = config.d_model;
    // zero3 (and auto choosing it): each rank draws only its shards (6 s of GPT-2 XL's start on
    // 16 cores drawn whole).
    int64_t params = 0;
    for (const GraphInput& in : forward.inputs)
      if (in.role == Role::kParam) params += forward.type(in.value).numel();
    const std::string mode = choose_shard_mode(o.shard, world, params, o.optimizer.name,
                                               on_cuda ? runtime->memory_info().total_bytes : size_t{64} << 30, nullptr);
    init = mode == "zero3" ? models::init_param_shards(forward, o.seed, config.layers, world, rank)
               : models::init_params(forward, o.seed, config.layers);
    r.tokens_per_step = o.batch * config.seq;
  } else {
    forward = models::by_name(o.model, o.batch / world, o.seq);
    init = models::init_params_fan_in(forward, o.seed);
    r.tokens_per_step = o.batch;
  }
  const double params_s = seconds_since_process_start();
  std::vector<std::vector<Tensor>> batches(2);
  for (size_t k = 0; k < batches.size(); ++k)
    for (const GraphInput& in : forward.inputs) {
      if (in.role != Role::kData) continue;
      const TensorType& type = forward.type(in.value);
      bool integer = is_integer(type.dtype);
      const double high = !integer ? 1.0 : from_onnx ? static_cast<double>(index_bounds[batches[k].size()])
                                                     : static_cast<double>(int_high);
      batches[k].push_back(random_tensor(type, o.seed * 7919 + 31 * k + batches[k].size() + 1009 * rank, integer ? 0.0 : -1.0,
                                         high));
    }
  for (const GraphInput& in : forward.inputs)
    if (in.role == Role::kParam) r.params += forward.type(in.value).numel();
  r.flops_per_step = 6.0 * static_cast<double>(r.params) * static_cast<double>(r.tokens_per_step) +
                     12.0 * static_cast<double>(layers * seq * d_model) * static_cast<double>(r.tokens_per_step);

  OptimizerConfig config = o.optimizer;
  config.amp = o.amp;
  validate(config);
  ExecutorOptions executor_options;
  executor_options.device = runtime->device();
  executor_options.cuda_graphs = o.cuda_graphs;
  executor_options.tune_gemms = o.tune_gemms;
  if (group) executor_options.communicator = group->communicator().get();
  std::string shard_note;
  r.shard = choose_shard_mode(o.shard, world, r.params, config.name, on_cuda ? runtime->memory_info().total_bytes : size_t{64} << 30,
                              &shard_note);
  const ShardingOptions sharding{parse_shard_mode(r.shard), world};
  // The profiling and tracing trainers (--profile, --timeline) need the initial params again:
  // the first trainer is gone by then (two step arenas at once may not fit).
  std::vector<Tensor> again_init;
  if (!o.profile_path.empty() || !o.timeline_path.empty())
    for (const Tensor& t : init) again_init.push_back(t.clone());
  const double context_from_s = seconds_since_process_start();
  size_t free_before = on_cuda ? runtime->memory_info().free_bytes : 0;  // the first call: CUDA's context
  runtime->reset_peak_allocated_bytes();
  r.setup_s = seconds_since_process_start();
  r.setup_parts = {{"start", entered_s}};
  if (group) r.setup_parts.emplace_back("process group", group_joined_s - entered_s);
  r.setup_parts.emplace_back("runtime", runtime_s - group_joined_s);
  r.setup_parts.emplace_back("model and params", params_s - runtime_s);
  r.setup_parts.emplace_back("data", context_from_s - params_s);
  if (on_cuda) r.setup_parts.emplace_back("CUDA context", r.setup_s - context_from_s);
  Stopwatch phase;
  const PassOptions passes = passes_for(o.passes, group, *runtime);  // once: every rank sweeps together
  auto trainer_owner = std::make_unique<Trainer>(forward, config, init, executor_options, passes, sharding);
  Trainer& trainer = *trainer_owner;
  for (const auto& [name, value] : onnx_state) trainer.set_initial_value(name, value);
  r.compile_s = phase.lap();
  if (group)
    group->check_agreement("the compiled step (model, batch, flags, build)",
                           step_fingerprint(trainer, fmt::format("{} {} {} {}", o.model, o.batch, o.seq, sizes_text(o.sizes))));
  r.build_parts = trainer.build_seconds();
  init.clear();

  phase.lap();
  trainer.step(batches[0]);
  trainer.synchronize();
  r.first_step_s = seconds_since_process_start();
  r.first_run_s = phase.lap();
  for (int64_t i = 1; i < o.untimed_steps; ++i) trainer.step(batches[i % 2]);
  trainer.synchronize();
  std::vector<double> ms;
  for (int64_t i = 0; i < o.steps; ++i) {
    const Stopwatch step_time;
    trainer.step(batches[i % 2]);
    trainer.synchronize();
    ms.push_back(1e3 * step_time.seconds());
  }
  const Stopwatch back_to_back;
  for (int64_t i = 0; i < o.steps; ++i) trainer.step(batches[i % 2]);
  std::vector<double> losses = trainer.take_losses();  // waits for the last step
  r.pipelined_ms = 1e3 * back_to_back.seconds() / static_cast<double>(o.steps);
  r.final_loss = losses.empty() ? NAN : losses.back();
  r.median_ms = median_of(ms);
  r.tokens_per_s = static_cast<double>(r.tokens_per_step) / (r.median_ms / 1e3);
  if (on_cuda) {
    r.device_name = runtime->name();
    r.peak_flops = o.peak_flops > 0 ? o.peak_flops : device_peak_flops(r.device_name, o.amp, &r.peak_note);
    if (o.peak_flops > 0) r.peak_note = fmt::format("given peak {:.1f} TFLOP/s", o.peak_flops / 1e12);
    r.param_state_bytes = trainer.param_and_state_bytes();
    for (const auto& [name, t] : trainer.named_tensors())
      if (t.device() != runtime->device()) {
        r.host_state_bytes += t.bytes();
        ++r.host_state_tensors;
      }
    r.arena_bytes = trainer.step_executor().device_bytes();
    r.kiln_peak_bytes = runtime->peak_allocated_bytes();
    r.max_peak_bytes = static_cast<size_t>(trainer.reduce_over_ranks(static_cast<double>(r.kiln_peak_bytes), ReduceOp::kMax));
    size_t free_after = runtime->memory_info().free_bytes;
    r.device_used_delta_bytes = free_before > free_after ? free_before - free_after : 0;
    r.graph_replays = trainer.step_executor().graph_replays();
    r.updates_in_place = trainer.step_executor().direct_update_count();
  } else {
    r.device_name = "cpu";
    r.peak_flops = o.peak_flops;
    r.peak_note = o.peak_flops > 0 ? fmt::format("given peak {:.1f} TFLOP/s", o.peak_flops / 1e12)
                                   : "no peak rate for the CPU (give --peak-tflops for an MFU)";
  }
  r.kernels_per_step = static_cast<int64_t>(trainer.step_executor().graph().nodes.size());
  r.updates = trainer.step_executor().graph().updates.size();
  // Per GPU: each does 1/world of the global step's FLOPs.
  r.mfu = r.peak_flops > 0 ? r.flops_per_step / world / (r.median_ms / 1e3) / r.peak_flops : 0;
  // --timeline and --profile: before the report, so that the report (and its JSON line) stays last.
  if (!o.timeline_path.empty() || !o.profile_path.empty()) trainer_owner.reset();
  auto another_trainer = [&](const ExecutorOptions& options) {
    std::vector<Tensor> params;
    for (const Tensor& t : again_init) params.push_back(t.clone());
    return std::make_unique<Trainer>(forward, config, params, options, passes, sharding);
  };
  if (!o.timeline_path.empty()) {
    // In a group every rank runs the traced steps (their collectives need each other); rank 0
    // writes and reports its own trace, the communication stream's kernels beside the compute.
    // The trace exists before the trainer so that its graph's capture names every kernel's node.
    const std::unique_ptr<DeviceTrace> trace = runtime->create_trace();
    std::unique_ptr<Trainer> traced = another_trainer(executor_options);
    for (int i = 0; i < 4; ++i) traced->step(batches[static_cast<size_t>(i % 2)]);  // run, tune, capture, replay
    traced->synchronize();
    trace->start();
    for (int64_t i = 0; i < o.timeline_steps; ++i) traced->step(batches[static_cast<size_t>(i % 2)]);
    traced->synchronize();
    std::vector<std::vector<TraceEvent>> steps = split_steps(trace->stop());
    const std::vector<NodeTiming> labels = traced->step_executor().node_labels();
    if (rank == 0) write_timeline_trace(steps, labels, o.timeline_path);
    if (o.out) {
      fmt::print(o.out, "{}", timeline_report(steps, labels, 25));
      fmt::print(o.out, "timeline written to {} (open in chrome://tracing or ui.perfetto.dev)\n", o.timeline_path);
    }
  }
  if (!o.profile_path.empty()) {
    ExecutorOptions profile_options = executor_options;
    profile_options.profile = true;
    std::unique_ptr<Trainer> profiling_owner = another_trainer(profile_options);
    Trainer& profiling = *profiling_owner;
    for (int i = 0; i < 3; ++i) profiling.step(batches[static_cast<size_t>(i % 2)]);  // run, tune, profiled
    std::vector<NodeTiming> timings = profiling.step_executor().profile();  // the last step
    write_chrome_trace(timings, o.profile_path);
    if (o.out) {
      fmt::print(o.out, "profile (one step, each kernel between CUDA events, no CUDA graph):\n{}",
                 profile_table(timings, 25));
      fmt::print(o.out, "trace written to {} (open in chrome://tracing or ui.perfetto.dev)\n", o.profile_path);
    }
  }
  if (o.out) {
    const std::string unit = models::is_language_model(o.model) ? "tokens" : "samples";
    fmt::print(o.out, "kiln bench: {} ({:.1f}M params), batch {}{}, amp {}, device {}{}\n", o.model,
               static_cast<double>(r.params) / 1e6, o.batch, models::is_language_model(o.model) ? fmt::format(", seq {}", seq) : "",
               o.amp, r.device_name, on_cuda ? (o.cuda_graphs ? ", CUDA graphs on" : ", CUDA graphs off") : "");
    fmt::print(o.out, "  ms/step          {:.2f} median of {} steps (each waited for); {:.2f} mean when issued back to back\n",
               r.median_ms, o.steps, r.pipelined_ms);
    if (world > 1) {
      fmt::print(o.out, "  ranks            {} ({}), shard {}; batch {} is {} a rank\n", world,
                 group->communicator()->engine(), shard_note, o.batch, o.batch / world);
      fmt::print(o.out, "  {}/s         {:.0f} total, {:.0f} per GPU\n", unit, r.tokens_per_s, r.tokens_per_s / world);
    } else {
      fmt::print(o.out, "  {}/s         {:.0f}\n", unit, r.tokens_per_s);
    }
    fmt::print(o.out, "  MFU{}          {}  ({:.3g} GFLOP/step = 6*N*{} + 12*L*T*d*{}; {})\n", world > 1 ? "/GPU" : "    ",
               r.peak_flops > 0 ? fmt::format("{:.3f}", r.mfu) : "n/a", r.flops_per_step / 1e9, unit, unit, r.peak_note);
    if (on_cuda)
      fmt::print(o.out, "  executor         {} kernels per step, {} CUDA graph replays, {} of {} updates written in place\n",
                 r.kernels_per_step, r.graph_replays, r.updates_in_place, r.updates);
    if (on_cuda)
      fmt::print(o.out, "  device memory    kiln peak {}{} (params+state {}, step arena+outputs {}); cudaMemGetInfo used +{}\n",
                 format_bytes(r.kiln_peak_bytes),
                 world > 1 ? fmt::format(" on rank 0, {} the most of any rank", format_bytes(r.max_peak_bytes)) : "",
                 format_bytes(r.param_state_bytes), format_bytes(r.arena_bytes), format_bytes(r.device_used_delta_bytes));
    if (on_cuda && r.host_state_tensors > 0)
      fmt::print(o.out, "  offloaded        {} optimizer state tensors, {} in pinned host memory{}\n", r.host_state_tensors,
                 format_bytes(r.host_state_bytes), world > 1 ? " on rank 0" : "");
    if (o.passes.memory_budget)
      fmt::print(o.out, "  memory budget    {} for the step's planned arena (rematerialization)\n",
                 format_bytes(*o.passes.memory_budget));
    fmt::print(o.out,
               "  first step       {:.2f} s after process start (setup {:.2f} s, trainer build {:.2f} s, "
               "first step {:.2f} s)\n",
               r.first_step_s, r.setup_s, r.compile_s, r.first_run_s);
    auto parts = [](const std::vector<std::pair<std::string, double>>& v) {
      std::string out;
      for (const auto& [name, s] : v) out += fmt::format("{}{} {:.2f}", out.empty() ? "" : ", ", name, s);
      return out;
    };
    fmt::print(o.out, "                   setup: {}; trainer build: {}\n", parts(r.setup_parts), parts(r.build_parts));
    fmt::print(o.out, "  final loss       {:.4f}\n", r.final_loss);
    if (o.json) {
      auto gib = [](size_t bytes) { return std::round(static_cast<double>(bytes) / double(1ull << 30) * 100) / 100; };
      nlohmann::json j{{"model", o.model}, {"amp", o.amp}, {"batch", o.batch}, {"seq", seq}, {"device", r.device_name},
                       {"world_size", world}, {"shard", r.shard}, {"max_peak_gib", gib(r.max_peak_bytes)},
                       {"host_state_gib", gib(r.host_state_bytes)}, {"host_state_tensors", r.host_state_tensors},
                       {"cuda_graphs", on_cuda && o.cuda_graphs}, {"params", r.params},
                       {"ms_per_step", std::round(r.median_ms * 100) / 100},
                       {"pipelined_ms", std::round(r.pipelined_ms * 100) / 100},
                       {"tokens_per_s", std::round(r.tokens_per_s)}, {"mfu", std::round(r.mfu * 1000) / 1000},
                       {"peak_note", r.peak_note}, {"peak_gib", gib(r.kiln_peak_bytes)},
                       {"used_delta_gib", gib(r.device_used_delta_bytes)},
                       {"first_step_s", std::round(r.first_step_s * 100) / 100},
                       {"compile_s", std::round(r.compile_s * 100) / 100},
                       {"setup_s", std::round(r.setup_s * 100) / 100},
                       {"first_run_s", std::round(r.first_run_s * 100) / 100}, {"final_loss", r.final_loss}};
      fmt::print(o.out, "{}\n", j.dump());
    }
  }
  return r;
}

}  // namespace

BenchResult run_benchmark(const BenchOptions& options) {
  const double entered_s = seconds_since_process_start();
  BenchOptions o = options;
  if (o.device == "auto" || o.amp == "auto") {
    const DeviceChoice choice = choose_device(o.device, o.amp, device_availability(Device::kCuda));
    o.device = choice.device;
    o.amp = choice.amp;
  }
  // In a group (kiln launch): join it before the runtime takes the current GPU; rank 0 reports.
  const std::unique_ptr<ProcessGroup> group = join_group(o.device);
  try {
    return run_bench(o, group.get(), entered_s);
  } catch (const Error& e) {
    fail_in_group(group.get(), e);
  }
}

}  // namespace kiln::train
