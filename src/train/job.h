// A training job: what `kiln train` runs. Picks the model and data, builds the trainer, runs
// the loop with a data-prefetch thread, prints progress, appends metrics as JSON lines, evaluates,
// checkpoints, resumes, and stops cleanly on a non-finite loss. Kept in the library (not the CLI)
// so tests can run small jobs.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "compile/training_graph.h"
#include "device/device_runtime.h"
#include "frontend/onnx/onnx_import.h"
#include "models/models.h"
#include "passes/pass.h"

namespace kiln {
class ProcessGroup;
}

namespace kiln::train {

class Trainer;

struct JobOptions {
  std::string model = "mlp";          // models::model_names(), or an ONNX model file (.onnx)
  onnx::ImportOptions onnx;           // for an ONNX model: dynamic dims, frozen params, its loss
  // fashion-mnist (classifiers) | a text or .tok file (LMs) | random (an ONNX model: random
  // inputs of its shapes); "" = the model's default (an ONNX model: the dataset its inputs fit,
  // bind_data_inputs)
  std::string data = "";
  std::string data_dir = "";          // Fashion-MNIST directory; "" = the Debian package's
  int64_t steps = 1000;
  int64_t batch = 64;                 // an ONNX model: 0 = the file's (any other must equal it)
  int64_t seq = 0;                    // LM sequence length; 0 = the config's
  models::ModelSizes sizes;           // LM sizes overriding the config's (--layers, ...; seq above)
  OptimizerConfig optimizer;
  PassOptions passes;                 // the pipeline's: memory budget, logits chunks, disabled passes
  uint64_t seed = 0;
  std::string device = "cpu";         // cpu | cuda | auto (choose_device); optimizer.amp may be "auto" too
  // Under a launcher (kiln launch, torchrun: WORLD_SIZE set) this process is one rank of a
  // data-parallel group; `batch` is the global batch, of which each rank trains its rows.
  std::string shard = "auto";         // dp | zero1 | zero2 | zero3 | auto (choose_shard_mode)
  std::string init_from = "";         // params by name from this safetensors file (kiln import-hf's) instead of random
  std::string checkpoint_dir = "";    // "" = no checkpoints (in a group: one file per rank)
  bool consolidate = false;           // in a group, also write checkpoint_dir/consolidated.safetensors
  bool resume = false;                // continue from checkpoint_dir's newest checkpoint (any world size)
  int64_t eval_every = 0;             // 0 = only at the end
  int64_t log_every = 50;             // plain log line interval (not on a terminal); on cuda
                                      // also how often the loss is read back from the device
  std::string metrics_path = "";      // JSON lines appended here; "" = none
  int64_t eval_batches = 0;           // batches per evaluation: LMs 0 = 10 (random held-out windows);
                                      // classifiers the first N of the test set, 0 = all of it
  std::FILE* out = stdout;            // progress and summary
};

struct JobResult {
  int64_t steps_done = 0;
  double final_loss = 0;
  double eval_metric = 0;  // classifiers: test accuracy in [0, 1]; LMs: perplexity
  std::string eval_name;   // "accuracy" or "perplexity"
  std::string device, amp;  // what ran (after choose_device)
  int world_size = 1;
  std::string shard = "none";  // what ran (after choose_shard_mode)
  int64_t evaluations = 0;  // how many times the job evaluated
  int64_t eval_batches = 0;  // batches the last evaluation ran
  // Where the wall time went (seconds): the whole run; before the trainer (device, data, model,
  // init); the trainer's construction (compile_step, upload) and a resumed checkpoint's load;
  // the job's start to the end of its first step; the steps (the loop without evaluation and
  // checkpoints); evaluation (its compile at first use included); saving checkpoints.
  double seconds = 0;
  double setup_seconds = 0, compile_seconds = 0, first_step_seconds = 0;
  double step_seconds = 0, eval_seconds = 0, checkpoint_seconds = 0;
};

// `--device` and `--amp` with "auto" resolved, and one line saying which and why.
struct DeviceChoice {
  std::string device;  // "cpu" or "cuda"
  std::string amp;     // "off", "bf16" or "f16"
  std::string note;    // "device cuda (auto: NVIDIA H100 ..., sm_90, 79.1 GiB), amp bf16 (auto: ...)"
};
// device "auto": CUDA when the build has it and a GPU is present, else the CPU. amp "auto": bf16
// on a CUDA device of compute capability 8.0 or more (bf16 tensor cores), off otherwise (the
// CPU's steps are f32). Explicit values are kept. `cuda` is what the machine offers
// (device_availability(Device::kCuda); tests pass made-up ones). Throws kiln::Error on a name
// that is none of these.
DeviceChoice choose_device(const std::string& device, const std::string& amp, const DeviceAvailability& cuda);

// `--shard`: an explicit mode is kept; "auto" is none alone, and in a group dp while the params,
// gradients and `optimizer`'s state (f32: 16 bytes a param for AdamW, from the registry's slots)
// take at most a quarter of `device_bytes` (the memory of one device), else zero3. `note` says which and why.
std::string choose_shard_mode(const std::string& shard, int world_size, int64_t params, const std::string& optimizer,
                              size_t device_bytes, std::string* note);

// Throws kiln::Error on bad options, missing data, a shape that does not fit, or a non-finite
// loss (the message names the step; the last good checkpoint is kept).
JobResult run_training_job(const JobOptions& options);

// ---- a data-parallel group, as kiln train, kiln bench and the Python package join it ----
// The process group when launched (torchrun, kiln launch: WORLD_SIZE > 1), joined on `device`
// ("cpu": Gloo, "cuda": NCCL on GPU LOCAL_RANK, made current); null alone.
std::unique_ptr<ProcessGroup> join_group(const std::string& device);
// A step's pass options in a group: the distribution passes plan with the group's measured
// collective times (distributed/comm_profile.h), the same on every rank; on a GPU --offload
// auto fits the step into `runtime`'s device.
PassOptions passes_for(PassOptions passes, ProcessGroup* group, const DeviceRuntime& runtime);
// A fingerprint of everything that must agree across ranks (ProcessGroup::check_agreement):
// the compiled step's text (model, batch, precision, sharding, passes), `extra` and the build.
std::string step_fingerprint(const Trainer& trainer, const std::string& extra);

// What each data input of an imported model takes from a batch of the dataset it is bound to.
enum class InputRole {
  kImages,      // Fashion-MNIST's images: f32 (B, 1, 28, 28), (B, 28, 28) or (B, 784)
  kLabels,      // Fashion-MNIST's labels: i64 (B,)
  kTokens,      // a text's token ids: i64 (B, T)
  kNextTokens,  // the token after each of them (the language-model targets): i64 (B, T)
  kRandom,      // random values of the input's type (integers below the index bound they reach)
};
struct DataBinding {
  std::string data;             // "fashion-mnist", "random", or the text or .tok file's path
  std::vector<InputRole> roles;  // per data input of the graph, in order
};
// How a forward graph's data inputs bind to `data`: "fashion-mnist" (one images input, at most
// one labels input, one batch size), a text or .tok file path (one or two integer (B, T) inputs:
// the tokens, then their next tokens), "random" (any inputs), or "" (Fashion-MNIST when the
// inputs fit it, else the default text when they fit that, else an error). Throws kiln::Error
// naming every input that cannot be bound, its type and what the dataset binds.
DataBinding bind_data_inputs(const Graph& forward, const std::string& data);

// `kiln bench`: training steps of a model on random data (no data loading), timed.
struct BenchOptions {
  std::string model = "gpt2";     // models::model_names(), or an ONNX model file (.onnx)
  onnx::ImportOptions onnx;       // for an ONNX model: dynamic dims, frozen params, its loss
  int64_t batch = 32;
  int64_t seq = 0;                // language models: 0 = the config's
  models::ModelSizes sizes;       // language models: sizes overriding the config's (seq above)
  std::string amp = "bf16";       // off | bf16 | f16 | auto (choose_device)
  OptimizerConfig optimizer;      // its amp is `amp` above
  std::string shard = "auto";     // in a group (kiln launch): as JobOptions::shard; batch is global
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
  // benchmark: loading, the CLI), "model and params", "CUDA context"; then Trainer::build_seconds.
  std::vector<std::pair<std::string, double>> setup_parts, build_parts;
  double final_loss = 0;
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
  size_t updates_in_place = 0, updates = 0;  // updates written by their node / all updates
};

// Throws kiln::Error (bad options; on cuda no device, or the step does not fit in memory, the
// message naming the bytes needed and free).
BenchResult run_benchmark(const BenchOptions& options);
// Dense peak rate of `device_name` (cudaDeviceProp name) for the step's math: bf16/f16 tensor
// cores under amp, tf32 tensor cores otherwise. 0 when unknown. `note` says which.
double device_peak_flops(const std::string& device_name, const std::string& amp, std::string* note);

}  // namespace kiln::train
