// The CNN of the model zoo (models.h): conv / relu / max-pool stages, then a linear classifier.
#include "models/models.h"

namespace kiln::models {

Graph cnn(const CnnConfig& config) {
  KILN_CHECK(!config.conv_channels.empty(),
             "cnn: conv_channels is empty, expected at least one conv stage");
  Builder b("cnn");
  struct Conv {
    Expr weight, bias;
  };
  std::vector<Conv> convs;
  int64_t channels = config.channels, height = config.height, width = config.width;
  for (size_t i = 0; i < config.conv_channels.size(); ++i) {
    const int64_t out = config.conv_channels[i];
    convs.push_back({b.param(fmt::format("conv{}.weight", i), {out, channels, 3, 3}, config.dtype),
                     b.param(fmt::format("conv{}.bias", i), {out}, config.dtype)});
    channels = out;
    height /= 2;  // 3x3 padding 1 keeps the size; the 2x2 pool halves it (rounding down)
    width /= 2;
  }
  KILN_CHECK(height >= 1 && width >= 1,
             "cnn: a {}x{} image is too small for {} conv stages, each halving it", config.height,
             config.width, config.conv_channels.size());
  const int64_t features = channels * height * width;
  Expr fc_weight = b.param("fc.weight", {features, config.classes}, config.dtype);
  Expr fc_bias = b.param("fc.bias", {config.classes}, config.dtype);
  Expr x = b.data("x", {config.batch, config.channels, config.height, config.width}, config.dtype);
  Expr labels = b.data("labels", {config.batch}, DType::kI64);

  Expr h = x;
  for (const Conv& conv : convs) {
    // Bias (O,) broadcast over (B, O, H, W) as (O, 1, 1).
    h = conv2d(h, conv.weight, {1, 1}, {1, 1}) + reshape(conv.bias, {conv.bias.dim(0), 1, 1});
    h = max_pool2d(relu(h), {2, 2});
  }
  h = reshape(h, {config.batch, features});
  Expr logits = (matmul(h, fc_weight) + fc_bias).named("logits");
  Expr loss = cross_entropy(logits, labels).named("loss");
  return b.finish({loss, logits});
}

}  // namespace kiln::models
