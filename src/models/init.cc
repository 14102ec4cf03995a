// Fan-in-scaled parameter initialization (models.h: init_params_fan_in).
#include <cmath>
#include <random>

#include "models/models.h"

namespace kiln::models {

std::vector<Tensor> init_params_fan_in(const Graph& graph, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Tensor> out;
  for (const GraphInput& in : graph.inputs) {
    if (in.role != Role::kParam) continue;
    const TensorType& type = graph.value(in.value).type;
    Tensor t(type);  // zero-filled: biases stay 0
    if (type.rank() >= 2) {
      // Matmul weights are (in, out); conv weights (O, C, KH, KW) read all but the first dim.
      int64_t fan_in = type.shape[0];
      if (type.rank() >= 3 && type.shape[0] > 0) fan_in = type.numel() / type.shape[0];
      const double bound = 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(fan_in, 1)));
      std::uniform_real_distribution<double> uniform(-bound, bound);
      for (int64_t i = 0; i < t.numel(); ++i) t.set(i, uniform(rng));
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace kiln::models
