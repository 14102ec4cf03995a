#include "models/models.h"

namespace kiln::models {

Graph mlp(const MlpConfig& config) {
  Builder b("mlp");
  std::vector<std::pair<Expr, Expr>> layers;
  int64_t width = config.inputs;
  std::vector<int64_t> sizes = config.hidden;
  sizes.push_back(config.classes);
  for (size_t i = 0; i < sizes.size(); ++i) {
    Expr w = b.param(fmt::format("fc{}.weight", i), {width, sizes[i]}, config.dtype);
    Expr bias = b.param(fmt::format("fc{}.bias", i), {sizes[i]}, config.dtype);
    layers.emplace_back(w, bias);
    width = sizes[i];
  }
  Expr x = b.data("x", {config.batch, config.inputs}, config.dtype);
  Expr labels = b.data("labels", {config.batch}, DType::kI64);
  Expr h = x;
  for (size_t i = 0; i < layers.size(); ++i) {
    h = matmul(h, layers[i].first) + layers[i].second;
    if (i + 1 < layers.size()) h = gelu(h, "tanh");
  }
  Expr logits = h.named("logits");
  Expr loss = cross_entropy(logits, labels).named("loss");
  return b.finish({loss, logits});
}

}  // namespace kiln::models
