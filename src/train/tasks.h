// Tasks: what `kiln train` trains, a model and the data it trains on, as a session (session.h)
// takes them. A zoo classifier (mlp, cnn) on Fashion-MNIST, a zoo language model (gpt2*,
// llama*) on a text or .tok file, or an ONNX model on the dataset its data inputs bind to by
// their shapes (bind_data_inputs): Fashion-MNIST, a text, or random inputs. Each task also
// says how to evaluate (test accuracy, held-out perplexity, or the mean loss) and, in a group,
// gives each rank its rows of every global batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "frontend/onnx/onnx_import.h"
#include "ir/graph.h"
#include "models/models.h"
#include "train/session.h"

namespace kiln::train {

struct TaskOptions {
  std::string model = "mlp";          // models::model_names(), or an ONNX model file (.onnx)
  onnx::ImportOptions onnx;           // for an ONNX model: dynamic dims, frozen params, its loss
  // fashion-mnist (classifiers) | a text or .tok file (LMs) | random (an ONNX model: random
  // inputs of its shapes); "" = the model's default (an ONNX model: the dataset its inputs fit,
  // bind_data_inputs)
  std::string data = "";
  std::string data_dir = "";          // Fashion-MNIST directory; "" = the Debian package's
  int64_t batch = 64;                 // the global batch; an ONNX model: 0 = the file's (any other must equal it)
  int64_t seq = 0;                    // LM sequence length; 0 = the config's
  models::ModelSizes sizes;           // LM sizes overriding the config's (--layers, ...; seq above)
  uint64_t seed = 0;                  // of the initial params and the data order
  int64_t eval_batches = 0;           // batches per evaluation: LMs 0 = 10 (random held-out windows);
                                      // classifiers the first N of the test set, 0 = all of it
};

struct Task {
  Model model;        // in a group: the graph of this rank's rows
  TrainingData data;  // in a group: this rank's rows of each global batch
};

// The task of `options` for rank `rank` of `world` (the global batch splits over the ranks).
// Throws kiln::Error on an unknown model, data that does not fit it, or a missing file.
Task make_task(const TaskOptions& options, int rank = 0, int world = 1);

// Whether `model` names an ONNX file (MODEL.onnx) rather than a zoo model.
bool is_onnx_model(const std::string& model);
// An ONNX file's forward graph with its initializers as the starting values.
Model import_onnx_model(const std::string& path, const onnx::ImportOptions& options);
// How zoo model `name`'s params are drawn fresh from `seed` (`forward`: its graph, built with
// `sizes`): a language model's init_params, by shards on a zero3 rank (init_param_shards: the
// same values); a classifier's init_params_fan_in, whole. `kiln train` and `kiln bench` both draw
// through it.
ParamDraw zoo_param_draw(const Graph& forward, const std::string& name, uint64_t seed,
                         const models::ModelSizes& sizes = {});
// The options' model sizes with --seq among them.
models::ModelSizes sizes_of(models::ModelSizes sizes, int64_t seq);
// The sizes as the ranks' agreement check compares them.
std::string sizes_text(const models::ModelSizes& sizes);
// Per data input of `forward`, in order: the bound random integers must stay under to be valid
// indices (token ids, labels): the smallest table, class count or depth an index derived from
// it reaches (gather, cross_entropy, one_hot); 2 for an integer input used otherwise.
std::vector<int64_t> data_index_bounds(const Graph& forward);

// What each data input of an imported model takes from a batch of the dataset it is bound to.
enum class InputRole {
  kImages,      // Fashion-MNIST's images: f32 (B, 1, 28, 28), (B, 28, 28) or (B, 784)
  kLabels,      // Fashion-MNIST's labels: i64 (B,)
  kTokens,      // a text's token ids: i64 (B, T)
  kNextTokens,  // the token after each of them (the language-model targets): i64 (B, T)
  kRandom,      // random values of the input's type (integers below the index bound they reach)
};
struct DataBinding {
  std::string data;             // "fashion-mnist", "random", or the text or .tok file's path
  std::vector<InputRole> roles;  // per data input of the graph, in order
};
// How a forward graph's data inputs bind to `data`: "fashion-mnist" (one images input, at most
// one labels input, one batch size), a text or .tok file path (one or two integer (B, T) inputs:
// the tokens, then their next tokens), "random" (any inputs), or "" (Fashion-MNIST when the
// inputs fit it, else the default text when they fit that, else an error). Throws kiln::Error
// naming every input that cannot be bound, its type and what the dataset binds.
DataBinding bind_data_inputs(const Graph& forward, const std::string& data);

}  // namespace kiln::train
