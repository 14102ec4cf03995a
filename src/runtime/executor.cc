#include "runtime/executor.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <thread>

#include "ir/verifier.h"
#include "ops/transfer.h"
#include "ops/update_stream.h"
#include "support/stopwatch.h"
#include "support/error.h"

namespace kiln {
namespace {
std::vector<TensorType> types_of(const Graph& g, const std::vector<ValueId>& ids) {
  std::vector<TensorType> out;
  for (ValueId id : ids) out.push_back(g.type(id));
  return out;
}

std::string types_text(const std::vector<TensorType>& types) {
  std::string out;
  for (const TensorType& t : types) out += (out.empty() ? "" : ", ") + to_string(t);
  return out;
}

std::string node_text(const Graph& g, size_t n) {
  const Node& node = g.nodes[n];
  std::string name = node.outputs.empty() ? "" : g.value(node.outputs[0]).name;
  return fmt::format("node {} ({}{}({}))", n, name.empty() ? "" : "%" + name + " = ", op_name(node.op),
                     types_text(types_of(g, node.inputs)));
}
}  // namespace

Executor::Executor(Graph graph, ExecutorOptions options)
    : graph_(std::move(graph)), options_(std::move(options)) {
  verify(graph_);
  try {
    runtime_ = device_runtime(options_.device);
  } catch (const Error& e) {
    fail("graph '{}' asks for device {}, but {}", graph_.name, device_name(options_.device), e.what());
  }
  Stopwatch phase;
  const KernelRegistry& registry = options_.registry ? *options_.registry : kernel_registry();
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    std::vector<TensorType> in = types_of(graph_, node.inputs);
    std::vector<TensorType> out = types_of(graph_, node.outputs);
    try {
      kernels_.push_back(&registry.select(NodeView{node, in, out}, options_.device, options_.dialects));
    } catch (const Error& e) {
      fail("graph '{}': {} has no {} kernel: {}", graph_.name, node_text(graph_, n), device_name(options_.device),
           e.what());
    }
  }
  build_times_.select_s = phase.lap();
  prepare_kernels();
  build_times_.prepare_s = phase.lap();
  setup();
  build_times_.setup_s = phase.lap();
}

// At most this many threads prepare kernels (NVRTC's compiles are the long ones; a fresh
// process compiles a handful of distinct kernels).
constexpr size_t kMaxPrepareThreads = 8;

// The kernels' one-time preparation (KernelImpl::prepare: NVRTC compiles of generated kernels,
// cuDNN's attention graphs) at construction, so a compile error surfaces here and the first step
// only runs. Prepares run on a few threads (they are thread-safe: backend.h): NVRTC compiles of
// distinct kernels overlap (GPT-2's 7 took 3.1 s on one thread, 1.9 s on two, 2-core machine),
// and the first step of a fresh process waits for them. Errors are reported for the first
// failing node in graph order, whatever thread met it.
void Executor::prepare_kernels() {
  std::vector<size_t> nodes;
  for (size_t n = 0; n < graph_.nodes.size(); ++n)
    if (kernels_[n]->prepare) nodes.push_back(n);
  std::vector<std::string> errors(nodes.size());
  std::atomic<size_t> next{0};
  auto work = [&](bool helper) {
    try {
      // CUDA's current device is per thread; a helper that cannot set it leaves its share to
      // the others (the calling thread always works).
      if (helper) runtime_->make_current();
    } catch (const std::exception&) {
      return;
    }
    for (size_t i; (i = next++) < nodes.size();) {
      const Node& node = graph_.nodes[nodes[i]];
      const std::vector<TensorType> in = types_of(graph_, node.inputs);
      const std::vector<TensorType> out = types_of(graph_, node.outputs);
      try {
        kernels_[nodes[i]]->prepare(NodeView{node, in, out});
      } catch (const std::exception& e) {
        errors[i] = e.what();
        if (errors[i].empty()) errors[i] = "(no message)";
      }
    }
  };
  const size_t threads = std::min<size_t>(
      {nodes.size(), std::max(1u, std::thread::hardware_concurrency()), kMaxPrepareThreads});
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work, true);
  work(false);
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < nodes.size(); ++i)
    if (!errors[i].empty())
      fail("graph '{}': preparing {} ({} kernel '{}'): {}", graph_.name, node_text(graph_, nodes[i]),
           device_name(options_.device), kernels_[nodes[i]]->dialect, errors[i]);
}

Executor::~Executor() {
  // Work still queued may read the arena or write the caller's inputs: let it finish before
  // the arena goes (its storage may outlive us through returned outputs, but not the stream).
  if (stream_ != nullptr) {
    try {
      stream_->synchronize();
    } catch (const Error&) {
    }
  }
}

void Executor::synchronize() const {
  stream_->synchronize();
  runtime_->check_kernel_errors();  // a kernel's data error (an index out of range, ...) surfaces here
}

// Which updates a node can write straight into the caller's input (no copy at the end, and no
// arena bytes held to the end of the step), then the memory plan of the rest.
void Executor::plan_with_direct_updates() {
  const size_t values = graph_.values.size();
  // Reshape and slice views (memory_plan.h), only with a planned arena: a view of a value is a
  // read of it (of its root's bytes, whatever its offset in them), so the old value of a target
  // is read as long as any view of it is. The plan-off oracle copies every update.
  const std::vector<ValueId> views =
      options_.plan_memory ? find_views(graph_).input : std::vector<ValueId>(values, -1);
  std::vector<bool> direct(graph_.updates.size(), false);
  if (options_.plan_memory)
    direct = direct_updates(graph_, views, [this](size_t node) { return kernels_[node]->in_place_ok; });
  direct_update_input_.assign(values, -1);
  copied_update_.assign(graph_.updates.size(), true);
  for (size_t u = 0; u < graph_.updates.size(); ++u) {
    if (!direct[u]) continue;
    direct_update_input_[graph_.updates[u].value] = graph_.input_index(graph_.updates[u].target);
    copied_update_[u] = false;
    ++direct_update_count_;
  }
  // The plan need not keep a value written straight into its input alive to the end (its arena
  // bytes go unused): plan a copy of the graph without those updates. Its views are the graph's
  // (a value written into an input is an update value, so no view: the predicate keeps it so
  // once it is no longer an update value in the copy); with plan_memory off, none.
  plan_ = plan_memory(
      without_updates(graph_, direct), [this](size_t node, size_t) { return kernels_[node]->in_place_ok; },
      [&](size_t node) { return views[static_cast<size_t>(graph_.nodes[node].outputs[0])] >= 0; });
  last_use_ = plan_.liveness.last;
}

namespace {
// Whether a node runs a cuBLASLt product: a matmul, a convolution (im2col products on CUDA),
// or a fused body holding one.
bool runs_gemm(const Node& node) {
  if (node.op == Op::kMatmul || node.op == Op::kConv2d || node.op == Op::kConv2dGradInput ||
      node.op == Op::kConv2dGradWeight)
    return true;
  if (node.body)
    for (const Node& n : node.body->nodes)
      if (runs_gemm(n)) return true;
  return false;
}
}  // namespace

void Executor::setup_update_stream() {
  update_ready_.resize(graph_.nodes.size());
  // Profiled runs time each kernel on the compute stream: they run such nodes there, in order.
  if (options_.device == Device::kCpu || options_.profile) return;
  std::vector<bool> read(graph_.values.size(), false);
  for (const Node& node : graph_.nodes)
    for (ValueId id : node.inputs) read[id] = true;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    if (!on_update_stream(node)) continue;
    // The compute stream joins the update stream only at the end: a reader of the node's
    // results would race it.
    for (ValueId id : node.outputs)
      KILN_CHECK(!read[id], "graph '{}': {} runs on the update stream, but a node reads its output %{}", graph_.name,
                 node_text(graph_, n), graph_.value(id).name);
    if (!update_stream_) {
      update_stream_ = runtime_->create_background_stream();
      update_done_ = runtime_->create_event();
    }
    update_ready_[n] = runtime_->create_event();
  }
}

void Executor::setup() {
  for (const Node& node : graph_.nodes) has_gemm_ = has_gemm_ || runs_gemm(node);
  if (options_.stream != nullptr) {
    stream_ = options_.stream;
  } else {
    owned_stream_ = runtime_->create_stream();
    stream_ = owned_stream_.get();
  }
  stream_handle_ = stream_->handle();
  mark_node_ = runtime_->node_marker();
  waited_collective_.assign(graph_.nodes.size(), -1);
  host_input_ = host_resident_inputs(graph_);
  comm_ready_.resize(graph_.nodes.size());
  comm_done_.resize(graph_.nodes.size());
  std::vector<int> producer(graph_.values.size(), -1);
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    for (ValueId id : node.outputs) producer[id] = static_cast<int>(n);
    if (needs_process_group(node.op)) {
      KILN_CHECK(options_.communicator != nullptr,
                 "graph '{}' has collective ops ({}) but no process group: run it under `kiln launch -n N` or "
                 "torchrun's variables",
                 graph_.name, op_name(node.op));
      KILN_CHECK(options_.communicator->device() == options_.device,
                 "graph '{}': the process group communicates on {}, the step runs on {}", graph_.name,
                 device_name(options_.communicator->device()), device_name(options_.device));
    }
    if (has_flag(node.op, kCollective)) {
      if (!comm_stream_) comm_stream_ = runtime_->create_stream();
      comm_ready_[n] = runtime_->create_event();
      comm_done_[n] = runtime_->create_event();
    }
    if (node.op == Op::kCollectiveWait) waited_collective_[n] = producer[node.inputs[0]];
  }
  setup_update_stream();
  // A step with offloaded state (host-resident inputs) is captured like any other: the offload's
  // copies do not depend on the replay (pinned inputs at fixed addresses, captured copies in
  // stream order), and captured and uncaptured steps agree bit for bit (tests/cuda/train_test.cc;
  // llama-1b's offloaded step in separate processes with deterministic kernels). KILN_CAPTURE_OFFLOAD=0
  // launches such a step kernel by kernel, the comparison's other side.
  const bool offloaded = std::find(host_input_.begin(), host_input_.end(), true) != host_input_.end();
  const char* capture_offload = std::getenv("KILN_CAPTURE_OFFLOAD");
  const bool may_capture = !offloaded || capture_offload == nullptr || std::string_view(capture_offload) != "0";
  if (options_.cuda_graphs && !options_.profile && may_capture && runtime_->can_capture())
    captured_ = runtime_->create_graph();
  if (options_.profile)
    for (size_t i = 0; i < 2 * graph_.nodes.size(); ++i) timing_events_.push_back(runtime_->create_event(true));
  // The host's outputs are fresh each run (callers keep them, and allocating is cheap there);
  // a device's live after the arena and are reused.
  reuse_outputs_ = options_.device != Device::kCpu;
  plan_with_direct_updates();
  const size_t values = graph_.values.size();
  if (!options_.plan_memory) {
    // The oracle layout: every arena value its own bytes, nothing shared or reused.
    size_t offset = 0;
    for (size_t v = 0; v < values; ++v) {
      if (plan_.offsets[v] == MemoryPlan::kNotInArena) continue;
      plan_.offsets[v] = static_cast<int64_t>(offset);
      plan_.reuses[v] = -1;
      offset += aligned_bytes(graph_.values[v].type.bytes());
    }
    plan_.arena_bytes = offset;
    plan_.in_place_count = 0;
  }
  // One slot per graph output (a value listed twice gets one); reused, after the arena.
  output_slot_.assign(values, -1);
  size_t total = aligned_bytes(plan_.arena_bytes);
  for (ValueId id : graph_.outputs) {
    if (output_slot_[id] >= 0) continue;
    output_slot_[id] = static_cast<int>(output_offsets_.size());
    output_offsets_.push_back(total);
    if (reuse_outputs_) total += aligned_bytes(graph_.type(id).bytes());
  }
  // Every node output needs a home.
  for (const Node& node : graph_.nodes)
    for (ValueId id : node.outputs)
      KILN_CHECK(plan_.in_arena(id) || plan_.is_view(id) || output_slot_[id] >= 0 || direct_update_input_[id] >= 0,
                 "internal: value %{} has no buffer in graph '{}'", graph_.value(id).name, graph_.name);
  device_bytes_ = std::max<size_t>(total, 1);
  const size_t inputs_to_come = options_.device_bytes_to_come;
  const size_t outputs_bytes = total - aligned_bytes(plan_.arena_bytes);
  runtime_->check_fits(device_bytes_ + inputs_to_come,
                       fmt::format("graph '{}' ({} for intermediates{}{})", graph_.name, format_bytes(plan_.arena_bytes),
                                   reuse_outputs_ ? fmt::format(", {} for outputs", format_bytes(outputs_bytes)) : "",
                                   inputs_to_come ? fmt::format(", {} for its inputs", format_bytes(inputs_to_come))
                                                  : std::string()));
  arena_ = runtime_->allocate(device_bytes_, fmt::format("the arena of graph '{}'", graph_.name));
  if (options_.poison_arena) {
    Tensor whole(TensorType{DType::kU8, {static_cast<int64_t>(device_bytes_)}}, arena_, 0, options_.device);
    runtime_->fill_async(whole, 0xFF, *stream_);
    stream_->synchronize();
  }
  if (reuse_outputs_)
    for (ValueId id : graph_.outputs)
      if (output_slot_[id] == static_cast<int>(output_tensors_.size()))
        output_tensors_.push_back(Tensor(graph_.type(id), arena_, output_offsets_[output_tensors_.size()], options_.device));
}

std::vector<NodeTiming> Executor::node_labels() const {
  std::vector<NodeTiming> out;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    NodeTiming t;
    t.node = static_cast<int64_t>(n);
    t.op = std::string(op_name(node.op));
    t.dialect = kernels_[n]->dialect;
    if (node.op == Op::kFused && node.attrs.has("kind")) t.kind = node.attrs.s("kind");
    t.outputs = types_text(types_of(graph_, node.outputs));
    // A view: no kernel ran, its output is its input's bytes (or a run of them).
    if (is_view_node(n)) t.dialect = "view";
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<NodeTiming> Executor::profile() const {
  KILN_CHECK(options_.profile, "graph '{}': profile() needs an executor built with ExecutorOptions::profile (this "
             "one: profile off, device {})", graph_.name, device_name(options_.device));
  KILN_CHECK(profiled_run_, "graph '{}': profile() before the first run", graph_.name);
  synchronize();
  std::vector<NodeTiming> out = node_labels();
  for (size_t n = 0; n < out.size(); ++n)
    out[n].ms = is_view_node(n) ? 0 : timing_events_[2 * n + 1]->elapsed_ms_since(*timing_events_[2 * n]);
  return out;
}

std::vector<std::string> Executor::node_dialects() const {
  std::vector<std::string> out;
  for (const KernelImpl* k : kernels_) out.push_back(k->dialect);
  return out;
}

std::vector<Tensor> Executor::fresh_outputs() const {
  std::vector<Tensor> fresh(output_offsets_.size());
  for (ValueId id : graph_.outputs) {
    Tensor& buffer = fresh[static_cast<size_t>(output_slot_[id])];
    if (!buffer.defined()) buffer = runtime_->device_tensor(graph_.type(id), /*zero=*/false);
  }
  return fresh;
}

std::vector<Tensor> Executor::run(std::span<const Tensor> inputs) const {
  KILN_CHECK(inputs.size() == graph_.inputs.size(), "graph '{}' takes {} inputs, {} were given",
             graph_.name, graph_.inputs.size(), inputs.size());
  std::vector<const std::byte*> pointers;
  pointers.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = graph_.value(graph_.inputs[i].value);
    KILN_CHECK(inputs[i].defined() && inputs[i].type() == v.type, "input '{}' must be {}, got {}", v.name,
               to_string(v.type), inputs[i].defined() ? to_string(inputs[i].type()) : "no tensor");
    const Device expected = host_input_[i] ? Device::kCpu : options_.device;
    KILN_CHECK(inputs[i].device() == expected,
               "input '{}' ({}) is a {} tensor, but graph '{}' {}: move it there first", v.name, to_string(v.type),
               device_name(inputs[i].device()), graph_.name,
               host_input_[i] ? "keeps it in host memory (it is offloaded)"
                              : fmt::format("runs on {} (DeviceRuntime::to_device)", device_name(options_.device)));
    pointers.push_back(inputs[i].raw());
  }
  std::vector<Tensor> fresh;
  if (!reuse_outputs_) fresh = fresh_outputs();
  const std::vector<Tensor>& buffers = reuse_outputs_ ? output_tensors_ : fresh;
  std::vector<Tensor> outputs;
  for (ValueId id : graph_.outputs) outputs.push_back(buffers[static_cast<size_t>(output_slot_[id])]);
  // The run after the first tunes the products (options_.tune_gemms): the first run, and so the
  // first step, keeps the heuristic's algorithms; the capture after the tuning run holds the winners.
  const bool tuning_run = options_.tune_gemms && has_gemm_ && warmed_up_ && !tuned_;
  auto enqueue_direct = [&] {
    if (tuning_run) {
      const std::unique_ptr<KernelTuning> tuning = runtime_->tune_kernels();
      enqueue(inputs, buffers);
      tuned_ = true;
    } else {
      enqueue(inputs, buffers);
    }
    warmed_up_ = true;
  };
  if (!captured_) {
    enqueue_direct();
    return outputs;
  }
  if (captured_->ready() && pointers == captured_pointers_) {
    captured_->launch(*stream_);
    ++graph_replays_;
    return outputs;
  }
  if (!warmed_up_ || tuning_run) {
    enqueue_direct();
    return outputs;
  }
  captured_->begin_capture(*stream_);
  try {
    enqueue(inputs, buffers);
  } catch (const Error& e) {
    captured_->abandon_capture(*stream_);
    captured_pointers_.clear();
    fail("graph '{}': capturing the run into a CUDA graph failed: {} (ExecutorOptions::cuda_graphs = false runs "
         "without capture)", graph_.name, e.what());
  }
  captured_->end_capture(*stream_);
  captured_pointers_ = std::move(pointers);
  ++graph_captures_;
  captured_->launch(*stream_);
  return outputs;
}

void Executor::enqueue(std::span<const Tensor> inputs, std::span<const Tensor> outputs) const {
  std::vector<Tensor> values(graph_.values.size());
  for (size_t i = 0; i < inputs.size(); ++i) values[graph_.inputs[i].value] = inputs[i];
  // Outputs that are graph inputs (an updated one shows its value from before the update):
  // copied first, before any node or update writes the inputs.
  for (ValueId id : graph_.outputs)
    if (graph_.input_index(id) >= 0)
      runtime_->copy_async(outputs[static_cast<size_t>(output_slot_[id])], values[id], *stream_);
  const bool profiling = options_.profile;
  std::vector<Tensor> args_in, args_out;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    const int index = static_cast<int>(n);
    // The join of a collective: the compute stream goes on once the communication is done.
    if (waited_collective_[n] >= 0) stream_->wait(*comm_done_[static_cast<size_t>(waited_collective_[n])]);
    if (is_view_node(n)) {
      // A view: nothing launched (nor captured), its input's bytes (a reshape's) or a run of them
      // (a slice's) seen as the output's type, in whatever storage the input lives (arena,
      // caller's, output's); a view of a graph input sees this run's pointer (new pointers are a
      // new capture).
      const ValueId in = node.inputs[0], out = node.outputs[0];
      values[out] = view_of(values[in], out);
      if (last_use_[in] == index) values[in] = Tensor();
      if (last_use_[out] == index) values[out] = Tensor();
      continue;
    }
    args_in.clear();
    args_out.clear();
    for (ValueId id : node.inputs) args_in.push_back(values[id]);
    for (ValueId id : node.outputs) {
      if (direct_update_input_[id] >= 0) {
        args_out.push_back(inputs[static_cast<size_t>(direct_update_input_[id])]);
      } else if (output_slot_[id] >= 0) {
        args_out.push_back(outputs[static_cast<size_t>(output_slot_[id])]);
      } else {
        args_out.push_back(Tensor(graph_.type(id), arena_, static_cast<size_t>(plan_.offsets[id]), options_.device));
      }
    }
    KernelArgs args{node.attrs, args_in, args_out, stream_handle_, node.body.get(), options_.communicator};
    const bool collective = comm_done_[n] != nullptr;
    if (collective) {
      // The fork: the communication stream starts once the compute stream has made the inputs.
      comm_ready_[n]->record(*stream_);
      comm_stream_->wait(*comm_ready_[n]);
      args.stream = comm_stream_->handle();
    }
    if (update_ready_[n]) {
      // The same fork onto the update stream, which the compute stream joins at the end.
      update_ready_[n]->record(*stream_);
      update_stream_->wait(*update_ready_[n]);
      args.stream = update_stream_->handle();
    }
    if (profiling) timing_events_[2 * n]->record(*stream_);
    if (mark_node_) mark_node_(index);  // a device trace names the graph nodes captured now
    try {
      kernels_[n]->kernel(args);
      if (mark_node_) mark_node_(-1);
    } catch (const Error& e) {
      if (mark_node_) mark_node_(-1);
      fail("graph '{}': {} ({} kernel '{}'): {}", graph_.name, node_text(graph_, n), device_name(options_.device),
           kernels_[n]->dialect, e.what());
    }
    if (profiling) timing_events_[2 * n + 1]->record(*stream_);
    if (collective) comm_done_[n]->record(*comm_stream_);
    for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = args_out[i];
    // Release what no later node reads (graph inputs stay owned by the caller anyway; arena
    // views only drop a reference).
    for (ValueId id : node.inputs)
      if (last_use_[id] == index) values[id] = Tensor();
    for (ValueId id : node.outputs)
      if (last_use_[id] == index) values[id] = Tensor();
  }
  if (profiling) profiled_run_ = true;
  if (update_stream_) {
    // The join: the updates are done before the copies below, the run's end and its capture's.
    update_done_->record(*update_stream_);
    stream_->wait(*update_done_);
  }
  // In-place updates: new param/state values overwrite the caller's input tensors (those a node
  // did not already write there).
  for (size_t u = 0; u < graph_.updates.size(); ++u) {
    if (!copied_update_[u]) continue;
    const Update& update = graph_.updates[u];
    runtime_->copy_async(inputs[graph_.input_index(update.target)], values[update.value], *stream_);
  }
}

}  // namespace kiln
