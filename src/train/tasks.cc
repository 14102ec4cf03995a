#include "train/tasks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>

#include "support/error.h"
#include "train/data/fashion_mnist.h"
#include "train/data/text.h"
#include "train/trainer.h"

namespace kiln::train {

bool is_onnx_model(const std::string& model) {
  return model.size() > 5 && model.compare(model.size() - 5, 5, ".onnx") == 0;
}

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

ParamDraw zoo_param_draw(const Graph& forward, const std::string& name, uint64_t seed, const models::ModelSizes& sizes) {
  if (!models::is_language_model(name)) return [forward, seed](int, int) { return models::init_params_fan_in(forward, seed); };
  const int64_t layers = models::language_model_info(name, sizes).layers;
  return [forward, seed, layers](int world, int rank) {
    return world > 1 ? models::init_param_shards(forward, seed, layers, world, rank)
                     : models::init_params(forward, seed, layers);
  };
}

models::ModelSizes sizes_of(models::ModelSizes sizes, int64_t seq) {
  if (seq > 0) sizes.seq = seq;
  return sizes;
}

std::string sizes_text(const models::ModelSizes& s) {
  return fmt::format("{} {} {} {} {} {} {} {} {}", s.layers, s.d_model, s.heads, s.kv_heads, s.hidden, s.vocab, s.seq,
                     s.rope_base, s.norm_epsilon);
}

Model import_onnx_model(const std::string& path, const onnx::ImportOptions& options) {
  onnx::ImportedModel model = onnx::import_onnx(path, options);
  return model_from_values(std::move(model.graph), model.initial_values);
}

namespace {

// Where this process stands in a group: its rank of how many.
struct Place {
  int rank = 0;
  int world = 1;
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

// A zoo classifier on Fashion-MNIST, evaluated by its test accuracy.
Task classification_task(const TaskOptions& o, const Place& place) {
  KILN_CHECK(o.data == "fashion-mnist" || o.data.empty(),
             "model {} trains on fashion-mnist, got --data '{}'", o.model, o.data);
  FashionMnist fm = load_fashion_mnist(o.data_dir.empty() ? kFashionMnistDir : o.data_dir);
  Task t;
  t.model.forward = models::by_name(o.model, o.batch / place.world);  // this rank's slice of the batch
  t.model.draw_params = zoo_param_draw(t.model.forward, o.model, o.seed);
  if (o.model == "cnn") {
    fm.train = fm.train.with_sample_shape(kFashionMnistImageShape);
    fm.test = fm.test.with_sample_shape(kFashionMnistImageShape);
  }
  auto batcher = std::make_shared<Batcher>(Batcher::training(fm.train, o.batch, o.seed));
  t.data.batch = [batcher, place](int64_t step) {
    Batch b = rows_of_rank(batcher->batch_at_step(step), place);
    return std::vector<Tensor>{b.inputs, b.targets};
  };
  auto test = std::make_shared<ClassificationDataset>(fm.test);
  const int64_t B = o.batch, limit = o.eval_batches;
  t.data.evaluate = [test, B, limit, place](const Trainer& trainer) {
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
    return Evaluation{"accuracy", all_correct / all_rows, count};
  };
  t.data.description = fmt::format("{} on Fashion-MNIST ({} train / {} test images)", o.model,
                              fm.train.size(), fm.test.size());
  t.data.items_per_step = o.batch;
  t.data.item_name = "samples";
  t.data.global_batch = o.batch;
  t.data.seed = o.seed;
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
Evaluation held_out_perplexity(const Trainer& trainer, const TokenBatcher& eval, int64_t count, uint64_t seed,
                                     const Place& place, const Bind& bind) {
  std::vector<Tensor> losses = trainer.evaluate_batches(
      count, [&](int64_t i) { return bind(rows_of_rank(eval.random_batch(seed + 1, i), place)); });
  double total = 0;
  for (const Tensor& loss : losses) total += loss.get(0);
  return Evaluation{"perplexity", std::exp(total / static_cast<double>(count)), count};
}

// A zoo language model on a text, evaluated by its held-out perplexity.
Task language_model_task(const TaskOptions& o, const Place& place) {
  const models::ModelSizes sizes = sizes_of(o.sizes, o.seq);
  const models::LanguageModelInfo config = models::language_model_info(o.model, sizes);
  KILN_CHECK(o.data != "fashion-mnist" && o.data != "random", "model {} is a language model: give --data a text or "
             ".tok file", o.model);
  // The batchers draw the global batch; the model takes this rank's rows.
  const TextData text = load_text(o.data.empty() ? kDefaultTextPath : o.data, config.vocab, o.batch, config.seq);
  Task t;
  t.model.forward = models::by_name(o.model, o.batch / place.world, sizes);
  t.model.draw_params = zoo_param_draw(t.model.forward, o.model, o.seed, sizes);
  uint64_t seed = o.seed;
  auto train_tokens = text.train;
  t.data.batch = [train_tokens, seed, place](int64_t step) {
    return inputs_and_targets(rows_of_rank(train_tokens->random_batch(seed, step), place));
  };
  int64_t eval_batches = o.eval_batches > 0 ? o.eval_batches : 10;
  auto eval_tokens = text.eval;
  t.data.evaluate = [eval_tokens, eval_batches, seed, place](const Trainer& trainer) {
    return held_out_perplexity(trainer, *eval_tokens, eval_batches, seed, place, inputs_and_targets);
  };
  t.data.description = fmt::format("{} ({} layers, d={}, T={}, vocab {}) on '{}' ({} tokens)", o.model, config.layers,
                              config.d_model, config.seq, config.vocab, text.path, text.tokens);
  t.data.items_per_step = o.batch * config.seq;
  t.data.item_name = "tokens";
  t.data.global_batch = o.batch;
  t.data.seed = o.seed;
  return t;
}

// An ONNX model's forward graph, its params' initial values (in graph order) and its state's.
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
Evaluation mean_loss(const Trainer& trainer, int64_t count, const std::function<std::vector<Tensor>(int64_t)>& batch) {
  std::vector<Tensor> losses = trainer.evaluate_batches(count, batch);
  double total = 0;
  for (const Tensor& loss : losses) total += loss.get(0);
  return Evaluation{"loss", total / static_cast<double>(count), count};
}

// An ONNX model trained on the dataset its data inputs bind to (bind_data_inputs).
Task onnx_task(const TaskOptions& o, const Place& place) {
  KILN_CHECK(place.world == 1, "an ONNX model trains in one process (its batch is the file's): drop kiln launch");
  KILN_CHECK(o.seq == 0 && o.sizes.layers == 0 && o.sizes.d_model == 0 && o.sizes.heads == 0 &&
                 o.sizes.kv_heads == 0 && o.sizes.hidden == 0 && o.sizes.vocab == 0 && o.sizes.seq == 0 &&
                 o.sizes.rope_base == 0 && o.sizes.norm_epsilon == 0,
             "an ONNX model's sizes are the file's: drop --seq, --layers, --d-model, --heads, --kv-heads, --hidden, "
             "--vocab, --rope-theta and --rms-eps");
  Task t;
  t.model = import_onnx_model(o.model, o.onnx);
  const Graph& g = t.model.forward;
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
    auto forward = std::make_shared<Graph>(t.model.forward);  // the lambdas outlive this Task's moves
    t.data.batch = [forward, bounds, seed](int64_t step) { return random_data(*forward, bounds, seed * 1000003 + step); };
    const int64_t count = o.eval_batches > 0 ? o.eval_batches : 10;
    t.data.evaluate = [forward, bounds, seed, count](const Trainer& trainer) {
      return mean_loss(trainer, count, [&](int64_t i) { return random_data(*forward, bounds, ~seed - i); });
    };
    what = "random inputs";
    t.data.items_per_step = batch;
    t.data.item_name = "samples";
  } else if (binding.data == "fashion-mnist") {
    FashionMnist fm = load_fashion_mnist(o.data_dir.empty() ? kFashionMnistDir : o.data_dir);
    auto batcher = std::make_shared<Batcher>(Batcher::training(fm.train, batch, seed));
    t.data.batch = [batcher, bind](int64_t step) { return bind(batcher->batch_at_step(step)); };
    // The test set's full batches in order (a partial one would count padding in the loss).
    auto test = std::make_shared<Batcher>(Batcher::evaluation(fm.test, batch));
    const int64_t full = fm.test.size() / batch;
    const int64_t count = o.eval_batches > 0 ? std::min(o.eval_batches, full) : full;
    t.data.evaluate = [test, bind, count](const Trainer& trainer) {
      return mean_loss(trainer, count, [&](int64_t i) { return bind(test->batch(0, i)); });
    };
    what = fmt::format("Fashion-MNIST ({} train / {} test images)", fm.train.size(), fm.test.size());
    t.data.items_per_step = batch;
    t.data.item_name = "samples";
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
    t.data.batch = [train_tokens, seed, bind](int64_t step) { return bind(train_tokens->random_batch(seed, step)); };
    const int64_t count = o.eval_batches > 0 ? o.eval_batches : 10;
    t.data.evaluate = [eval_tokens, count, seed, place, bind](const Trainer& trainer) {
      return held_out_perplexity(trainer, *eval_tokens, count, seed, place, bind);
    };
    what = fmt::format("'{}' ({} tokens, T={}, vocab {})", text.path, text.tokens, seq, vocab);
    t.data.items_per_step = batch * seq;
    t.data.item_name = "tokens";
  }
  t.data.description = fmt::format("{} (ONNX) on {}", o.model, what);
  t.data.global_batch = batch;
  t.data.seed = o.seed;
  return t;
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

Task make_task(const TaskOptions& o, int rank, int world) {
  const bool from_onnx = is_onnx_model(o.model);
  KILN_CHECK(o.batch > 0 || (from_onnx && o.batch == 0), "--batch must be > 0, got {}", o.batch);
  KILN_CHECK(o.eval_batches >= 0, "--eval-batches must be >= 0 (0: the default), got {}", o.eval_batches);
  KILN_CHECK(from_onnx || std::find(models::model_names().begin(), models::model_names().end(), o.model) != models::model_names().end(),
             "unknown model '{}' (expected {}, or an ONNX file MODEL.onnx)", o.model, models::model_names_text());
  KILN_CHECK(o.batch % world == 0, "--batch {} (the global batch) does not split over {} ranks", o.batch, world);
  const Place place{rank, world};
  return from_onnx                              ? onnx_task(o, place)
         : models::is_language_model(o.model) ? language_model_task(o, place)
                                              : classification_task(o, place);
}

}  // namespace kiln::train
