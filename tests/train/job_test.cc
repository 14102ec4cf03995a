// Training jobs as `kiln train` runs them: a short real Fashion-MNIST run, resume, a NaN stop
// that keeps the last good checkpoint, and bad options; ONNX models whose inputs bind to each
// dataset by their shapes, and each way they cannot.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <unistd.h>

#ifdef KILN_HAVE_ONNX
#include <onnx/onnx_pb.h>
#endif

#include "ir/text.h"
#include "test_util.h"
#include "train/data/fashion_mnist.h"
#include "train/data/text.h"
#include "train/job.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

// Per process: ctest runs the tests of this file in parallel processes, which must not rewrite
// each other's files (an ONNX model read half-written is "the model has no graph").
std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / fmt::format("kiln_job_test_{}_{}", getpid(), name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

JobOptions quiet_mlp(int64_t steps) {
  JobOptions o;
  o.model = "mlp";
  o.steps = steps;
  o.batch = 32;
  o.eval_every = 0;
  o.out = std::fopen("/dev/null", "w");
  return o;
}

bool have_fashion_mnist() { return std::filesystem::exists(std::string(kFashionMnistDir) + "t10k-labels-idx1-ubyte.gz"); }

TEST(TrainJob, ShortMlpRunLearnsAndWritesMetrics) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions o = quiet_mlp(150);
  o.optimizer.lr = 2e-3;
  o.metrics_path = temp_dir("metrics.jsonl");
  JobResult r = run_training_job(o);
  EXPECT_EQ(r.steps_done, 150);
  EXPECT_EQ(r.eval_name, "accuracy");
  EXPECT_GT(r.eval_metric, 0.65);  // chance is 0.10
  std::ifstream metrics(o.metrics_path);
  std::string line, last;
  int lines = 0;
  while (std::getline(metrics, line)) {
    ++lines;
    last = line;
  }
  EXPECT_EQ(lines, 150);
  EXPECT_NE(last.find("\"eval_accuracy\""), std::string::npos) << last;
  std::filesystem::remove(o.metrics_path);
}

TEST(TrainJob, ResumeContinuesToTheSameResult) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions straight = quiet_mlp(40);
  JobResult a = run_training_job(straight);
  JobOptions first = quiet_mlp(20);
  first.checkpoint_dir = temp_dir("resume");
  run_training_job(first);
  JobOptions second = quiet_mlp(40);
  second.checkpoint_dir = first.checkpoint_dir;
  second.resume = true;
  JobResult b = run_training_job(second);
  EXPECT_EQ(b.steps_done, 40);
  EXPECT_EQ(a.final_loss, b.final_loss);
  EXPECT_EQ(a.eval_metric, b.eval_metric);
  std::filesystem::remove_all(first.checkpoint_dir);
}

TEST(TrainJob, NonFiniteLossStopsAndKeepsTheLastGoodCheckpoint) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions o = quiet_mlp(60);
  o.optimizer.name = "sgd";
  o.optimizer.hyper["momentum"] = 0.0;
  o.optimizer.lr = 1e30;  // diverges within a few steps
  o.eval_every = 1;       // checkpoint after every good step
  o.checkpoint_dir = temp_dir("nan");
  try {
    run_training_job(o);
    FAIL() << "expected the run to stop on a non-finite loss";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("at step"), std::string::npos) << m;
    EXPECT_NE(m.find("last good checkpoint"), std::string::npos) << m;
  }
  EXPECT_TRUE(std::filesystem::exists(o.checkpoint_dir + "/last.safetensors"));
  std::filesystem::remove_all(o.checkpoint_dir);
}

TEST(TrainJob, BadOptionsAreOneClearError) {
  JobOptions o = quiet_mlp(10);
  o.model = "resnet";
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(10);
  o.data_dir = "/nonexistent/fashion";
  try {
    run_training_job(o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset-fashion-mnist"), std::string::npos) << e.what();
  }
  o = quiet_mlp(10);
  o.device = "tpu";
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(0);
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(10);
  o.model = "gpt2-tiny";
  o.data = "/nonexistent.txt";
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(10);
  o.model = "gpt2-tiny";
  o.data = "";
  o.seq = 100000;  // longer than the text allows
  EXPECT_THROW(run_training_job(o), Error);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(TrainJob, TinyGptTrainsOnText) {
  JobOptions o = quiet_mlp(30);
  o.model = "gpt2-tiny";
  o.data = "";  // the default text
  o.batch = 2;
  o.seq = 32;
  o.eval_batches = 3;
  o.eval_every = 10;
  o.optimizer.lr = 3e-3;
  const std::string log = temp_dir("gpt_log.txt");
  o.out = std::fopen(log.c_str(), "w");
  JobResult r = run_training_job(o);
  std::fclose(o.out);
  EXPECT_EQ(r.eval_name, "perplexity");
  EXPECT_LT(r.eval_metric, 256.0);  // better than uniform over the byte vocabulary
  EXPECT_LT(r.final_loss, 5.0);     // ln(256) = 5.55 at the start
  // --eval-batches: each of the 3 evaluations ran 3 batches.
  EXPECT_EQ(r.evaluations, 3);
  EXPECT_EQ(r.eval_batches, 3);
  // Where the time went: every part measured, and together no more than the whole.
  EXPECT_GT(r.eval_seconds, 0);
  EXPECT_GT(r.step_seconds, 0);
  EXPECT_GT(r.first_step_seconds, r.setup_seconds + r.compile_seconds);
  EXPECT_LE(r.setup_seconds + r.compile_seconds + r.step_seconds + r.eval_seconds + r.checkpoint_seconds,
            r.seconds + 1e-6);
  // The first line says which device and precision and why; the summary names the evaluation
  // time and the breakdown follows it.
  const std::string text = read_file(log);
  EXPECT_EQ(text.rfind("kiln train: device cpu (as asked), amp off (as asked)\n", 0), 0u) << text;
  EXPECT_NE(text.find("first step done"), std::string::npos) << text;
  // The params are drawn beside the compile: its time includes the wait for them.
  EXPECT_LE(r.params_wait_seconds, r.compile_seconds);
  EXPECT_NE(text.find(fmt::format("compile {:.2f} s incl. params wait {:.2f} s", r.compile_seconds,
                                  r.params_wait_seconds)),
            std::string::npos)
      << text;
  const size_t done = text.find("done: 30 steps");
  ASSERT_NE(done, std::string::npos) << text;
  const std::string summary = text.substr(done, text.find('\n', done) - done);
  EXPECT_NE(summary.find(fmt::format("evaluation {:.2f} s", r.eval_seconds)), std::string::npos) << summary;
  EXPECT_NE(text.find("wall time", done), std::string::npos) << text;
  EXPECT_NE(text.find("(3 x 3 batches", done), std::string::npos) << text;
  std::filesystem::remove(log);
}

TEST(TrainJob, TinyLlamaTrainsOnTextWithSizesFromOptions) {
  JobOptions o = quiet_mlp(20);
  o.model = "llama-tiny";
  o.data = "";  // the default text
  o.batch = 2;
  o.seq = 32;
  o.sizes.layers = 1;  // as `kiln train --layers 1 --kv-heads 1` gives them
  o.sizes.kv_heads = 1;
  o.eval_batches = 2;
  o.optimizer.lr = 3e-3;
  JobResult r = run_training_job(o);
  EXPECT_EQ(r.steps_done, 20);
  EXPECT_EQ(r.eval_name, "perplexity");
  EXPECT_LT(r.final_loss, 5.2);  // ln(256) = 5.55 at the start
  o.sizes.kv_heads = 3;          // 4 heads do not split into groups of 3 kv heads
  EXPECT_KILN_ERROR(run_training_job(o), "heads 4", "kv_heads 3");
}

TEST(TrainJob, EvalBatchesTakeTheFirstTestBatchesOfAClassifier) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions o = quiet_mlp(20);
  JobResult all = run_training_job(o);
  EXPECT_EQ(all.eval_batches, (10000 + 31) / 32);  // the whole test set, the last batch padded
  o.eval_batches = 4;
  JobResult some = run_training_job(o);
  EXPECT_EQ(some.eval_batches, 4);
  EXPECT_EQ(some.final_loss, all.final_loss);
  // 128 images: the accuracy is a multiple of 1/128.
  EXPECT_NEAR(some.eval_metric * 128, std::round(some.eval_metric * 128), 1e-9);
  o.eval_batches = -1;
  EXPECT_THROW(run_training_job(o), Error);
}

TEST(TrainDevice, AutoPicksTheGpuWhenThereIsOneAndBf16FromSm80) {
  const DeviceAvailability no_backend{false, 0, "this build has no CUDA backend", 0};
  const DeviceAvailability no_gpu{true, 0, "no CUDA device", 0};
  const DeviceAvailability h100{true, 1, "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB", 90};
  const DeviceAvailability t4{true, 1, "Tesla T4, sm_75, 14.6 GiB", 75};

  DeviceChoice c = choose_device("auto", "auto", h100);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.amp, "bf16");
  EXPECT_EQ(c.note, "device cuda (auto: NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB), amp bf16 (auto: sm_90 has bf16)");
  c = choose_device("auto", "auto", t4);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.amp, "off");  // no bf16 tensor cores before sm_80
  EXPECT_NE(c.note.find("sm_75 has no bf16"), std::string::npos) << c.note;
  for (const DeviceAvailability& none : {no_backend, no_gpu}) {
    c = choose_device("auto", "auto", none);
    EXPECT_EQ(c.device, "cpu");
    EXPECT_EQ(c.amp, "off");
    EXPECT_NE(c.note.find("auto: " + none.description), std::string::npos) << c.note;
  }
  // Explicit values win, whatever the machine has.
  c = choose_device("cpu", "auto", h100);
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.amp, "off");
  c = choose_device("auto", "f16", h100);
  EXPECT_EQ(c.amp, "f16");
  c = choose_device("cuda", "off", h100);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.amp, "off");
  EXPECT_EQ(c.note, "device cuda (as asked), amp off (as asked)");
  c = choose_device("cpu", "bf16", no_backend);
  EXPECT_EQ(c.amp, "bf16");
  EXPECT_THROW(choose_device("tpu", "auto", h100), Error);
  EXPECT_THROW(choose_device("auto", "fp4", h100), Error);
  // fp8 needs FP8 tensor cores (sm_89+): refused by name on an older GPU, taken on the CPU
  // (emulated) and on an H100.
  DeviceAvailability a100 = h100;
  a100.compute_capability = 80;
  EXPECT_KILN_ERROR(choose_device("cuda", "fp8", a100), "--amp fp8", "sm_80", "--amp bf16");
  EXPECT_EQ(choose_device("cuda", "fp8", h100).amp, "fp8");
  EXPECT_EQ(choose_device("cpu", "fp8", a100).amp, "fp8");
}

TEST(TrainJob, AutoDeviceRunsWhereTheMachineSays) {
  JobOptions o = quiet_mlp(3);
  o.model = "gpt2-tiny";
  o.data = "";
  o.batch = 2;
  o.seq = 16;
  o.eval_batches = 1;
  o.device = "auto";
  o.optimizer.amp = "auto";
  JobResult r = run_training_job(o);
  const DeviceChoice expected = choose_device("auto", "auto", device_availability(Device::kCuda));
  EXPECT_EQ(r.device, expected.device);
  EXPECT_EQ(r.amp, expected.amp);
  EXPECT_EQ(r.steps_done, 3);
}

// ---- ONNX models: their data inputs bound by shape (bind_data_inputs) ----

// The error message of bind_data_inputs(IR text's graph, data).
std::string binding_error(const std::string& text, const std::string& data) {
  try {
    bind_data_inputs(parse(text), data);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

constexpr const char* kImagesModel =
    "graph @g(%x: f32[4,1,28,28] data, %labels: i64[4] data, %w: f32[784,10] param) {\n"
    "  %f = reshape(%x) {shape=[4, 784]} : f32[4,784]\n"
    "  %l = matmul(%f, %w) : f32[4,10]\n"
    "  %loss = cross_entropy(%l, %labels) : f32[]\n"
    "  return %loss\n}\n";
constexpr const char* kTokensModel =
    "graph @g(%ids: i64[2,8] data, %next: i64[2,8] data, %e: f32[256,16] param, %w: f32[16,256] param) {\n"
    "  %h = gather(%e, %ids) : f32[2,8,16]\n"
    "  %l = matmul(%h, %w) : f32[2,8,256]\n"
    "  %loss = cross_entropy(%l, %next) : f32[]\n"
    "  return %loss\n}\n";

TEST(TrainOnnxBinding, ImagesAndLabelsBindToFashionMnist) {
  for (const char* shape : {"f32[4,1,28,28]", "f32[4,28,28]", "f32[4,784]"}) {
    std::string text = kImagesModel;
    text.replace(text.find("f32[4,1,28,28]"), 14, shape);
    const DataBinding b = bind_data_inputs(parse(text), "");
    EXPECT_EQ(b.data, "fashion-mnist") << shape;
    EXPECT_EQ(b.roles, (std::vector<InputRole>{InputRole::kImages, InputRole::kLabels})) << shape;
    EXPECT_EQ(bind_data_inputs(parse(text), "fashion-mnist").roles, b.roles);
  }
}

TEST(TrainOnnxBinding, TokenIdsBindToText) {
  const DataBinding b = bind_data_inputs(parse(kTokensModel), "");
  EXPECT_EQ(b.data, kDefaultTextPath);
  EXPECT_EQ(b.roles, (std::vector<InputRole>{InputRole::kTokens, InputRole::kNextTokens}));
  EXPECT_EQ(bind_data_inputs(parse(kTokensModel), "/some/text.txt").data, "/some/text.txt");
}

TEST(TrainOnnxBinding, RandomBindsAnyInputs) {
  const DataBinding b = bind_data_inputs(parse(kImagesModel), "random");
  EXPECT_EQ(b.roles, (std::vector<InputRole>{InputRole::kRandom, InputRole::kRandom}));
}

TEST(TrainOnnxBinding, InputsThatCannotBeBoundAreNamedInOneError) {
  // Tokens to Fashion-MNIST, images to a text, and a third input neither takes.
  std::string e = binding_error(kTokensModel, "fashion-mnist");
  EXPECT_NE(e.find("--data fashion-mnist: cannot bind 'ids' (i64[2,8]), 'next' (i64[2,8])"), std::string::npos) << e;
  EXPECT_NE(e.find("--data random"), std::string::npos) << e;
  e = binding_error(kImagesModel, "story.txt");
  EXPECT_NE(e.find("--data 'story.txt' (a text): cannot bind 'x' (f32[4,1,28,28]), 'labels' (i64[4])"),
            std::string::npos) << e;
  const std::string with_mask = std::string(kTokensModel).replace(std::string(kTokensModel).find("%e:"), 0,
                                                                   "%mask: f32[2,8] data, ");
  e = binding_error(with_mask, "");
  EXPECT_NE(e.find("no built-in dataset fits the model's inputs 'ids' (i64[2,8]), 'next' (i64[2,8]), 'mask' "
                   "(f32[2,8])"), std::string::npos) << e;
  EXPECT_NE(e.find("give --data random"), std::string::npos) << e;
  // Colour images.
  e = binding_error("graph @g(%x: f32[4,3,28,28] data, %labels: i64[4] data, %w: f32[28] param) {\n"
                    "  %y = mul(%x, %w) : f32[4,3,28,28]\n  %s = mean(%y) : f32[]\n  return %s\n}\n",
                    "fashion-mnist");
  EXPECT_NE(e.find("cannot bind 'x' (f32[4,3,28,28])"), std::string::npos) << e;
  // Labels alone: no input takes the images.
  e = binding_error("graph @g(%labels: i64[4] data, %w: f32[4] param) {\n  %s = sum(%w) : f32[]\n  return %s\n}\n",
                    "fashion-mnist");
  EXPECT_NE(e.find("no input takes the images"), std::string::npos) << e;
}

TEST(TrainOnnxBinding, EvaluationLeavesTheRunningStatisticsAlone) {
  // A graph with an update of its state (what an imported BatchNorm has): evaluation runs the
  // forward without writing the state back; a training step writes it.
  Graph g = parse(
      "graph @g(%x: f32[4,3] data, %w: f32[3] param, %running: f32[3] state) {\n"
      "  %m = mean(%x) {axes=[0]} : f32[3]\n"
      "  %y = mul(%x, %w) : f32[4,3]\n"
      "  %loss = mean(%y) : f32[]\n"
      "  %half = full() {dtype=f32, shape=[], value=0.5} : f32[]\n"
      "  %r = mul(%running, %half) : f32[3]\n"
      "  %new = add(%r, %m) : f32[3]\n"
      "  update %running = %new\n"
      "  return %loss\n}\n");
  Trainer trainer(g, OptimizerConfig{}, {testing::rand(DType::kF32, {3}, 1)});
  auto running = [&] { return trainer.named_tensors().at("running").clone(); };
  const Tensor before = running();
  trainer.evaluate({testing::rand(DType::kF32, {4, 3}, 2)});
  EXPECT_TRUE(testing::all_close(running(), before, 0, 0));
  trainer.step({testing::rand(DType::kF32, {4, 3}, 3)});
  EXPECT_FALSE(testing::all_close(running(), before, 0, 0));
}

#ifdef KILN_HAVE_ONNX
// A small ONNX model file written here (the ONNX library's protobuf classes), so that jobs on
// imported models run without PyTorch.
class OnnxFile {
 public:
  OnnxFile() {
    model_.set_ir_version(8);
    model_.set_producer_name("kiln-test");
    auto* opset = model_.add_opset_import();
    opset->set_domain("");
    opset->set_version(17);
  }
  void input(const std::string& name, int elem_type, const std::vector<int64_t>& dims) {
    auto* in = model_.mutable_graph()->add_input();
    in->set_name(name);
    auto* t = in->mutable_type()->mutable_tensor_type();
    t->set_elem_type(elem_type);
    for (int64_t d : dims) t->mutable_shape()->add_dim()->set_dim_value(d);
  }
  void weights(const std::string& name, const std::vector<int64_t>& dims, uint64_t seed) {
    auto* t = model_.mutable_graph()->add_initializer();
    t->set_name(name);
    t->set_data_type(::onnx::TensorProto::FLOAT);
    int64_t n = 1;
    for (int64_t d : dims) {
      t->add_dims(d);
      n *= d;
    }
    const Tensor values = testing::rand(DType::kF32, {n}, seed, -0.1, 0.1);
    for (int64_t i = 0; i < n; ++i) t->add_float_data(static_cast<float>(values.get(i)));
  }
  void shape(const std::string& name, const std::vector<int64_t>& dims) {
    auto* t = model_.mutable_graph()->add_initializer();
    t->set_name(name);
    t->set_data_type(::onnx::TensorProto::INT64);
    t->add_dims(static_cast<int64_t>(dims.size()));
    for (int64_t d : dims) t->add_int64_data(d);
  }
  void node(const std::string& op, const std::vector<std::string>& inputs, const std::string& output) {
    auto* n = model_.mutable_graph()->add_node();
    n->set_op_type(op);
    n->set_name(output);
    for (const std::string& in : inputs) n->add_input(in);
    n->add_output(output);
  }
  std::string save(const std::string& name) {
    model_.mutable_graph()->set_name("test");
    auto* out = model_.mutable_graph()->add_output();
    out->set_name("loss");
    out->mutable_type()->mutable_tensor_type()->set_elem_type(::onnx::TensorProto::FLOAT);
    const std::string path = temp_dir(name) + ".onnx";
    std::ofstream file(path, std::ios::binary);
    model_.SerializeToOstream(&file);
    return path;
  }

 private:
  ::onnx::ModelProto model_;
};

// Images (4, 1, 28, 28) and labels (4,): a linear classifier.
std::string images_onnx() {
  OnnxFile f;
  f.input("x", ::onnx::TensorProto::FLOAT, {4, 1, 28, 28});
  f.input("labels", ::onnx::TensorProto::INT64, {4});
  f.weights("w", {784, 10}, 5);
  f.shape("flat", {4, 784});
  f.node("Reshape", {"x", "flat"}, "f");
  f.node("MatMul", {"f", "w"}, "logits");
  f.node("SoftmaxCrossEntropyLoss", {"logits", "labels"}, "loss");
  return f.save("images");
}

// Token ids and their next tokens (2, 8) over bytes: an embedding and a head.
std::string tokens_onnx() {
  OnnxFile f;
  f.input("ids", ::onnx::TensorProto::INT64, {2, 8});
  f.input("labels", ::onnx::TensorProto::INT64, {2, 8});
  f.weights("emb", {256, 16}, 6);
  f.weights("head", {16, 256}, 7);
  f.shape("rows", {16, 256});
  f.shape("flat", {16});
  f.node("Gather", {"emb", "ids"}, "h");
  f.node("MatMul", {"h", "head"}, "l3");
  f.node("Reshape", {"l3", "rows"}, "logits");
  f.node("Reshape", {"labels", "flat"}, "targets");
  f.node("SoftmaxCrossEntropyLoss", {"logits", "targets"}, "loss");
  return f.save("tokens");
}

JobOptions quiet_onnx(const std::string& path, const std::string& data, int64_t steps) {
  JobOptions o;
  o.model = path;
  o.data = data;
  o.batch = 0;
  o.steps = steps;
  o.eval_every = steps;
  o.eval_batches = 3;
  o.out = std::fopen("/dev/null", "w");
  return o;
}

TEST(TrainOnnx, ImagesTrainOnFashionMnist) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobResult r = run_training_job(quiet_onnx(images_onnx(), "", 40));
  EXPECT_EQ(r.steps_done, 40);
  EXPECT_EQ(r.eval_name, "loss");
  EXPECT_EQ(r.eval_batches, 3);
  EXPECT_TRUE(std::isfinite(r.eval_metric));
  EXPECT_LT(r.eval_metric, std::log(10.0));  // better than chance after 40 steps
}

TEST(TrainOnnx, TokensTrainOnATextFile) {
  const std::string text = temp_dir("tokens_text") + ".txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 200; ++i) out << "the quick brown fox jumps over the lazy dog. ";
  }
  JobResult r = run_training_job(quiet_onnx(tokens_onnx(), text, 30));
  EXPECT_EQ(r.eval_name, "perplexity");
  EXPECT_LT(r.eval_metric, 256.0);  // better than uniform over bytes
  EXPECT_GT(r.final_loss, 0.0);
}

TEST(TrainOnnx, RandomInputsTrainAnyModel) {
  JobResult r = run_training_job(quiet_onnx(images_onnx(), "random", 3));
  EXPECT_EQ(r.steps_done, 3);
  EXPECT_EQ(r.eval_name, "loss");
  EXPECT_TRUE(std::isfinite(r.final_loss));
}

TEST(TrainOnnx, ClearErrors) {
  auto error_of = [](JobOptions o) {
    try {
      run_training_job(o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string e = error_of(quiet_onnx(tokens_onnx(), "fashion-mnist", 1));
  EXPECT_NE(e.find("cannot bind 'ids' (i64[2,8]), 'labels' (i64[2,8])"), std::string::npos) << e;
  JobOptions o = quiet_onnx(images_onnx(), "random", 1);
  o.batch = 8;
  e = error_of(o);
  EXPECT_NE(e.find("--batch 8: model"), std::string::npos) << e;
  EXPECT_NE(e.find("takes batches of 4"), std::string::npos) << e;
  o = quiet_onnx(images_onnx(), "random", 1);
  o.sizes.layers = 4;
  EXPECT_NE(error_of(o).find("an ONNX model's sizes are the file's"), std::string::npos);
  o = quiet_onnx(tokens_onnx(), "", 1);  // GPL-3's bytes fit a vocabulary of 256: fine; a bad path is not
  o.data = "/nonexistent/text.txt";
  EXPECT_NE(error_of(o).find("/nonexistent/text.txt"), std::string::npos);
}
#endif

}  // namespace
}  // namespace kiln::train
