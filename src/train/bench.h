// `kiln bench`: training steps of a model on random data (no data loading), timed: ms per step
// (each waited for, and issued back to back), tokens/s, MFU, device memory, and where the first
// step's time went. The step is a training session's (session.h); on request the timed steps
// are followed by a profiled or a traced session of the same step.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "compile/training_graph.h"
#include "frontend/onnx/onnx_import.h"
#include "models/models.h"
#include "passes/pass.h"

namespace kiln::train {

struct BenchOptions {
  std::string model = "gpt2";     // models::model_names(), or an ONNX model file (.onnx)
  onnx::ImportOptions onnx;       // for an ONNX model: dynamic dims, frozen params, its loss
  int64_t batch = 32;
  int64_t seq = 0;                // language models: 0 = the config's
  models::ModelSizes sizes;       // language models: sizes overriding the config's (seq above)
  std::string amp = "bf16";       // off | bf16 | f16 | auto (choose_device)
  OptimizerConfig optimizer;      // its amp is `amp` above
  std::string shard = "auto";     // in a group (kiln launch): as SessionOptions::shard; batch is global
  std::string device = "cuda";    // cpu | cuda | auto
  int64_t steps = 20;             // timed steps
  int64_t untimed_steps = 5;      // untimed steps first (on cuda the first three run, tune and capture)
  bool cuda_graphs = true;
  bool tune_gemms = true;         // ExecutorOptions::tune_gemms (the second step tunes the products)
  double peak_flops = 0;          // the device's peak rate for MFU; 0 = from the device table
  uint64_t seed = 0;
  std::FILE* out = stdout;        // the report; nullptr = none
  bool json = false;              // also one JSON line with the numbers, last (scripts/gpu-check.sh)
  PassOptions passes;             // the pipeline's: disabled passes, memory budget (remat.h), logits chunks
  // cuda only; "" = none. After the timed steps, a second trainer whose step executor profiles
  // (ExecutorOptions::profile: events around every kernel, no CUDA graph) runs 2 warm-up steps
  // and 1 profiled one; the per-kernel table (top 25 nodes) goes to `out`, before the report
  // (so that the JSON line stays last), and a Chrome trace-event JSON of the step to this path.
  std::string profile_path;
  // cuda only (a build with CUPTI); "" = none. After the timed steps (and before --profile's), a
  // trainer built while a device trace (DeviceRuntime::create_trace) exists runs 4 untraced
  // steps (run, tune, capture, replay), then `timeline_steps` graph-replayed steps back to back,
  // traced: the step's span, busy and idle times, its largest gaps and a per-node table
  // (timeline_report) go to `out`, and a Chrome trace-event JSON of the traced steps on the
  // device's clock to this path.
  std::string timeline_path;
  int64_t timeline_steps = 10;
};

struct BenchResult {
  std::string device_name;
  int world_size = 1;             // ranks (GPUs) the step spans
  std::string shard = "none";
  size_t max_peak_bytes = 0;      // the largest kiln_peak_bytes over the ranks
  int64_t params = 0;             // parameter count N
  int64_t tokens_per_step = 0;    // B*T (LMs) or B (classifiers)
  double flops_per_step = 0;      // 6*N*tokens + 12*layers*T*d_model*tokens (attention)
  double median_ms = 0;           // per step, each step waited for
  double pipelined_ms = 0;        // mean over `steps` steps issued back to back, one wait at the end
  double tokens_per_s = 0;        // from median_ms
  double peak_flops = 0;          // what MFU divides by; 0 = unknown (CPU): no MFU
  std::string peak_note;          // where peak_flops comes from
  double mfu = 0;
  double first_step_s = 0;        // process start to the end of the first step
  double compile_s = 0;           // trainer construction: passes, kernel choice, memory plan
  double setup_s = 0;             // process start to the trainer's construction (model, init)
  double first_run_s = 0;         // the first step itself: kernel compiles, capture, the step
  // Where setup_s and compile_s went, in order (seconds): setup's "start" (process start to the
  // benchmark: loading, the CLI), "model" (a zoo model's params are drawn beside the compile:
  // Trainer::build_seconds' "params wait") or "model and params" (an ONNX file's), "CUDA
  // context"; then Trainer::build_seconds.
  std::vector<std::pair<std::string, double>> setup_parts, build_parts;
  double final_loss = 0;
  // Every step's loss, in order (the first step, the untimed, timed and back-to-back ones; the
  // last is final_loss): where two runs part shows in them.
  std::vector<double> losses;
  // CUDA memory: what kiln allocated (params + state, the step's arena and outputs, anything
  // else through DeviceRuntime::allocate such as kernel workspaces), its peak, and the growth of
  // the device's used bytes (DeviceRuntime::memory_info) from before the trainer to after the
  // timed steps.
  size_t param_state_bytes = 0;
  size_t host_state_bytes = 0;    // optimizer state offloaded to pinned host memory (--offload)
  int64_t host_state_tensors = 0;
  size_t arena_bytes = 0;
  size_t kiln_peak_bytes = 0;
  size_t device_used_delta_bytes = 0;
  int64_t graph_replays = 0;
  int64_t kernels_per_step = 0;   // nodes of the step graph (one kernel launch each, captured)
  std::string fp8_note;           // amp fp8: how many products run in fp8 (passes/fp8_linear.h)
  size_t updates_in_place = 0, updates = 0;  // updates written by their node / all updates
};

// Throws kiln::Error (bad options; on cuda no device, or the step does not fit in memory, the
// message naming the bytes needed and free).
BenchResult run_benchmark(const BenchOptions& options);
// Dense peak rate of `device_name` (cudaDeviceProp name) for the step's math: bf16/f16 tensor
// cores under amp, tf32 tensor cores otherwise. 0 when unknown. `note` says which.
double device_peak_flops(const std::string& device_name, const std::string& amp, std::string* note);

}  // namespace kiln::train
