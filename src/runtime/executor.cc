#include "runtime/executor.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/device.h"
#include "backends/cuda/device_errors.h"
#include "backends/cuda/kernel_trace.h"
#include "ir/verifier.h"
#include "support/stopwatch.h"
#include "support/error.h"

namespace kiln {
namespace {
std::vector<TensorType> types_of(const Graph& g, const std::vector<ValueId>& ids) {
  std::vector<TensorType> out;
  for (ValueId id : ids) out.push_back(g.type(id));
  return out;
}

std::shared_ptr<std::byte[]> allocate_arena(size_t bytes, bool poison) {
  // Never empty: a Tensor view of a null storage would read as undefined.
  size_t rounded = aligned_bytes(std::max<size_t>(bytes, 1));
  auto* p = static_cast<std::byte*>(std::aligned_alloc(MemoryPlan::kAlignment, rounded));
  if (!p) fail("out of host memory allocating a {}-byte arena", rounded);
  std::memset(p, poison ? 0xFF : 0, rounded);
  return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { std::free(q); });
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
  const bool on_cuda = options_.device == Device::kCuda;
  if (on_cuda) {
    KILN_CHECK(cuda::built_with_cuda(), "graph '{}' asks for device cuda, but this build has no CUDA backend "
               "(configure with -DKILN_CUDA=ON)", graph_.name);
    KILN_CHECK(cuda::device_count() > 0, "graph '{}' asks for device cuda, but there is no CUDA device: {}",
               graph_.name, cuda::describe_device(0));
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
  if (on_cuda) {
    setup_cuda();
    build_times_.setup_s = phase.lap();
  } else if (options_.plan_memory) {
    plan_with_direct_updates();
    arena_ = allocate_arena(plan_.arena_bytes, options_.poison_arena);
  } else {
    last_use_ = compute_liveness(graph_).last;
  }
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
  const int device = options_.device == Device::kCuda ? cuda::current_device() : -1;
  std::atomic<size_t> next{0};
  auto work = [&](bool helper) {
    try {
      // CUDA's current device is per thread; a helper that cannot set it leaves its share to
      // the others (the calling thread always works).
      if (helper && device >= 0) cuda::set_current_device(device);
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
      cuda::synchronize(stream_);
    } catch (const Error&) {
    }
  }
}

void Executor::synchronize() const {
  if (stream_ == nullptr) return;
  cuda::synchronize(stream_);
  cuda::check_device_errors();  // a kernel's data error (an index out of range, ...) surfaces here
}

// Which updates a node can write straight into the caller's input (no copy at the end, and no
// arena bytes held to the end of the step), then the memory plan of the rest.
void Executor::plan_with_direct_updates() {
  const size_t values = graph_.values.size();
  const Liveness live = compute_liveness(graph_);
  // Reshape and slice views (memory_plan.h), only with a planned arena: a view of a value is a
  // read of it (of its root's bytes, whatever its offset in them), so the old value of a target
  // is read as long as any view of it is.
  const std::vector<ValueId> views =
      options_.plan_memory ? find_views(graph_).input : std::vector<ValueId>(values, -1);
  std::vector<int> last_read = live.last;  // per value: its last read, through itself or a view
  for (size_t v = 0; v < values; ++v) {
    if (views[v] < 0) continue;
    const ValueId root = view_root(views, static_cast<ValueId>(v));
    last_read[root] = std::max(last_read[root], live.last[v]);
  }
  // Updates written in place by their node (see executor.h).
  std::vector<bool> is_output(values, false);
  for (ValueId id : graph_.outputs) is_output[id] = true;
  direct_update_input_.assign(values, -1);
  copied_update_.assign(graph_.updates.size(), true);
  for (size_t u = 0; u < graph_.updates.size(); ++u) {
    const Update& update = graph_.updates[u];
    const int def = live.def[update.value];
    if (def < 0 || is_output[update.target] || is_output[update.value]) continue;
    if (direct_update_input_[update.value] >= 0) continue;  // one value, two targets: copy the second
    if (graph_.type(update.value) != graph_.type(update.target)) continue;
    if (last_read[update.target] > def) continue;  // a later node reads the old value
    const Node& node = graph_.nodes[static_cast<size_t>(def)];
    bool reads_target = false;
    for (ValueId in : node.inputs) reads_target |= view_root(views, in) == update.target;
    if (reads_target && !kernels_[static_cast<size_t>(def)]->in_place_ok) continue;
    direct_update_input_[update.value] = graph_.input_index(update.target);
    copied_update_[u] = false;
    ++direct_update_count_;
  }
  // The plan need not keep a value written straight into its input alive to the end (its arena
  // bytes go unused): plan a copy of the graph without those updates. Its views are the graph's
  // (a value written into an input is an update value, so no view: the predicate keeps it so
  // once it is no longer an update value in the copy); with plan_memory off, none.
  Graph planned = graph_;
  planned.updates.clear();
  for (size_t u = 0; u < graph_.updates.size(); ++u)
    if (copied_update_[u]) planned.updates.push_back(graph_.updates[u]);
  plan_ = plan_memory(
      planned, [this](size_t node, size_t) { return kernels_[node]->in_place_ok; },
      [&](size_t node) { return views[static_cast<size_t>(graph_.nodes[node].outputs[0])] >= 0; });
  last_use_ = plan_.liveness.last;
}

namespace {
// Whether a node runs a cuBLASLt product: a matmul, or a fused body holding one.
bool runs_gemm(const Node& node) {
  if (node.op == Op::kMatmul) return true;
  if (node.body)
    for (const Node& n : node.body->nodes)
      if (runs_gemm(n)) return true;
  return false;
}
}  // namespace

void Executor::setup_cuda() {
  for (const Node& node : graph_.nodes) has_gemm_ = has_gemm_ || runs_gemm(node);
  if (options_.stream != nullptr) {
    stream_ = options_.stream;
  } else {
    owned_stream_ = std::make_unique<cuda::Stream>();
    stream_ = owned_stream_->handle();
  }
  plan_with_direct_updates();
  if (options_.profile) timer_ = std::make_unique<cuda::EventTimer>(2 * graph_.nodes.size());
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
  // Graph outputs after the arena, in the same allocation; a value listed twice gets one slot.
  output_slot_.assign(values, -1);
  std::vector<size_t> output_offsets;
  size_t total = aligned_bytes(plan_.arena_bytes);
  for (ValueId id : graph_.outputs) {
    if (output_slot_[id] >= 0) continue;
    output_slot_[id] = static_cast<int>(output_offsets.size());
    output_offsets.push_back(total);
    total += aligned_bytes(graph_.type(id).bytes());
  }
  // Every node output needs a home.
  for (const Node& node : graph_.nodes)
    for (ValueId id : node.outputs)
      KILN_CHECK(plan_.in_arena(id) || plan_.is_view(id) || output_slot_[id] >= 0 || direct_update_input_[id] >= 0,
                 "internal: value %{} has no device buffer in graph '{}'", graph_.value(id).name, graph_.name);
  device_bytes_ = std::max<size_t>(total, 1);
  size_t inputs_to_come = options_.device_bytes_to_come;
  cuda::check_fits(device_bytes_ + inputs_to_come,
                   fmt::format("graph '{}' ({} for intermediates, {} for outputs{})", graph_.name,
                               cuda::format_bytes(plan_.arena_bytes),
                               cuda::format_bytes(total - aligned_bytes(plan_.arena_bytes)),
                               inputs_to_come ? fmt::format(", {} for its inputs", cuda::format_bytes(inputs_to_come))
                                              : std::string()));
  arena_ = cuda::allocate(device_bytes_, fmt::format("the arena of graph '{}'", graph_.name));
  if (options_.poison_arena) {
    Tensor whole(TensorType{DType::kU8, {static_cast<int64_t>(device_bytes_)}}, arena_, 0, Device::kCuda);
    cuda::fill_bytes_async(whole, 0xFF, stream_);
    cuda::synchronize(stream_);
  }
  output_tensors_.clear();
  for (ValueId id : graph_.outputs)
    if (output_slot_[id] == static_cast<int>(output_tensors_.size()))
      output_tensors_.push_back(Tensor(graph_.type(id), arena_, output_offsets[output_tensors_.size()], Device::kCuda));
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
  KILN_CHECK(timer_ != nullptr, "graph '{}': profile() needs an executor built with ExecutorOptions::profile on "
             "device cuda (this one: profile {}, device {})", graph_.name, options_.profile,
             device_name(options_.device));
  KILN_CHECK(profiled_run_, "graph '{}': profile() before the first run", graph_.name);
  synchronize();
  std::vector<NodeTiming> out = node_labels();
  for (size_t n = 0; n < out.size(); ++n)
    out[n].ms = is_view_node(n) ? 0 : timer_->elapsed_ms(2 * n, 2 * n + 1);
  return out;
}

std::vector<std::string> Executor::node_dialects() const {
  std::vector<std::string> out;
  for (const KernelImpl* k : kernels_) out.push_back(k->dialect);
  return out;
}

std::vector<Tensor> Executor::run(std::span<const Tensor> inputs) const {
  KILN_CHECK(inputs.size() == graph_.inputs.size(), "graph '{}' takes {} inputs, {} were given",
             graph_.name, graph_.inputs.size(), inputs.size());
  if (options_.device == Device::kCuda) return run_cuda(inputs);
  std::vector<Tensor> values(graph_.values.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = graph_.value(graph_.inputs[i].value);
    KILN_CHECK(inputs[i].defined() && inputs[i].type() == v.type,
               "input '{}' must be {}, got {}", v.name, to_string(v.type),
               inputs[i].defined() ? to_string(inputs[i].type()) : "no tensor");
    values[graph_.inputs[i].value] = inputs[i];
  }
  const bool planned = options_.plan_memory;
  std::vector<Tensor> args_in, args_out;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    const int index = static_cast<int>(n);
    if (planned && is_view_node(n)) {
      // A view: no kernel, its input's bytes (a reshape's) or a run of them (a slice's) seen as
      // the output's type, in whatever storage the input lives (arena, caller's, output's).
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
      if (planned && direct_update_input_[id] >= 0) {
        args_out.push_back(inputs[static_cast<size_t>(direct_update_input_[id])]);
      } else if (planned && plan_.in_arena(id)) {
        args_out.push_back(Tensor(graph_.type(id), arena_, static_cast<size_t>(plan_.offsets[id])));
      } else {
        args_out.push_back(Tensor(graph_.type(id)));
      }
    }
    kernels_[n]->kernel(KernelArgs{node.attrs, args_in, args_out, nullptr, node.body.get()});
    for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = args_out[i];
    // Release what no later node reads (graph inputs stay owned by the caller anyway; arena
    // views only drop a reference).
    for (ValueId id : node.inputs)
      if (last_use_[id] == index) values[id] = Tensor();
    for (ValueId id : node.outputs)
      if (last_use_[id] == index) values[id] = Tensor();
  }
  std::vector<Tensor> outputs;
  for (ValueId id : graph_.outputs) outputs.push_back(values[id]);
  // Outputs that alias an updated input must show the value from before the update.
  for (size_t i = 0; i < outputs.size(); ++i)
    for (const Update& u : graph_.updates)
      if (graph_.outputs[i] == u.target) outputs[i] = outputs[i].clone();
  // In-place updates: new param/state values overwrite the caller's input tensors (those a
  // node did not already write there).
  for (size_t k = 0; k < graph_.updates.size(); ++k) {
    if (planned && !copied_update_[k]) continue;
    const Update& u = graph_.updates[k];
    const Tensor& target = inputs[graph_.input_index(u.target)];
    std::memcpy(target.raw(), values[u.value].raw(), target.bytes());
  }
  return outputs;
}

std::vector<Tensor> Executor::run_cuda(std::span<const Tensor> inputs) const {
  std::vector<const std::byte*> pointers;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = graph_.value(graph_.inputs[i].value);
    KILN_CHECK(inputs[i].defined() && inputs[i].type() == v.type, "input '{}' must be {}, got {}", v.name,
               to_string(v.type), inputs[i].defined() ? to_string(inputs[i].type()) : "no tensor");
    KILN_CHECK(inputs[i].device() == Device::kCuda,
               "input '{}' ({}) is a {} tensor, but graph '{}' runs on cuda: upload it first (cuda::to_device)",
               v.name, to_string(v.type), device_name(inputs[i].device()), graph_.name);
    pointers.push_back(inputs[i].raw());
  }
  std::vector<Tensor> outputs;
  for (ValueId id : graph_.outputs) outputs.push_back(output_tensors_[static_cast<size_t>(output_slot_[id])]);
  // The run after the first tunes the products (options_.tune_gemms): the first run, and so the
  // first step, keeps the heuristic's algorithms; the capture after the tuning run holds the winners.
  const bool tuning_run = options_.tune_gemms && has_gemm_ && warmed_up_ && !tuned_;
  auto enqueue_direct = [&] {
    if (tuning_run) {
      cuda::GemmTuningScope tuning;
      enqueue_cuda(inputs);
      tuned_ = true;
    } else {
      enqueue_cuda(inputs);
    }
    warmed_up_ = true;
  };
  if (!options_.cuda_graphs || options_.profile) {
    enqueue_direct();
    return outputs;
  }
  if (captured_.ready() && pointers == captured_pointers_) {
    captured_.launch(stream_);
    ++graph_replays_;
    return outputs;
  }
  if (!warmed_up_ || tuning_run) {
    enqueue_direct();
    return outputs;
  }
  captured_.begin_capture(stream_);
  try {
    enqueue_cuda(inputs);
  } catch (const Error& e) {
    captured_.abandon_capture(stream_);
    captured_pointers_.clear();
    fail("graph '{}': capturing the run into a CUDA graph failed: {} (ExecutorOptions::cuda_graphs = false runs "
         "without capture)", graph_.name, e.what());
  }
  captured_.end_capture(stream_);
  captured_pointers_ = std::move(pointers);
  ++graph_captures_;
  captured_.launch(stream_);
  return outputs;
}

void Executor::enqueue_cuda(std::span<const Tensor> inputs) const {
  std::vector<Tensor> values(graph_.values.size());
  for (size_t i = 0; i < inputs.size(); ++i) values[graph_.inputs[i].value] = inputs[i];
  // Outputs that are graph inputs (an updated one shows its value from before the update):
  // copied first, before any node or update writes the inputs.
  for (ValueId id : graph_.outputs) {
    const Tensor& out = output_tensors_[static_cast<size_t>(output_slot_[id])];
    if (graph_.input_index(id) >= 0) cuda::copy_async(out, values[id], stream_);
  }
  std::vector<Tensor> args_in, args_out;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    const int index = static_cast<int>(n);
    if (is_view_node(n)) {
      // A view: nothing launched (nor captured), its input's bytes (or a run of them) seen as
      // the output's type; a view of a graph input sees this run's pointer (new pointers are a
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
        args_out.push_back(output_tensors_[static_cast<size_t>(output_slot_[id])]);
      } else {
        args_out.push_back(Tensor(graph_.type(id), arena_, static_cast<size_t>(plan_.offsets[id]), Device::kCuda));
      }
    }
    KernelArgs args{node.attrs, args_in, args_out};
    args.stream = stream_;
    args.body = node.body.get();
    if (timer_) timer_->record(2 * n, stream_);
    cuda::set_trace_node(index);  // a kernel trace (kernel_trace.h) names the graph nodes captured now
    try {
      kernels_[n]->kernel(args);
      cuda::set_trace_node(-1);
    } catch (const Error& e) {
      cuda::set_trace_node(-1);
      fail("graph '{}': {} (cuda kernel '{}'): {}", graph_.name, node_text(graph_, n), kernels_[n]->dialect, e.what());
    }
    if (timer_) timer_->record(2 * n + 1, stream_);
    for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = args_out[i];
    for (ValueId id : node.inputs)
      if (last_use_[id] == index) values[id] = Tensor();
    for (ValueId id : node.outputs)
      if (last_use_[id] == index) values[id] = Tensor();
  }
  if (timer_) profiled_run_ = true;
  for (size_t u = 0; u < graph_.updates.size(); ++u) {
    if (!copied_update_[u]) continue;
    const Update& update = graph_.updates[u];
    cuda::copy_async(inputs[graph_.input_index(update.target)], values[update.value], stream_);
  }
}

}  // namespace kiln
