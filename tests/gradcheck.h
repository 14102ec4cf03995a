// Gradient checking: autodiff against float64 central differences, for one op or a whole graph.
#pragma once

#include "test_util.h"

namespace kiln::testing {

struct GradCheckOptions {
  double epsilon = 1e-6;     // finite-difference step
  double atol = 1e-7;
  double rtol = 1e-5;
  int max_elements = 40;     // elements checked per input (spread over the tensor)
  std::vector<int> skip_inputs = {};  // input indices not to differentiate (e.g. labels are ints anyway)
};

// Builds loss = sum_k sum(outputs_k * w_k) with random f64 weights w_k over the op's float
// outputs, differentiates it with autodiff w.r.t. every float input (f64 tensors expected), and
// compares each gradient with central differences of the loss run through the reference kernels.
void expect_op_gradients(Op op, const std::vector<Tensor>& inputs, Attributes attrs = {},
                         GradCheckOptions options = {});

// Whole graph: `loss` a scalar output of `graph` (outputs[loss_output]); checks d loss / d input
// for the graph inputs listed in `wrt` (indices into graph.inputs), given all input values.
void expect_graph_gradients(const Graph& graph, int loss_output, const std::vector<int>& wrt,
                            const std::vector<Tensor>& inputs, GradCheckOptions options = {});

}  // namespace kiln::testing
