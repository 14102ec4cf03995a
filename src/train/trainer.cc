#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "device/communicator.h"
#include "ops/optimizer/optimizers.h"
#include "support/error.h"
#include "support/stopwatch.h"
#include "train/checkpoint/reshard.h"
#include "train/checkpoint/safetensors.h"

namespace kiln::train {

namespace {

// Rank `rank`'s flat shard of a full host tensor (passes/sharding.h: zero-padded to world * k).
Tensor host_shard(const Tensor& full, int64_t shard_numel, int rank) {
  Tensor out(TensorType{full.dtype(), {shard_numel}});
  const size_t element = dtype_size(full.dtype());
  const int64_t begin = shard_numel * rank;
  const int64_t count = std::clamp<int64_t>(full.numel() - begin, 0, shard_numel);
  std::memset(out.raw(), 0, out.bytes());
  if (count > 0) std::memcpy(out.raw(), full.raw() + static_cast<size_t>(begin) * element, static_cast<size_t>(count) * element);
  return out;
}

}  // namespace

namespace {
std::shared_future<std::vector<Tensor>> ready(std::vector<Tensor> values) {
  std::promise<std::vector<Tensor>> promise;
  promise.set_value(std::move(values));
  return promise.get_future().share();
}
}  // namespace

Trainer::Trainer(const Graph& forward, OptimizerConfig config, std::vector<Tensor> params,
                 ExecutorOptions executor_options, PassOptions pass_options, ShardingOptions sharding)
    : Trainer(forward, std::move(config), ready(std::move(params)), std::move(executor_options),
              std::move(pass_options), sharding) {}

Trainer::Trainer(const Graph& forward, OptimizerConfig config, std::shared_future<std::vector<Tensor>> pending_params,
                 ExecutorOptions executor_options, PassOptions pass_options, ShardingOptions sharding)
    : config_(std::move(config)), sharding_(sharding), forward_(forward),
      executor_options_(std::move(executor_options)), pass_options_(std::move(pass_options)) {
  KILN_CHECK(!sharding_.enabled() || executor_options_.communicator != nullptr,
             "a {} trainer needs a process group (ExecutorOptions::communicator)", shard_mode_name(sharding_.mode));
  KILN_CHECK(!sharding_.enabled() || executor_options_.communicator->world_size() == sharding_.world_size,
             "sharding over {} ranks, but the process group has {}", sharding_.world_size,
             executor_options_.communicator->world_size());
  try {
    runtime_ = device_runtime(executor_options_.device);
  } catch (const Error& e) {
    fail("a trainer on {}: {}", device_name(executor_options_.device), e.what());
  }
  // One stream for steps, evaluation and copies.
  stream_ = runtime_->create_stream();
  executor_options_.stream = stream_.get();
  CompileOptions options;
  options.optimizer = config_;
  options.sharding = sharding_;
  options.passes = pass_options_;
  options.executor = executor_options_;
  // The executor checks that its arena and every input (uploaded below) fit before anything is
  // allocated.
  options.inputs_allocated_after = true;
  step_ = compile_step(forward, options);
  build_seconds_ = step_.phase_seconds;
  std::vector<Tensor> params;
  {
    const Stopwatch waiting;
    const bool pending = pending_params.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
    params = pending_params.get();
    pending_params = {};  // the only other holder of the host values may be the caller: they go after the upload
    if (pending) build_seconds_.emplace_back("params wait", waiting.seconds());
  }
  const StepProgram& program = step_.program;
  const Graph& g = program.graph;
  KILN_CHECK(params.size() == program.param_inputs.size(), "graph '{}' has {} params, {} initial values given",
             forward.name, program.param_inputs.size(), params.size());
  inputs_.resize(g.inputs.size());
  std::map<std::string, TensorType> param_types;  // full, by name
  for (size_t i = 0; i < params.size(); ++i) {
    const Value& v = g.value(g.inputs[program.param_inputs[i]].value);
    const TensorType& full = forward.type(forward.inputs[program.param_inputs[i]].value);
    param_types[v.name] = full;
    // zero3's params come whole (this rank takes its shard) or as this rank's shard already
    // (models::init_param_shards: a rank draws only its share).
    const bool given_sharded = v.type != full && params[i].type() == v.type;
    KILN_CHECK(params[i].type() == full || given_sharded, "param '{}' must be {}{}, got {}", v.name, to_string(full),
               v.type != full ? fmt::format(" (or this rank's shard, {})", to_string(v.type)) : "",
               to_string(params[i].type()));
    // host; the upload below is the trainer's own copy (zero3: of this rank's shard)
    if (v.type != full) {
      sharded_[v.name] = full;
      if (!given_sharded) params[i] = host_shard(params[i], v.type.numel(), rank());
    }
    inputs_[program.param_inputs[i]] = params[i];
  }
  for (int i : program.state_inputs) {
    const Value& v = g.value(g.inputs[i].value);
    // A slot shaped like its param is sharded when its shape is not the param's.
    for (const std::string& slot : optim::slot_names(optim::SlotShape::kParam)) {
      const std::string prefix = "opt." + slot + ".";
      if (v.name.rfind(prefix, 0) != 0) continue;
      auto full = param_types.find(v.name.substr(prefix.size()));
      if (full != param_types.end() && full->second != v.type) sharded_[v.name] = full->second;
    }
  }
  for (int i : program.state_inputs) {
    const Value& v = g.value(g.inputs[i].value);
    auto initial = program.state_initial_values.find(v.name);
    // Zeros (the optimizer's state: AdamW's moments are twice the params' bytes) are made on the
    // device, not uploaded.
    if (initial == program.state_initial_values.end()) continue;
    inputs_[i] = Tensor(v.type);
    for (int64_t k = 0; k < inputs_[i].numel(); ++k) inputs_[i].set(k, initial->second);
  }
  params.clear();  // inputs_ holds the host values now: each goes once it is uploaded
  Stopwatch phase;
  {
    // Host values bound for the device go in one upload (pinned staging in pieces, the copies
    // overlapping the packing: pageable cudaMemcpy moved an 8B model's 16 GB a rank at 5.7 GB/s).
    std::vector<Tensor> hosts, devices;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const TensorType& type = g.type(g.inputs[i].value);
      if (inputs_[i].defined() && !step_.executor->input_on_host(i)) {
        hosts.push_back(inputs_[i]);
        inputs_[i] = runtime_->device_tensor(type, false);
        devices.push_back(inputs_[i]);
      } else {
        inputs_[i] = placed(i, inputs_[i]);
      }
    }
    runtime_->create_uploader(2)->upload(hosts, devices, *stream_);
    stream_->synchronize();
  }
  build_seconds_.emplace_back("upload", phase.lap());
  uploader_ = runtime_->create_uploader(2);
  loss_type_ = g.type(g.outputs.at(0));
  KILN_CHECK(loss_type_.bytes() <= 8, "the loss must be a scalar, got {}", to_string(loss_type_));
  loss_slots_ = runtime_->pinned_tensor(TensorType{DType::kU8, {8 * kLossSlots}});
}

Tensor Trainer::placed(size_t i, const Tensor& host) const {
  const TensorType& type = step_.program.graph.type(step_.program.graph.inputs[i].value);
  if (step_.executor->input_on_host(i)) {
    // Offloaded optimizer state (passes/offload.h): pinned, so that its copies are asynchronous.
    Tensor pinned = runtime_->pinned_tensor(type);  // zero-filled
    if (host.defined()) std::memcpy(pinned.raw(), host.raw(), pinned.bytes());
    return pinned;
  }
  return host.defined() ? runtime_->to_device(host) : runtime_->device_tensor(type);
}

Tensor Trainer::host_copy(const Tensor& t) const {
  if (t.device() != Device::kCpu) return runtime_->to_host(t);
  // Offloaded state: the step's copies into its pinned memory may still be in flight.
  if (device() != Device::kCpu) stream_->synchronize();
  return t.clone();
}

Tensor Trainer::loss_slot(int64_t k) const { return loss_slots_.viewed(loss_type_, static_cast<size_t>(8 * k)); }

Trainer::~Trainer() {
  // Copies still queued read the pinned slots and staging that go with us.
  if (stream_) {
    try {
      stream_->synchronize();
    } catch (const Error&) {
    }
  }
}

void Trainer::synchronize() const {
  stream_->synchronize();
  runtime_->check_kernel_errors();  // a kernel's data error (a label out of range, ...) surfaces here
}

const Executor& Trainer::eval_executor(bool loss_only) const {
  std::unique_ptr<CompiledStep>& eval = loss_only ? loss_eval_ : eval_;
  if (!eval) {
    const Stopwatch compile;
    CompileOptions options;
    options.kind = StepKind::kForward;
    options.loss_only = loss_only;
    // The step's mixed precision (amp and policy), so the forward computes as the step's does;
    // the optimizer's other fields mean nothing to a forward step.
    options.optimizer = config_;
    options.sharding = sharding_;  // zero3 gathers the params; the loss is the ranks' mean
    options.passes = pass_options_;
    options.passes.print_after.clear();  // the step's IR was printed; the forward's is not asked for
    options.executor = executor_options_;
    // Evaluation writes nothing back: a training-mode BatchNorm's running statistics (an
    // imported model's updates) move in training steps only.
    Graph forward = forward_;
    forward.updates.clear();
    eval = std::make_unique<CompiledStep>(compile_step(forward, options));
    eval_compile_s_ += compile.seconds();
  }
  return *eval->executor;
}

void Trainer::check_data(const Tensor& data, size_t index, const char* what) const {
  const Graph& g = step_.program.graph;
  const Value& v = g.value(g.inputs[step_.program.data_inputs[index]].value);
  KILN_CHECK(data.defined() && data.type() == v.type, "{}data input '{}' must be {}, got {}", what, v.name,
             to_string(v.type), data.defined() ? to_string(data.type()) : "no tensor");
  KILN_CHECK(data.device() == Device::kCpu || data.device() == device(),
             "{}data input '{}' is a {} tensor, the trainer runs on {}", what, v.name, device_name(data.device()),
             device_name(device()));
}

void Trainer::copy_in(const std::vector<Tensor>& data, const std::vector<Tensor>& buffers) const {
  std::vector<Tensor> hosts, devices;
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i].device() == Device::kCpu) {
      hosts.push_back(data[i]);
      devices.push_back(buffers[i]);
    } else {
      runtime_->copy_async(buffers[i], data[i], *stream_);
    }
  }
  if (!hosts.empty()) uploader_->upload(hosts, devices, *stream_);
}

std::vector<Tensor> Trainer::step(const std::vector<Tensor>& data) {
  KILN_CHECK(data.size() == step_.program.data_inputs.size(), "a step takes {} data tensors, {} given",
             step_.program.data_inputs.size(), data.size());
  for (size_t i = 0; i < data.size(); ++i) check_data(data[i], i, "");
  Tensor lr(TensorType{DType::kF32, {}});
  lr.set(0, current_lr());
  std::vector<Tensor> outputs;
  if (device() == Device::kCpu) {
    // The CPU reads the batch where it is (the run is over when run() returns).
    std::vector<Tensor> inputs = inputs_;
    for (size_t i = 0; i < data.size(); ++i) inputs[step_.program.data_inputs[i]] = data[i];
    inputs[step_.program.lr_input] = lr;
    outputs = step_.executor->run(inputs);
  } else {
    std::vector<Tensor> values = data, buffers;
    values.push_back(lr);
    for (int i : step_.program.data_inputs) buffers.push_back(inputs_[i]);
    buffers.push_back(inputs_[step_.program.lr_input]);
    copy_in(values, buffers);
    outputs = step_.executor->run(inputs_);
  }
  if (pending_losses_ == kLossSlots) {
    // Nobody read for kLossSlots steps: one wait to free the slots.
    std::vector<double> taken = take_losses();
    losses_.insert(losses_.begin(), taken.begin(), taken.end());
  }
  runtime_->copy_async(loss_slot(pending_losses_++), outputs[0], *stream_);
  ++steps_done_;
  return outputs;
}

std::vector<double> Trainer::take_losses() {
  if (pending_losses_ > 0) {
    synchronize();
    for (int64_t k = 0; k < pending_losses_; ++k) losses_.push_back(loss_slot(k).get(0));
    pending_losses_ = 0;
  }
  return std::exchange(losses_, {});
}

std::vector<Tensor> Trainer::eval_inputs(const std::vector<Tensor>& data) const {
  KILN_CHECK(data.size() == step_.program.data_inputs.size(), "evaluate takes {} data tensors, {} given",
             step_.program.data_inputs.size(), data.size());
  for (size_t i = 0; i < data.size(); ++i) check_data(data[i], i, "evaluate: ");
  // Forward inputs come first in the training graph, in the forward's order. The step's data
  // buffers have the same types and stay put, so a replayed graph reads them; the copy is
  // ordered after the steps that read them, on the one stream. The CPU reads `data` in place.
  std::vector<Tensor> inputs(inputs_.begin(), inputs_.begin() + static_cast<std::ptrdiff_t>(forward_.inputs.size()));
  std::vector<Tensor> buffers;
  for (size_t d = 0; d < data.size(); ++d) {
    Tensor& input = inputs[step_.program.data_inputs[d]];
    if (device() == Device::kCpu) input = data[d];
    else buffers.push_back(input);
  }
  if (device() != Device::kCpu) copy_in(data, buffers);
  return inputs;
}

std::vector<Tensor> Trainer::evaluate_on_device(const std::vector<Tensor>& data) const {
  return eval_executor().run(eval_inputs(data));
}

std::vector<Tensor> Trainer::evaluate(const std::vector<Tensor>& data) const {
  std::vector<Tensor> outputs = evaluate_on_device(data);
  synchronize();
  for (Tensor& t : outputs) t = runtime_->to_host(t);
  return outputs;
}

std::vector<Tensor> Trainer::evaluate_batches(int64_t count, const std::function<std::vector<Tensor>(int64_t)>& batch,
                                              int output) const {
  KILN_CHECK(count >= 0, "evaluate_batches: the count of batches must be >= 0, got {}", count);
  KILN_CHECK(output >= 0 && static_cast<size_t>(output) < forward_.outputs.size(),
             "evaluate_batches: output {} of graph '{}', which has {}", output, forward_.name, forward_.outputs.size());
  const Executor& executor = eval_executor(output == 0);
  const Graph& g = executor.graph();
  const size_t slot = static_cast<size_t>(output);
  const TensorType type = g.type(g.outputs.at(slot));
  const size_t stride = (type.bytes() + 15) / 16 * 16;
  const size_t needed = std::max<size_t>(stride * static_cast<size_t>(count), 16);
  // Nothing is in flight into the slots between calls (each call waits at its end).
  if (!eval_slots_.defined() || eval_slots_.bytes() < needed)
    eval_slots_ = runtime_->pinned_tensor(TensorType{DType::kU8, {static_cast<int64_t>(needed)}});
  auto slot_of = [&](int64_t i) { return eval_slots_.viewed(type, stride * static_cast<size_t>(i)); };
  try {
    for (int64_t i = 0; i < count; ++i) {
      std::vector<Tensor> outputs = executor.run(eval_inputs(batch(i)));
      runtime_->copy_async(slot_of(i), outputs[slot], *stream_);
    }
  } catch (const Error&) {
    stream_->synchronize();  // a bad batch: the copies already enqueued land before the slots may go
    throw;
  }
  synchronize();
  std::vector<Tensor> results;
  for (int64_t i = 0; i < count; ++i) results.push_back(slot_of(i).clone());
  return results;
}

std::map<std::string, Tensor> Trainer::named_tensors() const {
  std::map<std::string, Tensor> out;
  const Graph& g = step_.program.graph;
  for (int i : step_.program.param_inputs) out[g.value(g.inputs[i].value).name] = inputs_[i];
  for (int i : step_.program.state_inputs) out[g.value(g.inputs[i].value).name] = inputs_[i];
  return out;
}

void Trainer::set_initial_value(const std::string& name, const Tensor& value) {
  KILN_CHECK(steps_done_ == 0, "set_initial_value('{}') after {} steps: only before the first", name, steps_done_);
  KILN_CHECK(!sharded_.count(name), "set_initial_value('{}'): this rank holds a shard of it", name);
  const Graph& g = step_.program.graph;
  for (const std::vector<int>* indices : {&step_.program.param_inputs, &step_.program.state_inputs})
    for (int i : *indices) {
      const Value& v = g.value(g.inputs[i].value);
      if (v.name != name) continue;
      KILN_CHECK(value.type() == v.type, "set_initial_value('{}'): got {}, the step has {}", name,
                 to_string(value.type()), to_string(v.type));
      inputs_[i] = placed(static_cast<size_t>(i), value);
      return;
    }
  fail("set_initial_value('{}'): the step has no param or state of that name", name);
}

void Trainer::adopt(const std::string& name, const Tensor& storage) {
  KILN_CHECK(steps_done_ == 0, "adopt('{}') after {} steps: only before the first", name, steps_done_);
  KILN_CHECK(!sharded_.count(name), "adopt('{}'): this rank holds a shard of it", name);
  KILN_CHECK(storage.device() == device(), "adopt('{}'): the tensor is on {}, the trainer on {}", name,
             device_name(storage.device()), device_name(device()));
  const Graph& g = step_.program.graph;
  for (const std::vector<int>* indices : {&step_.program.param_inputs, &step_.program.state_inputs})
    for (int i : *indices) {
      const Value& v = g.value(g.inputs[i].value);
      if (v.name != name) continue;
      KILN_CHECK(storage.type() == v.type, "adopt('{}'): got {}, the step has {}", name, to_string(storage.type()),
                 to_string(v.type));
      stream_->synchronize();  // nothing in flight still reads the old tensor
      inputs_[i] = storage;
      return;
    }
  fail("adopt('{}'): the step has no param or state of that name", name);
}

std::map<std::string, Tensor> Trainer::host_tensors() const {
  std::map<std::string, Tensor> out = named_tensors();
  for (auto& [name, t] : out) t = host_copy(t);
  return out;
}

size_t Trainer::param_and_state_bytes() const {
  size_t total = 0;
  // On the device: offloaded state is in host memory (on the CPU everything is).
  for (const auto& [name, t] : named_tensors())
    if (t.device() == runtime_->device()) total += t.bytes();
  return total;
}

std::vector<Tensor> Trainer::params() const {
  std::vector<Tensor> out;
  for (int i : step_.program.param_inputs) out.push_back(inputs_[i]);
  return out;
}

double Trainer::reduce_over_ranks(double value, ReduceOp op) const {
  const Communicator* communicator = executor_options_.communicator;
  if (communicator == nullptr || communicator->world_size() == 1) return value;
  Tensor host(TensorType{DType::kF64, {1}});
  host.set(0, value);
  Tensor device = runtime_->to_device(host);
  communicator->all_reduce(device, device, op, stream_->handle());
  stream_->synchronize();
  return runtime_->to_host(device).get(0);
}

int Trainer::rank() const {
  return executor_options_.communicator ? executor_options_.communicator->rank() : 0;
}
int Trainer::world_size() const {
  return executor_options_.communicator ? executor_options_.communicator->world_size() : 1;
}

void Trainer::save(const std::string& path, std::map<std::string, std::string> metadata) const {
  metadata["kiln.steps_done"] = std::to_string(steps_done_);
  metadata["kiln.graph"] = forward_.name;
  if (sharding_.enabled()) {
    metadata["kiln.world_size"] = std::to_string(world_size());
    metadata["kiln.rank"] = std::to_string(rank());
    metadata["kiln.shard"] = std::string(shard_mode_name(sharding_.mode));
    // Which tensors are shards, and their whole shapes (checkpoint/reshard.h reads them).
    nlohmann::json sharded = nlohmann::json::object();
    for (const auto& [name, type] : sharded_) sharded[name] = type.shape;
    metadata["kiln.sharded"] = sharded.dump();
  }
  save_safetensors(path, host_tensors(), metadata);
}

void Trainer::save_consolidated(const std::string& path, std::map<std::string, std::string> metadata) const {
  metadata["kiln.steps_done"] = std::to_string(steps_done_);
  metadata["kiln.graph"] = forward_.name;
  metadata["kiln.consolidated"] = "1";
  std::map<std::string, Tensor> full;
  // Every rank gathers every shard (in name order, the same on every rank); rank 0 writes.
  for (const auto& [name, tensor] : named_tensors()) {
    const Tensor whole = full_tensor(name);
    if (rank() == 0) full[name] = host_copy(whole);
  }
  if (rank() == 0) save_safetensors(path, full, metadata);
}

Tensor Trainer::full_tensor(const std::string& name) const {
  const std::map<std::string, Tensor> named = named_tensors();
  auto it = named.find(name);
  KILN_CHECK(it != named.end(), "the step has no param or state '{}'", name);
  auto sharded = sharded_.find(name);
  if (sharded == sharded_.end()) return it->second;
  const Tensor& tensor = it->second;
  Tensor gathered = runtime_->device_tensor(TensorType{tensor.dtype(), {tensor.numel() * world_size()}}, false);
  // An offloaded shard is in host memory: the collective takes device tensors.
  const Tensor shard = tensor.device() == runtime_->device() ? tensor : runtime_->to_device(tensor);
  executor_options_.communicator->all_gather(shard, gathered, stream_->handle());
  stream_->synchronize();  // the collective reads `shard` (a temporary when offloaded) until then
  // The shards are padded to equal lengths: the full tensor is the gathered one's first elements.
  return gathered.viewed(sharded->second, 0);
}

void Trainer::assign(const std::string& name, const Tensor& value) {
  const std::map<std::string, Tensor> named = named_tensors();
  auto it = named.find(name);
  KILN_CHECK(it != named.end(), "the step has no param or state '{}'", name);
  auto sharded = sharded_.find(name);
  const TensorType& full = sharded != sharded_.end() ? sharded->second : it->second.type();
  KILN_CHECK(value.type() == full, "'{}' is {}, the value given is {}", name, to_string(full), to_string(value.type()));
  if (sharded == sharded_.end()) {
    runtime_->copy_async(it->second, value, *stream_);
  } else {
    // This rank's part of the flat value (the shard's padding stays zero: host_shard).
    const Tensor& shard = it->second;
    const int64_t begin = shard.numel() * rank();
    const int64_t count = std::clamp<int64_t>(value.numel() - begin, 0, shard.numel());
    const TensorType part{value.dtype(), {count}};
    if (count > 0)
      runtime_->copy_async(shard.viewed(part, 0), value.viewed(part, static_cast<size_t>(begin) * dtype_size(value.dtype())),
                           *stream_);
  }
  stream_->synchronize();
}

std::map<std::string, std::string> Trainer::load(const std::vector<std::string>& paths) {
  std::map<std::string, Tensor> mine = named_tensors();
  // This rank's part of each tensor: whole, or its shard of the flat value.
  std::map<std::string, TensorPart> want;
  for (const auto& [name, tensor] : mine) {
    auto sharded = sharded_.find(name);
    want[name] = sharded == sharded_.end() ? TensorPart{tensor.type(), 0, tensor.type()}
                                           : TensorPart{sharded->second, tensor.numel() * rank(), tensor.type()};
  }
  CheckpointRead file = read_checkpoint(paths, want);  // checks everything before we touch anything
  const int64_t steps_done = std::stoll(file.metadata.at("kiln.steps_done"));  // read_checkpoint checked it
  for (auto& [name, tensor] : mine) runtime_->copy_async(tensor, file.tensors.at(name), *stream_);
  stream_->synchronize();  // the file's host tensors go when we return
  steps_done_ = steps_done;
  return file.metadata;
}

}  // namespace kiln::train
