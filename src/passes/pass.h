// Graph passes and the pass manager.
//
// A pass rewrites a Graph and says whether it changed anything. The pass manager runs a plain
// list of passes (the pipeline, passes/pipeline.cc), verifies the graph after each one (always:
// verification is cheap next to compilation, and a broken invariant found late is expensive),
// can print the IR after any pass, skips disabled passes, and times every pass.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "analysis/cost_model.h"
#include "ir/graph.h"
#include "tensor/tensor.h"

namespace kiln {

class Pass {
 public:
  virtual ~Pass() = default;
  virtual std::string name() const = 0;  // kebab-case, e.g. "dead-code"
  // Rewrites `graph`; returns true when it changed. Throws kiln::Error on input it cannot take.
  virtual bool run(Graph& graph) = 0;
  // What the last run did, in a few lines for `kiln compile --report` (what it moved, merged or
  // kept, the bytes and the predicted time saved); empty for most passes.
  virtual std::vector<std::string> notes() const { return {}; }
};

// The default cap of PassOptions::logits_chunk_bytes (and ClassifierChunksPass's): why 2 GiB is in
// passes/classifier_chunks.h.
inline constexpr size_t kDefaultLogitsChunkBytes = size_t{2} << 30;

// Optimizer state in host memory (passes/offload.h): never, when the step does not fit the
// device otherwise, or all of it (tests).
enum class OffloadMode { kOff, kAuto, kAll };

struct PassOptions {
  std::set<std::string> disabled;   // pass names to skip, or "all"
  std::set<std::string> print_after;  // pass names, or "all"
  std::function<void(const std::string& pass, const Graph& graph)> printer;  // default: stdout
  // Planned arena bytes a step may use: adds rematerialization (passes/remat.h) to the pipeline.
  // With offload kAuto, also the device bytes (params, state, data and arena) the step may use.
  std::optional<size_t> memory_budget;
  // Optimizer state moved to pinned host memory (passes/offload.h). kAuto moves it only while
  // the step does not fit memory_budget, or without one 90% of device_memory.
  OffloadMode offload = OffloadMode::kOff;
  std::optional<size_t> device_memory;  // the device's memory, bytes (set by whoever knows it)
  // A language-model head's logits are computed in chunks of at most this many bytes
  // (passes/classifier_chunks.h; 0: never chunked).
  size_t logits_chunk_bytes = kDefaultLogitsChunkBytes;
  // The backend the graph will run on. Most passes pay off everywhere; the pipeline skips those
  // measured to cost time on a target (pipeline.cc says which and why).
  Device target = Device::kCpu;
  // The mixed-precision pass's 16-bit dtype (bf16 or f16) when made by name (make_pass, `kiln
  // opt`); a training step takes it from OptimizerConfig::amp instead.
  DType low_precision = DType::kBF16;
  // Predicted node and collective times for the distribution passes (passes/distributed/);
  // unset: CostModel::defaults(target).
  std::optional<CostModel> costs;
};

struct PassRecord {
  std::string name;
  bool ran = false;  // false when disabled
  bool changed = false;
  double seconds = 0;
  size_t nodes_before = 0;
  size_t nodes_after = 0;
  std::vector<std::string> notes;  // Pass::notes() after its run
};

class PassManager {
 public:
  explicit PassManager(PassOptions options = {}) : options_(std::move(options)) {}
  PassManager& add(std::unique_ptr<Pass> pass);
  // Runs every pass in order. Throws kiln::Error naming the pass when one fails or leaves an
  // invalid graph; also when a disabled or printed pass name is unknown.
  std::vector<PassRecord> run(Graph& graph) const;
  std::vector<std::string> names() const;

 private:
  PassOptions options_;
  std::vector<std::unique_ptr<Pass>> passes_;
};

}  // namespace kiln
