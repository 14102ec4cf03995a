#include "train/job.h"

#include <cstdio>
#include <memory>
#include <tuple>

#include "distributed/process_group.h"
#include "support/error.h"
#include "support/stopwatch.h"
#include "train/checkpoint/safetensors.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

// Params by name from `path` (kiln import-hf writes such a file; any checkpoint's params do too)
// in place of `model`'s, which are then not drawn. A LLaMA's rotary base and norm epsilon are not
// in its tensors' shapes: where the file records them, the model must compute with the same.
void init_params_from(Model& model, const std::string& path, const JobOptions& o) {
  const SafetensorsFile file = load_safetensors(path);
  const std::string& model_name = o.model;
  if (o.model.rfind("llama", 0) == 0) {
    const models::LlamaConfig c = models::llama_config(o.model, sizes_of(o.sizes, o.seq));
    for (auto [key, flag, ours] : {std::tuple{"kiln.rope_theta", "--rope-theta", c.rope_base},
                                   std::tuple{"kiln.rms_eps", "--rms-eps", c.norm_epsilon}}) {
      auto it = file.metadata.find(key);
      KILN_CHECK(it == file.metadata.end() || std::stod(it->second) == ours,
                 "--init '{}' holds params of a llama with {} {}; model {} as given has {}: give {} {}", path, flag,
                 it->second, model_name, ours, flag, it->second);
    }
  }
  model.params.clear();
  model.draw_params = nullptr;
  for (const GraphInput& in : model.forward.inputs) {
    if (in.role != Role::kParam) continue;
    const Value& v = model.forward.value(in.value);
    auto it = file.tensors.find(v.name);
    KILN_CHECK(it != file.tensors.end(), "--init '{}' has no param '{}' of model {}", path, v.name, model_name);
    KILN_CHECK(it->second.type() == v.type, "--init '{}': '{}' is {}, model {} needs {}", path, v.name,
               to_string(it->second.type()), model_name, to_string(v.type));
    model.params.push_back(it->second);
  }
}

// What a checkpoint records besides the tensors: the model, the seed, and for a LLaMA what its
// params' shapes do not say: heads, positions, rotary base, norm epsilon (kiln export-hf reads them).
std::map<std::string, std::string> checkpoint_metadata(const JobOptions& o) {
  std::map<std::string, std::string> metadata = {{"kiln.model", o.model}, {"kiln.seed", std::to_string(o.seed)}};
  if (o.model.rfind("llama", 0) == 0) {
    const models::LlamaConfig config = models::llama_config(o.model, sizes_of(o.sizes, o.seq));
    metadata["kiln.heads"] = std::to_string(config.heads);
    metadata["kiln.seq"] = std::to_string(config.seq);
    metadata["kiln.rope_theta"] = fmt::format("{}", config.rope_base);
    metadata["kiln.rms_eps"] = fmt::format("{}", config.norm_epsilon);
  }
  return metadata;
}

// The job once the device is chosen and, in a group, the group joined.
JobResult run_job(JobOptions o, const DeviceChoice& choice, ProcessGroup* group, const Stopwatch& run_time) {
  const int rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> sink(nullptr, &std::fclose);
  if (rank != 0) {
    sink.reset(std::fopen("/dev/null", "w"));
    KILN_CHECK(sink != nullptr, "cannot open /dev/null for rank {}'s output", rank);
    o.out = sink.get();
  }
  // First, before anything slow: which device and precision, and why.
  fmt::print(o.out, "kiln train: {}\n", choice.note);
  std::fflush(o.out);
  KILN_CHECK(o.steps > 0, "--steps must be > 0, got {}", o.steps);
  validate(o.optimizer);
  Task task = make_task(o, rank, world);
  if (!o.init_from.empty()) init_params_from(task.model, o.init_from, o);

  SessionOptions session_options;
  session_options.device = o.device;
  // Restarted on fewer processes (kiln launch --min-nproc) a group may be down to one, where a
  // shard mode means nothing.
  session_options.shard = world == 1 && restart_count() > 0 ? "none" : o.shard;
  session_options.optimizer = o.optimizer;
  session_options.passes = o.passes;
  session_options.agreement = fmt::format("{} {} {} {} {}", o.model, o.batch, o.seq, sizes_text(o.sizes), o.seed);
  session_options.on_placed = [&](const std::string&, const std::string& note) {
    if (world > 1)
      fmt::print(o.out, "  {} ranks ({} on each), global batch {} ({} a rank), shard {}\n", world,
                 group->communicator()->engine(), o.batch, o.batch / world, note);
  };
  const double setup_seconds = run_time.seconds();
  TrainingSession session(std::move(task.model), session_options, group);

  LoopOptions loop;
  loop.steps = o.steps;
  loop.eval_every = o.eval_every;
  loop.log_every = o.log_every;
  loop.metrics_path = o.metrics_path;
  loop.metrics_all_ranks = o.metrics_all_ranks;
  loop.checkpoints = CheckpointOptions{o.checkpoint_dir, o.consolidate, o.resume, checkpoint_metadata(o)};
  loop.out = o.out;
  loop.setup_seconds = setup_seconds;
  return session.train(task.data, loop);
}

}  // namespace

JobResult run_training_job(const JobOptions& options) {
  const Stopwatch run_time;
  JobOptions o = options;
  const bool any_auto = o.device == "auto" || o.optimizer.amp == "auto";
  const DeviceChoice choice =
      choose_device(o.device, o.optimizer.amp, any_auto ? device_availability(Device::kCuda) : DeviceAvailability{});
  o.device = choice.device;
  o.optimizer.amp = choice.amp;
  // In a group: join it first (on CUDA that picks this rank's GPU, before the runtime takes the
  // current one); only rank 0 prints.
  const std::unique_ptr<ProcessGroup> group = join_group(o.device);
  try {
    return run_job(o, choice, group.get(), run_time);
  } catch (const Error& e) {
    fail_in_group(group.get(), e);
  }
}

}  // namespace kiln::train
