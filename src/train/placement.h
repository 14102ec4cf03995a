// Where a training session runs: the device and precision (`--device/--amp auto` resolved), the
// data-parallel group this process is a rank of (joined from torchrun-style variables), the
// shard mode over it (`--shard auto` resolved), and what every rank must agree on. `kiln train`,
// `kiln bench`, `kiln step` and the Python package all decide these here, so that they decide
// them alike.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "device/device_runtime.h"
#include "passes/pass.h"
#include "support/error.h"

namespace kiln {
class ProcessGroup;
}

namespace kiln::train {

class Trainer;

// `--device` and `--amp` with "auto" resolved, and one line saying which and why.
struct DeviceChoice {
  std::string device;  // "cpu" or "cuda"
  std::string amp;     // "off", "bf16", "f16" or "fp8"
  std::string note;    // "device cuda (auto: NVIDIA H100 ..., sm_90, 79.1 GiB), amp bf16 (auto: ...)"
};
// device "auto": CUDA when the build has it and a GPU is present, else the CPU. amp "auto": bf16
// on a CUDA device of compute capability 8.0 or more (bf16 tensor cores), off otherwise (the
// CPU's steps are f32). Explicit values are kept. `cuda` is what the machine offers
// (device_availability(Device::kCuda); tests pass made-up ones). Throws kiln::Error on a name
// that is none of these.
DeviceChoice choose_device(const std::string& device, const std::string& amp, const DeviceAvailability& cuda);

// The runtime of device "cpu" or "cuda", or a kiln::Error saying why there is none.
std::unique_ptr<DeviceRuntime> runtime_of(const std::string& device);

// `--shard`: an explicit mode is kept; "auto" is none alone, and in a group dp while the params,
// gradients and `optimizer`'s state (f32: 16 bytes a param for AdamW, from the registry's slots)
// take at most a quarter of `device_bytes` (the memory of one device), else zero3. `note` says which and why.
std::string choose_shard_mode(const std::string& shard, int world_size, int64_t params, const std::string& optimizer,
                              size_t device_bytes, std::string* note);
// The memory choose_shard_mode weighs the state against: the device's; on the CPU a fixed 64 GiB
// (the host's memory is not the limit a shard mode is for).
size_t shard_budget_bytes(const DeviceRuntime& runtime);

// The process group when launched (torchrun, kiln launch: WORLD_SIZE > 1), joined on `device`
// ("cpu": Gloo, "cuda": NCCL on GPU LOCAL_RANK, made current); null alone.
std::unique_ptr<ProcessGroup> join_group(const std::string& device);
// How many times a launcher restarted this process's group after a failure (kiln launch
// --max-restarts, torchrun); 0 alone or on the first run.
int restart_count();
// An error in a group: when a rank was lost meanwhile, say so first (the engine's own message,
// "connection reset by peer", does not name it). Rethrows `error` otherwise.
[[noreturn]] void fail_in_group(ProcessGroup* group, const Error& error);

// A step's pass options in a group: the distribution passes plan with the group's measured
// collective times (distributed/comm_profile.h), the same on every rank; on a GPU --offload
// auto fits the step into `runtime`'s device.
PassOptions passes_for(PassOptions passes, ProcessGroup* group, const DeviceRuntime& runtime);
// A fingerprint of everything that must agree across ranks (ProcessGroup::check_agreement):
// the compiled step's text (model, batch, precision, sharding, passes), `extra` and the build.
std::string step_fingerprint(const Trainer& trainer, const std::string& extra);

}  // namespace kiln::train
