#include "test_util.h"

namespace kiln::testing {
namespace {
std::vector<TensorType> types_of(const std::vector<Tensor>& tensors) {
  std::vector<TensorType> out;
  for (const Tensor& t : tensors) out.push_back(t.type());
  return out;
}

std::vector<Tensor> run_kernel(const KernelFn& kernel, const Attributes& attrs,
                               const std::vector<Tensor>& inputs,
                               const std::vector<TensorType>& output_types) {
  std::vector<Tensor> outputs;
  for (const TensorType& t : output_types) outputs.emplace_back(t);
  kernel(KernelArgs{attrs, inputs, outputs});
  return outputs;
}
}  // namespace

std::vector<TensorType> infer(Op op, const std::vector<TensorType>& inputs, Attributes attrs) {
  return infer_types(op, inputs, normalize_attributes(op, std::move(attrs)));
}

std::vector<Tensor> run_reference(Op op, const std::vector<Tensor>& inputs, Attributes attrs) {
  attrs = normalize_attributes(op, std::move(attrs));
  std::vector<TensorType> out_types = infer_types(op, types_of(inputs), attrs);
  return run_kernel(op_def(op).reference, attrs, inputs, out_types);
}

std::vector<Tensor> run_dialect(const std::string& dialect, Op op,
                                const std::vector<Tensor>& inputs, Attributes attrs) {
  attrs = normalize_attributes(op, std::move(attrs));
  std::vector<TensorType> in_types = types_of(inputs);
  std::vector<TensorType> out_types = infer_types(op, in_types, attrs);
  Node node{op, {}, {}, attrs};
  const KernelImpl& impl =
      kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCpu, {dialect});
  return run_kernel(impl.kernel, attrs, inputs, out_types);
}

Tensor make(DType dtype, Shape shape, std::vector<double> values) {
  return Tensor::from_f64(TensorType{dtype, std::move(shape)}, values);
}

Tensor rand(DType dtype, Shape shape, uint64_t seed, double low, double high) {
  return random_tensor(TensorType{dtype, std::move(shape)}, seed, low, high);
}

::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, double atol,
                                     double rtol) {
  if (actual.type() != expected.type())
    return ::testing::AssertionFailure()
           << "types differ: " << to_string(actual.type()) << " vs " << to_string(expected.type());
  for (int64_t i = 0; i < actual.numel(); ++i) {
    double a = actual.get(i), e = expected.get(i);
    bool both_nan = std::isnan(a) && std::isnan(e);
    if (!both_nan && !(a == e) && !(std::abs(a - e) <= atol + rtol * std::abs(e)))
      return ::testing::AssertionFailure() << "element " << i << ": " << a << " vs expected " << e
                                           << " (atol " << atol << ", rtol " << rtol << ")";
  }
  return ::testing::AssertionSuccess();
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a kiln::Error, none was thrown";
  return "";
}

void expect_matches_reference(const std::string& dialect, Op op, const std::vector<Tensor>& inputs,
                              const Attributes& attrs, Tolerance tol) {
  std::string what = std::string(op_name(op)) + " on";
  for (const Tensor& t : inputs) what += " " + to_string(t.type());
  for (const auto& [name, value] : attrs.items()) what += " " + name + "=" + to_string(value);
  SCOPED_TRACE(what);
  std::vector<Tensor> expected = run_reference(op, inputs, attrs);
  std::vector<Tensor> actual = run_dialect(dialect, op, inputs, attrs);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_TRUE(all_close(actual[i], expected[i], tol.atol, tol.rtol));
  }
}

std::string selected_dialect(Op op, const std::vector<TensorType>& inputs, Attributes attrs) {
  attrs = normalize_attributes(op, std::move(attrs));
  std::vector<TensorType> outputs = infer_types(op, inputs, attrs);
  Node node{op, {}, {}, attrs};
  return kernel_registry().select(NodeView{node, inputs, outputs}, Device::kCpu, {}).dialect;
}

}  // namespace kiln::testing
