// The CUPTI timeline (backends/cuda/runtime/kernel_trace.h) of graph-replayed gpt2-tiny training steps:
// each replay is one step of the trace, every kernel of it names the graph node that enqueued
// it when the graph was captured (only the executor's own copies around the nodes name none),
// every node that is not a view shows up, and the replays run the same nodes in the same order.
#include <set>

#include "backends/cuda/runtime/kernel_trace.h"
#include "gpu_test_util.h"
#include "runtime/profile.h"
#include "training_step_util.h"

namespace kiln {
namespace {

TEST(CudaKernelTrace, GraphReplaysNameTheirNodes) {
  KILN_REQUIRE_GPU();
  if (!cuda::kernel_trace_available()) GTEST_SKIP() << "built without CUPTI";
  const Graph forward = models::by_name("gpt2-tiny", 4, 0);
  const StepProgram program = testing::sgd_program(forward, "bf16");
  const Graph g = testing::prepared_for_cuda(program.graph, {});
  std::vector<Tensor> inputs;
  for (const Tensor& t : testing::step_inputs(program, forward, 2, 256)) inputs.push_back(cuda::to_device(t));

  cuda::KernelTrace trace;
  EXPECT_THROW(cuda::KernelTrace(), Error);  // one at a time
  Executor executor(g, ExecutorOptions{Device::kCuda, {}});
  for (int i = 0; i < 3; ++i) executor.run(inputs);  // run, capture, replay
  executor.synchronize();
  ASSERT_EQ(executor.graph_captures(), 1);
  trace.start();
  for (int i = 0; i < 3; ++i) executor.run(inputs);
  const std::vector<std::vector<TraceEvent>> steps = split_steps(trace.stop());
  ASSERT_EQ(steps.size(), 3u);

  const std::vector<NodeTiming> labels = executor.node_labels();
  std::set<int64_t> want;
  for (const NodeTiming& l : labels)
    if (l.dialect != "view") want.insert(l.node);
  std::vector<int64_t> first_order;
  for (size_t s = 0; s < steps.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    std::set<int64_t> seen;
    std::vector<int64_t> order;
    for (const TraceEvent& e : steps[s]) {
      EXPECT_LE(e.start_us, e.end_us) << e.name;
      if (e.node < 0) {
        EXPECT_EQ(e.name.rfind("memcpy", 0), 0u) << "a kernel with no node: " << e.name;
        continue;
      }
      ASSERT_LT(e.node, static_cast<int64_t>(labels.size())) << e.name;
      EXPECT_NE(labels[static_cast<size_t>(e.node)].dialect, "view") << e.name;
      seen.insert(e.node);
      order.push_back(e.node);
    }
    std::vector<int64_t> missing;
    for (int64_t n : want)
      if (!seen.count(n)) missing.push_back(n);
    EXPECT_TRUE(missing.empty()) << missing.size() << " nodes ran no traced work, e.g. node " << missing[0] << " "
                                 << timing_label(labels[static_cast<size_t>(missing[0])]);
    if (s == 0) {
      first_order = order;
    } else {
      EXPECT_EQ(order, first_order);
    }
    const StepTimes t = step_times(steps[s]);
    EXPECT_GT(t.busy_ms, 0);
    EXPECT_LE(t.busy_ms, t.span_ms + 1e-9);
  }
  const std::string report = timeline_report(steps, labels);
  EXPECT_NE(report.find("3 steps"), std::string::npos) << report;
}

}  // namespace
}  // namespace kiln
