// Writes the inputs of the gpt2-tiny PyTorch reference: kiln's initial params of
// models::gpt(gpt_config("gpt2-tiny")) (init_params seed 1234, 2 layers, as `kiln train` makes
// them) and one fixed batch, to a safetensors file that make_gpt2_tiny_reference.py reads.
//
//   dump_gpt2_tiny_inputs OUT.safetensors
//
// The batch: 4 rows of 65 tokens uniform in [0, 256) (random_tensor, seed 99); idx is tokens
// 0..63 of each row and targets tokens 1..64, as a language-model batch is. The same batch is
// used for all 10 AdamW steps of the reference. The file holds each param under its graph-input
// name, plus "idx" and "targets" (i64, (4, 64)).
#include <cstdio>
#include <map>
#include <string>

#include "models/models.h"
#include "train/checkpoint/safetensors.h"

namespace kiln {
namespace {

constexpr uint64_t kParamSeed = 1234;
constexpr uint64_t kBatchSeed = 99;

void dump(const std::string& path) {
  const models::GptConfig config = models::gpt_config("gpt2-tiny");
  const Graph graph = models::gpt(config);
  std::vector<Tensor> params = models::init_params(graph, kParamSeed, config.layers);
  std::map<std::string, Tensor> tensors;
  size_t p = 0;
  for (const GraphInput& in : graph.inputs) {
    if (in.role != Role::kParam) continue;
    tensors[graph.value(in.value).name] = params.at(p++);
  }
  const int64_t B = config.batch, T = config.seq;
  Tensor tokens = random_tensor(TensorType{DType::kI64, {B, T + 1}}, kBatchSeed, 0.0,
                                static_cast<double>(config.vocab));
  Tensor idx(TensorType{DType::kI64, {B, T}}), targets(TensorType{DType::kI64, {B, T}});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      idx.data<int64_t>()[b * T + t] = tokens.data<int64_t>()[b * (T + 1) + t];
      targets.data<int64_t>()[b * T + t] = tokens.data<int64_t>()[b * (T + 1) + t + 1];
    }
  }
  tensors["idx"] = idx;
  tensors["targets"] = targets;
  train::save_safetensors(path, tensors,
                          {{"model", "gpt2-tiny"},
                           {"param_seed", std::to_string(kParamSeed)},
                           {"batch_seed", std::to_string(kBatchSeed)}});
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.safetensors\n", argv[0]);
    return 2;
  }
  try {
    kiln::dump(argv[1]);
  } catch (const kiln::Error& e) {
    std::fprintf(stderr, "dump_gpt2_tiny_inputs: %s\n", e.what());
    return 1;
  }
  return 0;
}
