// How the nvrtc dialect binds GPT-2's fused nodes when the pipeline targets the GPU (the
// training graph as `kiln bench --device cuda` builds it): the epilogues kiln counts on are
// there and map onto ONE cuBLASLt call each (no product through memory): bias + GELU with the
// pre-activation kept (forward), DGELU (backward; its bias gradient stays a separate sum:
// DGELU_BGRAD measured 3x slower); and the residual-gradient add, its cast and the
// bias-gradient sum run as one elementwise kernel. The reads phase of the
// partitioner (fusion::absorb_readers) makes these groups. Needs no GPU (binding decisions
// only). Only in builds with the CUDA backend.
#ifdef KILN_HAVE_CUDA

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "backends/cuda/nvrtc.h"
#include "models/models.h"
#include "passes/pipeline.h"
#include "train/optimizer.h"

namespace kiln {
namespace {

std::string ops_of(const Graph& body) {
  std::string s;
  for (const Node& n : body.nodes) s += (s.empty() ? "" : " ") + std::string(op_name(n.op));
  return s;
}

TEST(NvrtcGpt2Test, GeluAndBiasGradientsRideOnCublasLtEpilogues) {
  train::OptimizerConfig config;
  config.amp = "bf16";
  Graph graph = train::build_training_graph(models::by_name("gpt2-tiny", 2), config).graph;
  PassOptions options;
  options.target = Device::kCuda;
  default_pipeline(options).run(graph);
  std::map<std::string, int> bodies;  // the ops of each fused body -> count
  for (const Node& node : graph.nodes) {
    if (node.op != Op::kFused || !node.body) continue;
    const std::string& kind = node.attrs.s("kind");
    ++bodies[kind + ": " + ops_of(*node.body)];
    const std::string ops = ops_of(*node.body);
    if (ops != "matmul add gelu" && ops != "matmul gelu_grad") continue;
    std::string why;
    EXPECT_TRUE(cuda::gemm_epilogue_supported(*node.body, &why))
        << ops << ": " << why;
  }
  std::string listing;
  for (const auto& [ops, count] : bodies) listing += fmt::format("  {} x{}\n", ops, count);
  SCOPED_TRACE("fused bodies:\n" + listing);
  // gpt2-tiny has 2 layers: one of each per layer.
  EXPECT_EQ(bodies["gemm-epilogue: matmul add gelu"], 2);
  EXPECT_EQ(bodies["gemm-epilogue: matmul gelu_grad"], 2);
  EXPECT_EQ(bodies.count("gemm-epilogue: matmul gelu_grad sum"), 0u);
  EXPECT_GE(bodies["elementwise: add cast sum"], 3);
  EXPECT_EQ(bodies.count("elementwise: add"), 0u);
}

}  // namespace
}  // namespace kiln

#endif  // KILN_HAVE_CUDA
