// CUPTI activity tracing (kernel_trace.h). Two parts:
//  - a resource callback, on while a KernelTrace exists: each graph node a CUDA-graph capture
//    creates (or instantiation clones) is remembered with the kiln node being enqueued on that
//    thread, so a replayed kernel's record (which carries its graph node's id) names its node;
//  - activity records (kernels, copies, fills) between start() and stop(), delivered by CUPTI in
//    buffers that it hands back when full or flushed.
#include "backends/cuda/runtime/kernel_trace.h"

#include <mutex>
#include <unordered_map>

#include "support/error.h"

#ifdef KILN_HAVE_CUPTI
#include <cxxabi.h>
#include <algorithm>
#include <cstdlib>
#include <cupti.h>

#include "backends/cuda/common/cuda_check.h"
#endif

namespace kiln::cuda {

namespace {
thread_local int64_t t_trace_node = -1;
}  // namespace

void set_trace_node(int64_t node) { t_trace_node = node; }

#ifdef KILN_HAVE_CUPTI

bool kernel_trace_available() { return true; }

namespace {

// CUPTI calls back into plain functions: the one live trace's state is process-wide.
struct Shared {
  std::mutex mu;
  bool live = false;
  std::unordered_map<uint64_t, int64_t> node_of;  // CUPTI graph node id -> kiln node
  std::vector<TraceEvent> events;
};
Shared& shared() {
  static Shared s;
  return s;
}

void check_cupti(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  fail("CUPTI: {} failed: {}", what, text ? text : "unknown error");
}

std::string demangled(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d != nullptr ? d : name;
  std::free(d);
  // Template arguments and parameter lists make names of hundreds of characters: keep the head.
  constexpr size_t kMax = 120;
  if (out.size() > kMax) out = out.substr(0, kMax) + "...";
  return out;
}

// The caller holds shared().mu.
int64_t node_of_locked(uint64_t graph_node) {
  if (graph_node == 0) return -1;
  const Shared& s = shared();
  auto it = s.node_of.find(graph_node);
  return it == s.node_of.end() ? -1 : it->second;
}

void CUPTIAPI on_resource(void*, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RESOURCE || data == nullptr) return;
  const auto* resource = static_cast<const CUpti_ResourceData*>(data);
  const auto* graph = static_cast<const CUpti_GraphData*>(resource->resourceDescriptor);
  if (graph == nullptr || graph->node == nullptr) return;
  uint64_t id = 0;
  if (cuptiGetGraphNodeId(graph->node, &id) != CUPTI_SUCCESS) return;
  Shared& s = shared();
  if (cbid == CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED) {
    if (t_trace_node < 0) return;
    std::lock_guard lock(s.mu);
    s.node_of[id] = t_trace_node;
  } else if (cbid == CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED && graph->originalNode != nullptr) {
    uint64_t original = 0;
    if (cuptiGetGraphNodeId(graph->originalNode, &original) != CUPTI_SUCCESS) return;
    std::lock_guard lock(s.mu);
    auto it = s.node_of.find(original);
    if (it != s.node_of.end()) s.node_of[id] = it->second;
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = 8u << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer ? kBytes : 0;
  *max_records = 0;  // as many as fit
}

const char* copy_kind(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    default: return "memcpy";
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Shared& s = shared();
  std::lock_guard lock(s.mu);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    TraceEvent e;
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        e = {demangled(k->name), k->start / 1e3, k->end / 1e3, k->correlationId, node_of_locked(k->graphNodeId)};
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        e = {copy_kind(m->copyKind), m->start / 1e3, m->end / 1e3, m->correlationId, node_of_locked(m->graphNodeId)};
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        e = {"memset", m->start / 1e3, m->end / 1e3, m->correlationId, node_of_locked(m->graphNodeId)};
        break;
      }
      default:
        continue;
    }
    s.events.push_back(std::move(e));
  }
  std::free(buffer);
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};

}  // namespace

struct KernelTrace::State {
  CUpti_SubscriberHandle subscriber = nullptr;
  bool recording = false;
};

KernelTrace::KernelTrace() : state_(std::make_unique<State>()) {
  Shared& s = shared();
  {
    std::lock_guard lock(s.mu);
    KILN_CHECK(!s.live, "one kernel trace at a time: another KernelTrace exists");
    s.live = true;
    s.node_of.clear();
    s.events.clear();
  }
  try {
    check_cupti(cuptiSubscribe(&state_->subscriber, on_resource, nullptr), "cuptiSubscribe");
    check_cupti(cuptiEnableCallback(1, state_->subscriber, CUPTI_CB_DOMAIN_RESOURCE,
                                    CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED),
                "enabling the graph-node callback");
    check_cupti(cuptiEnableCallback(1, state_->subscriber, CUPTI_CB_DOMAIN_RESOURCE,
                                    CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED),
                "enabling the graph-node clone callback");
    static std::once_flag registered;
    CUptiResult r = CUPTI_SUCCESS;
    std::call_once(registered, [&] { r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed); });
    check_cupti(r, "cuptiActivityRegisterCallbacks");
  } catch (...) {
    if (state_->subscriber) cuptiUnsubscribe(state_->subscriber);
    std::lock_guard lock(s.mu);
    s.live = false;
    throw;
  }
}

KernelTrace::~KernelTrace() {
  if (state_->recording) {
    for (CUpti_ActivityKind k : kKinds) cuptiActivityDisable(k);
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  }
  if (state_->subscriber) cuptiUnsubscribe(state_->subscriber);
  Shared& s = shared();
  std::lock_guard lock(s.mu);
  s.live = false;
  s.node_of.clear();
  s.events.clear();
}

void KernelTrace::start() {
  KILN_CHECK(!state_->recording, "KernelTrace::start: already recording");
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  {
    Shared& s = shared();
    std::lock_guard lock(s.mu);
    s.events.clear();
  }
  for (CUpti_ActivityKind k : kKinds) check_cupti(cuptiActivityEnable(k), "cuptiActivityEnable");
  state_->recording = true;
}

std::vector<TraceEvent> KernelTrace::stop() {
  KILN_CHECK(state_->recording, "KernelTrace::stop without start");
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  for (CUpti_ActivityKind k : kKinds) check_cupti(cuptiActivityDisable(k), "cuptiActivityDisable");
  check_cupti(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  state_->recording = false;
  Shared& s = shared();
  std::lock_guard lock(s.mu);
  std::vector<TraceEvent> out = std::move(s.events);
  s.events.clear();
  std::sort(out.begin(), out.end(), [](const TraceEvent& a, const TraceEvent& b) { return a.start_us < b.start_us; });
  return out;
}

#else  // CUDA without CUPTI

bool kernel_trace_available() { return false; }
struct KernelTrace::State {};
KernelTrace::KernelTrace() { fail("this build has no CUPTI (libcupti and cupti.h were not found at configure time)"); }
KernelTrace::~KernelTrace() = default;
void KernelTrace::start() {}
std::vector<TraceEvent> KernelTrace::stop() { return {}; }

#endif

}  // namespace kiln::cuda
