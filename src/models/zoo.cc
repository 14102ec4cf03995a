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
  if (name.rfind("gpt2", 0) == 0) {
    GptConfig config = gpt_config(name);
    config.batch = batch;
    if (seq > 0) config.seq = seq;
    return gpt(config);
  }
  fail("unknown model '{}' (expected mlp, cnn, gpt2-tiny, gpt2 or gpt2-medium)", name);
}

}  // namespace kiln::models
