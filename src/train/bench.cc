#include "train/bench.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "distributed/process_group.h"
#include "passes/fp8_linear.h"
#include "runtime/profile.h"
#include "support/bytes.h"
#include "support/error.h"
#include "support/stopwatch.h"
#include "train/placement.h"
#include "train/session.h"
#include "train/tasks.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

// Seconds since this process started (the kernel's start time, so it counts the dynamic loader
// and the CLI's re-exec too); falls back to 0 if /proc is unreadable.
double seconds_since_process_start() {
  std::ifstream stat("/proc/self/stat"), uptime("/proc/uptime");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  double up = 0;
  uptime >> up;
  size_t close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos || up <= 0) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return up - std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  return 0;
}

}  // namespace

double device_peak_flops(const std::string& name, const std::string& amp, std::string* note) {
  struct Peak {
    const char* match;
    const char* label;
    double half, tf32;  // dense tensor-core rates
  };
  // NVIDIA's datasheet numbers, dense (no sparsity). H200 has the H100 SXM's compute.
  static const Peak kPeaks[] = {
      {"H100 PCIe", "H100 PCIe", 756e12, 378e12}, {"H100 NVL", "H100 NVL", 835e12, 417.5e12},
      {"H100", "H100 SXM", 989e12, 494.7e12},     {"H200", "H200 (H100 SXM compute)", 989e12, 494.7e12},
      {"A100", "A100", 312e12, 156e12},
  };
  // fp8 runs are measured against the bf16 peak, so that their MFU compares with bf16 runs'.
  const bool half = amp == "bf16" || amp == "f16" || amp == "fp8";
  const std::string rate = amp == "fp8" ? "bf16 (fp8 counted against it)" : half ? amp : "tf32";
  for (const Peak& p : kPeaks) {
    if (name.find(p.match) == std::string::npos) continue;
    if (note) *note = fmt::format("{} dense {} peak {:.1f} TFLOP/s", p.label, rate, (half ? p.half : p.tf32) / 1e12);
    return half ? p.half : p.tf32;
  }
  if (note) *note = "peak unknown for this device (give --peak-tflops)";
  return 0;
}

namespace {

// The benchmark once the device is chosen and, in a group, the group joined.
BenchResult run_bench(BenchOptions o, ProcessGroup* group, double entered_s) {
  const int world = group ? group->world_size() : 1, rank = group ? group->rank() : 0;
  if (rank != 0) o.out = nullptr;
  KILN_CHECK(o.profile_path.empty() || world == 1, "--profile runs on one process (drop kiln launch; --timeline "
             "traces a group's steps)");
  const double group_joined_s = seconds_since_process_start();
  const std::unique_ptr<DeviceRuntime> runtime = runtime_of(o.device);
  const bool on_cuda = runtime->device() == Device::kCuda;
  const double runtime_s = seconds_since_process_start();
  const bool from_onnx = is_onnx_model(o.model);
  KILN_CHECK(from_onnx || std::find(models::model_names().begin(), models::model_names().end(), o.model) != models::model_names().end(),
             "unknown model '{}' (expected {}, or an ONNX file MODEL.onnx)", o.model, models::model_names_text());
  KILN_CHECK(o.profile_path.empty() || on_cuda, "--profile needs --device cuda (it times kernels with CUDA events)");
  KILN_CHECK(o.timeline_path.empty() || on_cuda, "--timeline needs --device cuda (it traces the GPU's work)");
  KILN_CHECK(o.timeline_path.empty() || runtime->can_trace(),
             "--timeline: this build cannot trace (no CUPTI at configure time); --profile times kernels without it");
  KILN_CHECK(o.timeline_path.empty() || o.cuda_graphs,
             "--timeline traces graph-replayed steps: drop --no-cuda-graphs (--profile times kernels without graphs)");
  KILN_CHECK(o.timeline_steps > 0, "--timeline-steps must be > 0, got {}", o.timeline_steps);
  KILN_CHECK(o.batch > 0 && o.steps > 0 && o.untimed_steps >= 0,
             "--batch and --steps must be > 0 and --untimed-steps >= 0, got {}, {}, {}", o.batch, o.steps, o.untimed_steps);
  KILN_CHECK(o.batch % world == 0, "--batch {} (the global batch) does not split over {} ranks", o.batch, world);
  BenchResult r;
  r.world_size = world;
  const models::ModelSizes sizes = sizes_of(o.sizes, o.seq);
  Model model;
  Graph& forward = model.forward;
  int64_t int_high = 10, layers = 0, seq = 1, d_model = 0;
  std::vector<int64_t> index_bounds;  // per data input: integers are drawn from [0, bound)
  if (from_onnx) {
    KILN_CHECK(world == 1, "an ONNX model benchmarks in one process (its batch is the file's)");
    model = import_onnx_model(o.model, o.onnx);
    index_bounds = data_index_bounds(forward);
    const Value& first = forward.value(forward.inputs.front().value);
    r.tokens_per_step = first.type.rank() > 0 ? first.type.shape[0] : 1;
  } else if (models::is_language_model(o.model)) {
    forward = models::by_name(o.model, o.batch / world, sizes);  // this rank's rows
    const models::LanguageModelInfo config = models::language_model_info(o.model, sizes);
    int_high = config.vocab;
    layers = config.layers;
    seq = config.seq;
    d_model = config.d_model;
    // Drawn by the session while the step compiles (zero3: each rank only its shards).
    model.draw_params = zoo_param_draw(forward, o.model, o.seed, sizes);
    r.tokens_per_step = o.batch * config.seq;
  } else {
    forward = models::by_name(o.model, o.batch / world, o.seq);
    model.draw_params = zoo_param_draw(forward, o.model, o.seed);
    r.tokens_per_step = o.batch;
  }
  const double params_s = seconds_since_process_start();
  std::vector<std::vector<Tensor>> batches(2);
  for (size_t k = 0; k < batches.size(); ++k)
    for (const GraphInput& in : forward.inputs) {
      if (in.role != Role::kData) continue;
      const TensorType& type = forward.type(in.value);
      bool integer = is_integer(type.dtype);
      const double high = !integer ? 1.0 : from_onnx ? static_cast<double>(index_bounds[batches[k].size()])
                                                     : static_cast<double>(int_high);
      batches[k].push_back(random_tensor(type, o.seed * 7919 + 31 * k + batches[k].size() + 1009 * rank, integer ? 0.0 : -1.0,
                                         high));
    }
  for (const GraphInput& in : forward.inputs)
    if (in.role == Role::kParam) r.params += forward.type(in.value).numel();
  r.flops_per_step = 6.0 * static_cast<double>(r.params) * static_cast<double>(r.tokens_per_step) +
                     12.0 * static_cast<double>(layers * seq * d_model) * static_cast<double>(r.tokens_per_step);

  SessionOptions session_options;
  session_options.device = o.device;
  session_options.shard = o.shard;
  session_options.optimizer = o.optimizer;
  session_options.optimizer.amp = o.amp;
  session_options.executor.cuda_graphs = o.cuda_graphs;
  session_options.executor.tune_gemms = o.tune_gemms;
  session_options.agreement = fmt::format("{} {} {} {}", o.model, o.batch, o.seq, sizes_text(o.sizes));
  // The profiling and tracing sessions (--profile, --timeline) need the model again (a zoo
  // model's draw draws the same params again): the first session is gone by then (two step
  // arenas at once may not fit).
  Model again;
  if (!o.profile_path.empty() || !o.timeline_path.empty()) {
    again = model;
    for (Tensor& t : again.params) t = t.clone();
  }
  const double context_from_s = seconds_since_process_start();
  size_t free_before = on_cuda ? runtime->memory_info().free_bytes : 0;  // the first call: CUDA's context
  runtime->reset_peak_allocated_bytes();
  r.setup_s = seconds_since_process_start();
  r.setup_parts = {{"start", entered_s}};
  if (group) r.setup_parts.emplace_back("process group", group_joined_s - entered_s);
  r.setup_parts.emplace_back("runtime", runtime_s - group_joined_s);
  r.setup_parts.emplace_back(model.draw_params ? "model" : "model and params", params_s - runtime_s);
  r.setup_parts.emplace_back("data", context_from_s - params_s);
  if (on_cuda) r.setup_parts.emplace_back("CUDA context", r.setup_s - context_from_s);
  Stopwatch phase;
  // Once: every rank measures the group's collectives together, and the later sessions reuse it.
  session_options.passes = passes_for(o.passes, group, *runtime);
  auto session = std::make_unique<TrainingSession>(std::move(model), session_options, group);
  Trainer& trainer = session->trainer();
  r.shard = session->shard();
  const std::string shard_note = session->shard_note();
  r.compile_s = phase.lap();
  r.build_parts = trainer.build_seconds();

  phase.lap();
  trainer.step(batches[0]);
  trainer.synchronize();
  r.first_step_s = seconds_since_process_start();
  r.first_run_s = phase.lap();
  for (int64_t i = 1; i < o.untimed_steps; ++i) trainer.step(batches[i % 2]);
  trainer.synchronize();
  std::vector<double> ms;
  for (int64_t i = 0; i < o.steps; ++i) {
    const Stopwatch step_time;
    trainer.step(batches[i % 2]);
    trainer.synchronize();
    ms.push_back(1e3 * step_time.seconds());
  }
  const Stopwatch back_to_back;
  for (int64_t i = 0; i < o.steps; ++i) trainer.step(batches[i % 2]);
  std::vector<double> losses = trainer.take_losses();  // waits for the last step
  r.pipelined_ms = 1e3 * back_to_back.seconds() / static_cast<double>(o.steps);
  r.final_loss = losses.empty() ? NAN : losses.back();
  r.losses = losses;
  r.median_ms = median_of(ms);
  r.tokens_per_s = static_cast<double>(r.tokens_per_step) / (r.median_ms / 1e3);
  if (on_cuda) {
    r.device_name = runtime->name();
    r.peak_flops = o.peak_flops > 0 ? o.peak_flops : device_peak_flops(r.device_name, o.amp, &r.peak_note);
    if (o.peak_flops > 0) r.peak_note = fmt::format("given peak {:.1f} TFLOP/s", o.peak_flops / 1e12);
    r.param_state_bytes = trainer.param_and_state_bytes();
    for (const auto& [name, t] : trainer.named_tensors())
      if (t.device() != runtime->device()) {
        r.host_state_bytes += t.bytes();
        ++r.host_state_tensors;
      }
    r.arena_bytes = trainer.step_executor().device_bytes();
    r.kiln_peak_bytes = runtime->peak_allocated_bytes();
    r.max_peak_bytes = static_cast<size_t>(trainer.reduce_over_ranks(static_cast<double>(r.kiln_peak_bytes), ReduceOp::kMax));
    size_t free_after = runtime->memory_info().free_bytes;
    r.device_used_delta_bytes = free_before > free_after ? free_before - free_after : 0;
    r.graph_replays = trainer.step_executor().graph_replays();
    r.updates_in_place = trainer.step_executor().direct_update_count();
  } else {
    r.device_name = "cpu";
    r.peak_flops = o.peak_flops;
    r.peak_note = o.peak_flops > 0 ? fmt::format("given peak {:.1f} TFLOP/s", o.peak_flops / 1e12)
                                   : "no peak rate for the CPU (give --peak-tflops for an MFU)";
  }
  r.kernels_per_step = static_cast<int64_t>(trainer.step_executor().graph().nodes.size());
  if (o.amp == "fp8") r.fp8_note = fp8_summary(trainer.step_executor().graph());
  r.updates = trainer.step_executor().graph().updates.size();
  // Per GPU: each does 1/world of the global step's FLOPs.
  r.mfu = r.peak_flops > 0 ? r.flops_per_step / world / (r.median_ms / 1e3) / r.peak_flops : 0;
  // --timeline and --profile: before the report, so that the report (and its JSON line) stays last.
  if (!o.timeline_path.empty() || !o.profile_path.empty()) session.reset();
  auto another_session = [&](bool profile) {
    Model copy = again;
    for (Tensor& t : copy.params) t = t.clone();
    SessionOptions options = session_options;
    options.executor.profile = profile;
    return std::make_unique<TrainingSession>(std::move(copy), options, group);
  };
  if (!o.timeline_path.empty()) {
    // In a group every rank runs the traced steps (their collectives need each other); rank 0
    // writes and reports its own trace, the communication stream's kernels beside the compute.
    // The trace exists before the trainer so that its graph's capture names every kernel's node.
    const std::unique_ptr<DeviceTrace> trace = runtime->create_trace();
    const std::unique_ptr<TrainingSession> traced_session = another_session(false);
    Trainer* traced = &traced_session->trainer();
    for (int i = 0; i < 4; ++i) traced->step(batches[static_cast<size_t>(i % 2)]);  // run, tune, capture, replay
    traced->synchronize();
    trace->start();
    for (int64_t i = 0; i < o.timeline_steps; ++i) traced->step(batches[static_cast<size_t>(i % 2)]);
    traced->synchronize();
    std::vector<std::vector<TraceEvent>> steps = split_steps(trace->stop());
    const std::vector<NodeTiming> labels = traced->step_executor().node_labels();
    if (rank == 0) write_timeline_trace(steps, labels, o.timeline_path);
    if (o.out) {
      fmt::print(o.out, "{}", timeline_report(steps, labels, 25));
      fmt::print(o.out, "timeline written to {} (open in chrome://tracing or ui.perfetto.dev)\n", o.timeline_path);
    }
  }
  if (!o.profile_path.empty()) {
    const std::unique_ptr<TrainingSession> profiling_session = another_session(true);
    Trainer& profiling = profiling_session->trainer();
    for (int i = 0; i < 3; ++i) profiling.step(batches[static_cast<size_t>(i % 2)]);  // run, tune, profiled
    std::vector<NodeTiming> timings = profiling.step_executor().profile();  // the last step
    write_chrome_trace(timings, o.profile_path);
    if (o.out) {
      fmt::print(o.out, "profile (one step, each kernel between CUDA events, no CUDA graph):\n{}",
                 profile_table(timings, 25));
      fmt::print(o.out, "trace written to {} (open in chrome://tracing or ui.perfetto.dev)\n", o.profile_path);
    }
  }
  if (o.out) {
    const std::string unit = models::is_language_model(o.model) ? "tokens" : "samples";
    fmt::print(o.out, "kiln bench: {} ({:.1f}M params), batch {}{}, amp {}, device {}{}\n", o.model,
               static_cast<double>(r.params) / 1e6, o.batch, models::is_language_model(o.model) ? fmt::format(", seq {}", seq) : "",
               o.amp, r.device_name, on_cuda ? (o.cuda_graphs ? ", CUDA graphs on" : ", CUDA graphs off") : "");
    fmt::print(o.out, "  ms/step          {:.2f} median of {} steps (each waited for); {:.2f} mean when issued back to back\n",
               r.median_ms, o.steps, r.pipelined_ms);
    if (world > 1) {
      fmt::print(o.out, "  ranks            {} ({}), shard {}; batch {} is {} a rank\n", world,
                 group->communicator()->engine(), shard_note, o.batch, o.batch / world);
      fmt::print(o.out, "  {}/s         {:.0f} total, {:.0f} per GPU\n", unit, r.tokens_per_s, r.tokens_per_s / world);
    } else {
      fmt::print(o.out, "  {}/s         {:.0f}\n", unit, r.tokens_per_s);
    }
    fmt::print(o.out, "  MFU{}          {}  ({:.3g} GFLOP/step = 6*N*{} + 12*L*T*d*{}; {})\n", world > 1 ? "/GPU" : "    ",
               r.peak_flops > 0 ? fmt::format("{:.3f}", r.mfu) : "n/a", r.flops_per_step / 1e9, unit, unit, r.peak_note);
    if (on_cuda)
      fmt::print(o.out, "  executor         {} kernels per step, {} CUDA graph replays, {} of {} updates written in place\n",
                 r.kernels_per_step, r.graph_replays, r.updates_in_place, r.updates);
    if (on_cuda)
      fmt::print(o.out, "  device memory    kiln peak {}{} (params+state {}, step arena+outputs {}); cudaMemGetInfo used +{}\n",
                 format_bytes(r.kiln_peak_bytes),
                 world > 1 ? fmt::format(" on rank 0, {} the most of any rank", format_bytes(r.max_peak_bytes)) : "",
                 format_bytes(r.param_state_bytes), format_bytes(r.arena_bytes), format_bytes(r.device_used_delta_bytes));
    if (on_cuda && r.host_state_tensors > 0)
      fmt::print(o.out, "  offloaded        {} optimizer state tensors, {} in pinned host memory{}\n", r.host_state_tensors,
                 format_bytes(r.host_state_bytes), world > 1 ? " on rank 0" : "");
    if (!r.fp8_note.empty()) fmt::print(o.out, "  {}\n", r.fp8_note);
    if (o.passes.memory_budget)
      fmt::print(o.out, "  memory budget    {} for the step's planned arena (rematerialization)\n",
                 format_bytes(*o.passes.memory_budget));
    fmt::print(o.out,
               "  first step       {:.2f} s after process start (setup {:.2f} s, trainer build {:.2f} s, "
               "first step {:.2f} s)\n",
               r.first_step_s, r.setup_s, r.compile_s, r.first_run_s);
    auto parts = [](const std::vector<std::pair<std::string, double>>& v) {
      std::string out;
      for (const auto& [name, s] : v) out += fmt::format("{}{} {:.2f}", out.empty() ? "" : ", ", name, s);
      return out;
    };
    fmt::print(o.out, "                   setup: {}; trainer build: {}\n", parts(r.setup_parts), parts(r.build_parts));
    fmt::print(o.out, "  final loss       {:.4f}\n", r.final_loss);
    if (o.json) {
      auto gib = [](size_t bytes) { return std::round(static_cast<double>(bytes) / double(1ull << 30) * 100) / 100; };
      nlohmann::json j{{"model", o.model}, {"amp", o.amp}, {"batch", o.batch}, {"seq", seq}, {"device", r.device_name},
                       {"world_size", world}, {"shard", r.shard}, {"max_peak_gib", gib(r.max_peak_bytes)},
                       {"host_state_gib", gib(r.host_state_bytes)}, {"host_state_tensors", r.host_state_tensors},
                       {"cuda_graphs", on_cuda && o.cuda_graphs}, {"params", r.params},
                       {"ms_per_step", std::round(r.median_ms * 100) / 100},
                       {"pipelined_ms", std::round(r.pipelined_ms * 100) / 100},
                       {"tokens_per_s", std::round(r.tokens_per_s)}, {"mfu", std::round(r.mfu * 1000) / 1000},
                       {"peak_note", r.peak_note}, {"peak_gib", gib(r.kiln_peak_bytes)},
                       {"used_delta_gib", gib(r.device_used_delta_bytes)},
                       {"first_step_s", std::round(r.first_step_s * 100) / 100},
                       {"compile_s", std::round(r.compile_s * 100) / 100},
                       {"setup_s", std::round(r.setup_s * 100) / 100},
                       {"first_run_s", std::round(r.first_run_s * 100) / 100}, {"final_loss", r.final_loss},
                       {"losses", r.losses}};
      fmt::print(o.out, "{}\n", j.dump());
    }
  }
  return r;
}

}  // namespace

BenchResult run_benchmark(const BenchOptions& options) {
  const double entered_s = seconds_since_process_start();
  BenchOptions o = options;
  if (o.device == "auto" || o.amp == "auto") {
    const DeviceChoice choice = choose_device(o.device, o.amp, device_availability(Device::kCuda));
    o.device = choice.device;
    o.amp = choice.amp;
  }
  // In a group (kiln launch): join it before the runtime takes the current GPU; rank 0 reports.
  const std::unique_ptr<ProcessGroup> group = join_group(o.device);
  try {
    return run_bench(o, group.get(), entered_s);
  } catch (const Error& e) {
    fail_in_group(group.get(), e);
  }
}

}  // namespace kiln::train
