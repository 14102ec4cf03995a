#include "train/placement.h"

#include <chrono>
#include <optional>
#include <thread>

#include "distributed/comm_profile.h"
#include "distributed/env.h"
#include "distributed/process_group.h"
#include "ir/text.h"
#include "ops/optimizer/optimizers.h"
#include "train/trainer.h"

namespace kiln::train {

DeviceChoice choose_device(const std::string& device, const std::string& amp, const DeviceAvailability& cuda) {
  KILN_CHECK(device == "auto" || device == "cpu" || device == "cuda", "unknown device '{}' (expected auto, cpu or cuda)",
             device);
  KILN_CHECK(amp == "auto" || amp == "off" || amp == "bf16" || amp == "f16" || amp == "fp8",
             "unknown amp mode '{}' (expected auto, off, bf16, f16 or fp8)", amp);
  DeviceChoice c;
  std::string device_why = "as asked", amp_why = "as asked";
  c.device = device;
  if (device == "auto") {
    const bool gpu = cuda.built && cuda.count > 0;
    c.device = gpu ? "cuda" : "cpu";
    device_why = "auto: " + cuda.description;
  }
  c.amp = amp;
  if (amp == "auto") {
    if (c.device == "cpu") {
      c.amp = "off";
      amp_why = "auto: f32 on the CPU";
    } else {
      // A device of compute capability 8.0 or more (A100, H100) has bf16 tensor cores.
      const int cc = cuda.compute_capability;
      c.amp = cc >= 80 ? "bf16" : "off";
      amp_why = cc >= 80 ? fmt::format("auto: sm_{} has bf16", cc)
                         : cc > 0 ? fmt::format("auto: sm_{} has no bf16 (it needs sm_80)", cc) : "auto: no CUDA device";
    }
  }
  // cuBLASLt's FP8 GEMMs need Ada or Hopper tensor cores; the CPU emulates them (ops/fp8.h).
  KILN_CHECK(c.amp != "fp8" || c.device != "cuda" || cuda.compute_capability == 0 || cuda.compute_capability >= 89,
             "--amp fp8 needs a GPU of compute capability 8.9 or more (Ada, Hopper); this one is sm_{}: use --amp bf16",
             cuda.compute_capability);
  c.note = fmt::format("device {} ({}), amp {} ({})", c.device, device_why, c.amp, amp_why);
  return c;
}

std::unique_ptr<DeviceRuntime> runtime_of(const std::string& device) {
  KILN_CHECK(device == "cpu" || device == "cuda", "unknown device '{}' (expected cpu or cuda)", device);
  try {
    return device_runtime(device == "cuda" ? Device::kCuda : Device::kCpu);
  } catch (const Error& e) {
    fail("--device {}: {}", device, e.what());
  }
}

std::string choose_shard_mode(const std::string& shard, int world_size, int64_t params, const std::string& optimizer,
                              size_t device_bytes, std::string* note) {
  KILN_CHECK(shard == "auto" || shard == "none" || shard == "dp" || shard == "zero1" || shard == "zero2" ||
                 shard == "zero3",
             "unknown --shard '{}' (expected auto, dp, zero1, zero2 or zero3)", shard);
  KILN_CHECK(world_size > 1 || shard == "auto" || shard == "none",
             "--shard {} needs several processes (kiln launch -n N -- train ...)", shard);
  std::string mode = shard;
  // f32 param and gradient, and the optimizer's state like the param (AdamW's m and v)
  const optim::OptimizerDef& def = optim::optimizer_def(optimizer);
  const double state = (8.0 + 4.0 * def.state_per_param_element()) * static_cast<double>(params);
  if (shard == "auto") mode = world_size == 1 ? "none" : state <= 0.25 * static_cast<double>(device_bytes) ? "dp" : "zero3";
  if (note)
    *note = shard != "auto" ? mode
            : world_size == 1 ? "none (one process)"
            : fmt::format("{} (auto: params, gradients and {} state {} {} a quarter of the device's {})", mode,
                          def.name, format_bytes(static_cast<size_t>(state)), mode == "dp" ? "within" : "over", format_bytes(device_bytes));
  return mode;
}

size_t shard_budget_bytes(const DeviceRuntime& runtime) {
  return runtime.device() == Device::kCpu ? size_t{64} << 30 : runtime.memory_info().total_bytes;
}

std::unique_ptr<ProcessGroup> join_group(const std::string& device) {
  const std::optional<DistEnv> env = dist_env_from_environment();
  if (!env || env->world_size == 1) return nullptr;
  return init_process_group(*env, device == "cuda" ? Device::kCuda : Device::kCpu);
}

int restart_count() {
  const std::optional<DistEnv> env = dist_env_from_environment();
  return env ? env->restart_count : 0;
}

void fail_in_group(ProcessGroup* group, const Error& error) {
  // The store may learn of the loss a moment after the engine does: up to 2 s.
  for (int i = 0; group != nullptr && i < 20; ++i) {
    if (std::optional<int> lost = group->store().lost_rank())
      fail("rank {} was lost ({}); rank {} stops: {}", *lost, group->store().lost_reason(), group->rank(), error.what());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw error;
}

PassOptions passes_for(PassOptions passes, ProcessGroup* group, const DeviceRuntime& runtime) {
  if (group && !passes.costs) passes.costs = comm_cost_model(*group, runtime);
  // --offload auto fits the step into the device (the CPU's memory is the host's: nothing moves).
  if (runtime.device() != Device::kCpu && !passes.device_memory) passes.device_memory = runtime.memory_info().total_bytes;
  return passes;
}

std::string step_fingerprint(const Trainer& trainer, const std::string& extra) {
  const std::string text = print(trainer.program().graph) + extra + KILN_VERSION + __VERSION__ + __DATE__ + __TIME__;
  return fmt::format("{:016x}", std::hash<std::string>{}(text));
}

}  // namespace kiln::train
