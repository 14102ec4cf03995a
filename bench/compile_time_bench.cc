// Compile time against the model's depth: each pass's time (the pipeline's own stopwatch,
// PassRecord::seconds, verification included) and the memory plan of the final graph, for one
// zoo model at several layer counts, compiled as `kiln compile` does (no params drawn, no
// kernels bound, so `--device cuda` measures a GPU run's pipeline on any machine).
//
// Each column is the best of --repeat compiles. The last column is the growth exponent of a row
// against the step's node count between the first and last layer counts (log t1/t0 over
// log n1/n0): 1 is linear; a pass near 2 is quadratic in the model's depth.
//
// Usage: compile_time_bench [--model llama-8b] [--layers 4,8,16,32,64] [--device cpu|cuda]
//          [--amp off|bf16|f16|fp8] [--shard none|dp|zero1|zero2|zero3] [--world-size 2]
//          [--batch 1] [--seq 64] [--d-model N] [--hidden N] [--vocab N] [--repeat 1]
// Pass times depend on the graph's node count, not its widths: small --seq (and, for a quick
// run, --d-model/--hidden/--vocab) keep a deep model cheap to build.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "analysis/memory_plan.h"
#include "compile/compile_step.h"
#include "models/models.h"
#include "passes/sharding.h"
#include "support/error.h"
#include "support/stopwatch.h"

namespace kiln {
namespace {

struct Options {
  std::string model = "llama-8b";
  std::vector<int64_t> layers = {4, 8, 16, 32, 64};
  std::string device = "cpu", amp = "off", shard = "none";
  int world_size = 2, repeat = 1;
  int64_t batch = 1;
  models::ModelSizes sizes;
};

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    out.push_back(std::atoll(text.substr(at, comma - at).c_str()));
    at = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  o.sizes.seq = 64;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    KILN_CHECK(i + 1 < argc, "{} needs a value", flag);
    const std::string value = argv[i + 1];
    if (flag == "--model") o.model = value;
    else if (flag == "--layers") o.layers = parse_list(value);
    else if (flag == "--device") o.device = value;
    else if (flag == "--amp") o.amp = value;
    else if (flag == "--shard") o.shard = value;
    else if (flag == "--world-size") o.world_size = std::atoi(value.c_str());
    else if (flag == "--repeat") o.repeat = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--batch") o.batch = std::atoll(value.c_str());
    else if (flag == "--seq") o.sizes.seq = std::atoll(value.c_str());
    else if (flag == "--d-model") o.sizes.d_model = std::atoll(value.c_str());
    else if (flag == "--hidden") o.sizes.hidden = std::atoll(value.c_str());
    else if (flag == "--vocab") o.sizes.vocab = std::atoll(value.c_str());
    else fail("unknown option '{}' (see the usage at the top of bench/compile_time_bench.cc)", flag);
  }
  KILN_CHECK(o.device == "cpu" || o.device == "cuda", "--device {}: expected cpu or cuda", o.device);
  return o;
}

// One compile: seconds per row name, and the step's node count after the pipeline.
struct Run {
  std::map<std::string, double> seconds;
  std::vector<std::string> rows;  // in pipeline order
  size_t nodes = 0;
};

Run compile_once(const Options& o, int64_t layers) {
  models::ModelSizes sizes = o.sizes;
  sizes.layers = layers;
  const Graph forward = models::by_name(o.model, o.batch, sizes);
  CompileOptions options;
  options.bind_kernels = false;
  options.executor.device = o.device == "cuda" ? Device::kCuda : Device::kCpu;
  options.optimizer.amp = o.amp;
  options.sharding = ShardingOptions{parse_shard_mode(o.shard), o.world_size};
  const Stopwatch total;
  const CompiledStep step = compile_step(forward, options);
  Run run;
  auto add = [&](const std::string& row, double s) {
    run.rows.push_back(row);
    run.seconds[row] = s;
  };
  add(step.phase_seconds.at(1).first, step.phase_seconds.at(1).second);  // the training graph
  for (const PassRecord& r : step.pass_records)
    if (r.ran) add(r.name, r.seconds);
  const Stopwatch plan;
  const MemoryPlan memory = plan_step_memory(step.program.graph);
  add("memory plan", plan.seconds());
  add("total", total.seconds());
  run.nodes = step.program.graph.nodes.size();
  fmt::print(stderr, "  {} layers: {} nodes, arena {} bytes, {:.3f} s\n", layers, run.nodes, memory.arena_bytes,
             run.seconds["total"]);
  return run;
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) try {
  using namespace kiln;
  const Options o = parse(argc, argv);
  fmt::print("{} (batch {}, seq {}), device {}, amp {}, shard {} (world {}); ms, best of {}\n", o.model, o.batch,
             o.sizes.seq, o.device, o.amp, o.shard, o.world_size, o.repeat);
  std::vector<Run> best;
  for (int64_t layers : o.layers) {
    Run b;
    for (int r = 0; r < o.repeat; ++r) {
      Run run = compile_once(o, layers);
      if (r == 0) {
        b = std::move(run);
        continue;
      }
      for (auto& [row, s] : b.seconds) s = std::min(s, run.seconds[row]);
    }
    best.push_back(std::move(b));
  }
  std::vector<std::string> rows = best.front().rows;
  for (const Run& run : best)
    for (const std::string& row : run.rows)
      if (std::find(rows.begin(), rows.end(), row) == rows.end()) rows.insert(rows.end() - 2, row);
  fmt::print("{:<22}", "layers");
  for (int64_t l : o.layers) fmt::print("{:>10}", l);
  fmt::print("{:>8}\n{:<22}", "growth", "nodes");
  for (const Run& run : best) fmt::print("{:>10}", run.nodes);
  fmt::print("\n");
  const double node_ratio = std::log(static_cast<double>(best.back().nodes) / static_cast<double>(best.front().nodes));
  for (const std::string& row : rows) {
    fmt::print("{:<22}", row);
    for (const Run& run : best) {
      const auto at = run.seconds.find(row);
      if (at == run.seconds.end()) fmt::print("{:>10}", "-");
      else fmt::print("{:>10.2f}", at->second * 1e3);
    }
    const auto first = best.front().seconds.find(row), last = best.back().seconds.find(row);
    if (best.size() > 1 && node_ratio > 0 && first != best.front().seconds.end() &&
        last != best.back().seconds.end() && first->second > 0 && last->second > 0)
      fmt::print("{:>8.2f}", std::log(last->second / first->second) / node_ratio);
    fmt::print("\n");
  }
  return 0;
} catch (const kiln::Error& e) {
  fmt::print(stderr, "compile_time_bench: {}\n", e.what());
  return 1;
}
