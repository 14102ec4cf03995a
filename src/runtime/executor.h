// The executor: binds a verified graph to kernels (one dialect choice per node), then runs it
// on given inputs.
//
// Memory: by default the graph's intermediates (every node output that is not a graph output,
// update values included) live in ONE arena allocated at construction and reused by every run,
// at the offsets computed by plan_memory() (analysis/memory_plan.h); a kernel gets Tensor views
// of it. Graph outputs live outside it (see Outputs below). With ExecutorOptions::plan_memory
// off, every value gets its own bytes (the simple allocator: what the plan is tested against).
//
// Views: with the plan on, a reshape or contiguous slice the plan makes a view (memory_plan.h:
// not a graph output nor an update value) runs no kernel: its output is a Tensor of its input's
// bytes in the new shape, or for a slice of the run of them at the view's byte offset
// (MemoryPlan::view_offsets), in whatever storage the input has (the arena's, or a graph input's
// or output's). With the plan off, every reshape and slice runs its copy kernel (the oracle
// again).
//
// Devices: the executor reaches its device only through a DeviceRuntime
// (device/device_runtime.h), and runs ONE node loop for every device; what differs comes from
// the runtime (and from the kernels, which enqueue on the stream they are given).
// - Every node gets a kernel registered for options.device; a node without one is an error at
//   construction naming the node, its op and its input types.
// - ONE allocation (DeviceRuntime::allocate) holds the planned arena and, on a device other
//   than the CPU, the graph outputs. Before allocating, the executor checks the device's free
//   memory for it plus options.device_bytes_to_come (the caller's inputs still to be uploaded)
//   and throws "needs X GiB ..., Y GiB free on <device>". With plan_memory off, every arena
//   value gets its own bytes in that allocation (no reuse, no views, every update copied at the
//   end): the oracle the plan is tested against.
// - Inputs must be tensors of options.device (DeviceRuntime::to_device uploads host tensors),
//   except host-resident ones (input_on_host: offloaded optimizer state, read only through
//   `reload` nodes), which are host tensors.
//   run() only enqueues work on the executor's stream (every kernel gets it as
//   KernelArgs::stream) and returns without waiting for the device: the caller synchronizes
//   (synchronize(), or DeviceRuntime::to_host, which waits) before reading. On the CPU the work
//   is done when run() returns.
// - Outputs: on the CPU, fresh buffers each run, so callers may keep them. On a device, buffers
//   the executor owns and REUSES (an allocation inside a step would cost time and break graph
//   replay): the next run() overwrites them (on the stream, so a copy enqueued on the same
//   stream in between sees this run's values). Copy them out before running again if they must
//   be kept.
// - Updates: where legal, the node that computes a new param/state value writes it straight
//   into the input's storage (nothing later reads the old value, and the node either does not
//   read the old value or its kernel is in_place_ok); otherwise a copy at the end of the run.
// - Graph capture (options.cuda_graphs, on by default, where the runtime can capture: CUDA):
//   the first run with a set of input pointers runs the kernels directly (a warm-up: kernels
//   may allocate workspaces or pick algorithms on first use); the next (after the tuning run,
//   options.tune_gemms, if the graph has cuBLASLt products) captures the whole run into a CUDA
//   graph and launches it; later runs with the same input pointers replay it (one launch per
//   step). Input pointers that change trigger a new capture. Off: every run launches every
//   kernel (for debugging, and the oracle of the replay tests).
// - Collectives (ops/collective.h; options.communicator): a collective runs on a communication
//   stream of the executor's own, after an event recorded on the compute stream where the node
//   stands, and records a second event when done; its collective_wait makes the compute stream
//   wait for that one. Kernels between the two overlap the communication. Both streams are
//   captured into the one CUDA graph (the fork and join are events), and the collectives are
//   enqueued in node order, which is the same on every rank. On the CPU, Gloo's calls return
//   when done and the events cost nothing.
// - The update stream (ops/update_stream.h): a node marked for it (an optimizer's grouped
//   updates, by the overlap-updates pass) runs on a background stream of the executor's, forked
//   where it stands, so that it fills the gaps of the backward pass still running on the compute
//   stream; the compute stream waits for it at the end of the run (before the copies of updates
//   and the end of a capture). On the CPU, and in profiled runs, such a node runs in order.
// - Profiling (options.profile): every run launches every kernel (no capture), with a timing
//   event recorded before and after each node's kernel (events created once, at construction,
//   and reused; on the CPU they read the host's clock); profile() reads the last run's per-node
//   times (a view node, reshape or slice: 0 ms, dialect "view", no events). Off (the default),
//   runs record no events at all.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "analysis/memory_plan.h"
#include "backends/backend.h"
#include "device/communicator.h"
#include "device/device_runtime.h"
#include "ir/graph.h"
#include "runtime/profile.h"
#include "tensor/tensor.h"

namespace kiln {

struct ExecutorOptions {
  Device device = Device::kCpu;
  std::vector<std::string> dialects;  // allowed dialects; empty = all
  bool plan_memory = true;            // one planned arena; false: a buffer per value
  // Fill the arena with 0xFF bytes (NaN for floats) at construction: a kernel that reads its
  // output before writing it, or a plan that lets two live values share bytes, shows up in
  // tests instead of hiding behind zeroed memory.
  bool poison_arena = false;
  // Capture runs into a CUDA graph and replay it (see above); ignored where the runtime cannot
  // capture (the CPU).
  bool cuda_graphs = true;
  // The stream to enqueue on, of options.device's runtime (borrowed: it must outlive the
  // executor); nullptr: the executor creates and owns one.
  const DeviceStream* stream = nullptr;
  // Device bytes the caller will still allocate for this graph's inputs (params, state, batch):
  // checked together with the arena so that an out-of-memory error names the whole need.
  size_t device_bytes_to_come = 0;
  // Time every node's kernel with events; no CUDA-graph capture (see above).
  bool profile = false;
  // Where kernels tune (CUDA): the second run of a graph with cuBLASLt products (matmuls, GEMM groups) chooses
  // each product's algorithm by timing the heuristic's candidates (cuda::GemmTuningScope; the
  // winners are cached for the process), outside any capture: the first run keeps the heuristic's
  // first choices, so the first step is not held up, and graph capture moves to the third run.
  // Measured on GPT-2 (H100): -1.5 ms of a 58 ms step, for ~0.5 s in the second run.
  bool tune_gemms = true;
  // Where kernels are chosen from; nullptr: kernel_registry(), every kernel kiln has (tests
  // bring their own).
  const KernelRegistry* registry = nullptr;
  // The process group's collective engine (borrowed), for graphs with collective ops
  // (ops/collective.h); required by them, ignored by the rest.
  const Communicator* communicator = nullptr;
};

class Executor {
 public:
  // Verifies the graph, selects a kernel for every node and plans and allocates the arena.
  // Throws kiln::Error.
  explicit Executor(Graph graph, ExecutorOptions options = {});

  ~Executor();

  // Runs the graph. `inputs` are in the order of graph.inputs and must match their types (and
  // be on options.device). Graph updates are written into the storage of the corresponding
  // input tensors. Not safe to call concurrently on one Executor: runs share its arena. It may
  // return before the device finishes (see above).
  std::vector<Tensor> run(std::span<const Tensor> inputs) const;

  // The runtime of options.device, and the stream runs are enqueued on.
  const DeviceRuntime& runtime() const { return *runtime_; }
  const DeviceStream& stream() const { return *stream_; }
  // Waits for the runs enqueued so far, then throws the first data error a kernel recorded
  // (DeviceRuntime::check_kernel_errors).
  void synchronize() const;
  // Bytes of the one allocation (arena, and outputs where they are reused).
  size_t device_bytes() const { return device_bytes_; }
  // How many runs replayed a captured graph, and how many captures were made.
  int64_t graph_replays() const { return graph_replays_; }
  int64_t graph_captures() const { return graph_captures_; }
  // Updates written in place by their node (the rest are copied at the end of a run).
  size_t direct_update_count() const { return direct_update_count_; }
  // Nodes that run on the update stream, beside the compute (0 on the CPU and when profiling).
  size_t update_stream_nodes() const {
    return static_cast<size_t>(std::count_if(update_ready_.begin(), update_ready_.end(), [](const auto& e) { return e != nullptr; }));
  }
  // Whether graph input `i` is host-resident: read only by `reload` nodes (offloaded state,
  // passes/offload.h). run() takes it as a host tensor (pinned, for asynchronous copies on CUDA).
  bool input_on_host(size_t i) const { return host_input_.at(i); }
  // With options.profile: waits for the last run, then returns one timing per node, in node
  // order. Throws kiln::Error without options.profile or before the first run.
  std::vector<NodeTiming> profile() const;
  // Seconds the constructor spent choosing kernels, preparing them (compiles, cuDNN plans; on
  // threads) and planning memory and allocating the arena.
  struct BuildTimes {
    double select_s = 0, prepare_s = 0, setup_s = 0;
  };
  const BuildTimes& build_times() const { return build_times_; }
  // One label per node, in node order (NodeTiming with ms 0): op, dialect (`view` for a view node,
  // which runs no kernel), fused kind and output types.
  std::vector<NodeTiming> node_labels() const;

  const Graph& graph() const { return graph_; }
  // The dialect chosen for each node, in node order.
  std::vector<std::string> node_dialects() const;
  // The memory plan in use; nullptr when options.plan_memory is off.
  const MemoryPlan* memory_plan() const { return options_.plan_memory ? &plan_ : nullptr; }

 private:
  void prepare_kernels();
  void plan_with_direct_updates();
  void setup();
  void setup_update_stream();
  // New buffers for a run's outputs (where they are not reused), one per output slot.
  std::vector<Tensor> fresh_outputs() const;
  // Enqueues every node's kernel, and the copies of outputs that are inputs and of updates not
  // written in place, on the stream: the one node loop.
  void enqueue(std::span<const Tensor> inputs, std::span<const Tensor> outputs) const;
  // Whether node n is a reshape or slice planned as a view (memory_plan.h): no kernel runs for it.
  bool is_view_node(size_t n) const {
    const Node& node = graph_.nodes[n];
    return !plan_.views.empty() && node.outputs.size() == 1 && plan_.is_view(node.outputs[0]);
  }
  // The tensor of view value `out` given its input's tensor: the input's storage at the view's
  // byte offset in it, as out's type.
  Tensor view_of(const Tensor& input, ValueId out) const {
    return input.viewed(graph_.type(out), static_cast<size_t>(plan_.view_offsets[static_cast<size_t>(out)]));
  }

  Graph graph_;
  ExecutorOptions options_;
  std::unique_ptr<DeviceRuntime> runtime_;
  // The compute stream every kernel enqueues on: options.stream, or owned_stream_. (Collectives
  // will enqueue on a communication stream of their own, DeviceRuntime::create_stream, joined
  // to this one by events: DeviceStream::wait.)
  std::unique_ptr<DeviceStream> owned_stream_;
  const DeviceStream* stream_ = nullptr;
  void* stream_handle_ = nullptr;              // stream_->handle(), as KernelArgs::stream
  DeviceRuntime::NodeMarker mark_node_ = nullptr;  // names each node's kernels for device traces
  std::vector<const KernelImpl*> kernels_;
  std::vector<int> last_use_;  // per value: index of the last node reading it (-1: none)
  MemoryPlan plan_;
  std::shared_ptr<std::byte[]> arena_;  // the one allocation: arena, then reused outputs
  size_t device_bytes_ = 0;
  bool reuse_outputs_ = false;           // outputs live in arena_ (a device) or are fresh (the CPU)
  std::vector<Tensor> output_tensors_;   // reuse_outputs_: per output slot, its buffer
  std::vector<size_t> output_offsets_;   // per output slot: its offset in arena_ (reuse_outputs_)
  std::vector<int> output_slot_;         // per value: index of its output slot, or -1
  std::vector<int> direct_update_input_; // per value: the graph input it is written into, or -1
  std::vector<bool> copied_update_;      // per update: copied at the end of the run
  size_t direct_update_count_ = 0;
  std::vector<bool> host_input_;         // per graph input: host-resident (see input_on_host)
  std::unique_ptr<DeviceGraph> captured_;  // nullptr: runs are not captured
  mutable std::vector<const std::byte*> captured_pointers_;
  mutable bool warmed_up_ = false;
  bool has_gemm_ = false;      // some node runs a cuBLASLt product
  mutable bool tuned_ = false;  // the tuning run (options_.tune_gemms) is done
  mutable int64_t graph_replays_ = 0;
  mutable int64_t graph_captures_ = 0;
  BuildTimes build_times_;
  // Collectives: the communication stream, and per collective node the event the compute
  // stream records before it (ready) and the one the communication stream records after it
  // (done); empty without collectives.
  std::unique_ptr<DeviceStream> comm_stream_;
  std::vector<std::unique_ptr<DeviceEvent>> comm_ready_, comm_done_;
  std::vector<int> waited_collective_;  // per node: a collective_wait's collective node, or -1
  // The update stream (ops/update_stream.h), where the nodes marked for it run (on a device,
  // unprofiled), forked per node by its ready event and joined by update_done_ at the end of
  // the run; null without such nodes.
  std::unique_ptr<DeviceStream> update_stream_;
  std::unique_ptr<DeviceEvent> update_done_;
  std::vector<std::unique_ptr<DeviceEvent>> update_ready_;  // per node: its fork, or null
  // options.profile: events 2n and 2n+1 around node n's kernel.
  std::vector<std::unique_ptr<DeviceEvent>> timing_events_;
  mutable bool profiled_run_ = false;
};

}  // namespace kiln
