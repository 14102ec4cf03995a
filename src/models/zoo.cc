#include <algorithm>

#include "models/models.h"
#include "support/error.h"

namespace kiln::models {

Graph by_name(const std::string& name, int64_t batch, int64_t seq) {
  KILN_CHECK(batch > 0, "batch must be > 0, got {}", batch);
  if (name == "mlp") return mlp(MlpConfig{batch, 784, {256}, 10});
  if (name == "cnn") {
    CnnConfig config;
    config.batch = batch;
    return cnn(config);
  }
  if (name.rfind("gpt2", 0) == 0 && std::find(model_names().begin(), model_names().end(), name) != model_names().end()) {
    GptConfig config = gpt_config(name);
    config.batch = batch;
    if (seq > 0) config.seq = seq;
    return gpt(config);
  }
  fail("unknown model '{}' (expected {})", name, model_names_text());
}

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {"mlp", "cnn", "gpt2-tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"};
  return names;
}

std::string model_names_text() {
  const std::vector<std::string>& n = model_names();
  std::string text;
  for (size_t i = 0; i < n.size(); ++i) text += (i == 0 ? "" : i + 1 == n.size() ? " or " : ", ") + n[i];
  return text;
}

}  // namespace kiln::models
