// Where a zero3 rank's param init goes (kiln bench's "model and params", now drawn beside the
// compile): per value, the draw of models::init_param_shards into fresh memory (the Box-Muller
// math, Philox, the first touch of its pages), and the zero-filled allocation of the same shards
// alone, in wall time and the process's user and system CPU time, for llama-8b's shapes.
//
// Usage: param_init_bench [--layers N] [--world W]   (defaults 2 and 2: rank 0's shards, ~3 GB)
// Threads: OMP_NUM_THREADS (kiln launch gives a rank cores / processes).
#include <fmt/core.h>
#include <omp.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "models/models.h"

namespace kiln {
namespace {

struct Clock {
  double wall, user, system;
  static Clock now() {
    rusage r{};
    getrusage(RUSAGE_SELF, &r);
    return {std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(),
            static_cast<double>(r.ru_utime.tv_sec) + 1e-6 * static_cast<double>(r.ru_utime.tv_usec),
            static_cast<double>(r.ru_stime.tv_sec) + 1e-6 * static_cast<double>(r.ru_stime.tv_usec)};
  }
};

void report(const char* what, const Clock& a, const Clock& b, int64_t values) {
  const double n = static_cast<double>(values) / 1e9;  // ns a value
  fmt::print("{:<44} {:7.3f} s wall {:6.2f} ns/value; CPU user {:6.2f}, system {:6.2f} ns/value\n", what,
             b.wall - a.wall, (b.wall - a.wall) / n, (b.user - a.user) / n, (b.system - a.system) / n);
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  using namespace kiln;
  int64_t layers = 2;
  int world = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--layers") == 0) layers = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--world") == 0) world = std::atoi(argv[i + 1]);
    else {
      fmt::print(stderr, "unknown option {} (expected --layers N, --world W)\n", argv[i]);
      return 1;
    }
  }
  models::ModelSizes sizes;
  sizes.layers = layers;
  const Clock built_from = Clock::now();
  const Graph g = models::by_name("llama-8b", 4, sizes);
  const Clock built = Clock::now();
  int64_t values = 0;
  for (const GraphInput& in : g.inputs)
    if (in.role == Role::kParam) values += (g.type(in.value).numel() + world - 1) / world;
  fmt::print("llama-8b, {} layers, rank 0 of {}: {:.3f}e9 values, {} threads; graph built in {:.3f} s\n", layers, world,
             static_cast<double>(values) / 1e9, omp_get_max_threads(), built.wall - built_from.wall);
  {
    const Clock a = Clock::now();
    const std::vector<Tensor> shards = models::init_param_shards(g, 1234, layers, world, 0);
    report("init_param_shards (draw into fresh memory)", a, Clock::now(), values);
  }
  {
    const Clock a = Clock::now();
    std::vector<Tensor> zeros;
    for (const GraphInput& in : g.inputs)
      if (in.role == Role::kParam) zeros.emplace_back(TensorType{DType::kF32, {(g.type(in.value).numel() + world - 1) / world}});
    report("the same shards zero-filled (first touch)", a, Clock::now(), values);
  }
  return 0;
}
