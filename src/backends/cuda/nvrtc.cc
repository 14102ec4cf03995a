// NVRTC compilation and driver-API launch of generated kernels, GEMM-epilogue binding, and the
// "nvrtc" dialect's registration (see nvrtc.h, codegen.h).
#include "backends/cuda/nvrtc.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "backends/cuda/cublaslt.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/registration.h"

namespace kiln::cuda {

const std::string& cuda_include_dir() {
  static const std::string dir = [] {
    std::vector<std::filesystem::path> tried;
    for (const char* env : {"CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"})
      if (const char* v = std::getenv(env); v != nullptr && *v != '\0')
        tried.push_back(std::filesystem::path(v) / "include");
    tried.emplace_back("/usr/local/cuda/include");
    if (const char* path = std::getenv("PATH")) {
      std::stringstream ss(path);
      std::string entry;
      while (std::getline(ss, entry, ':'))
        if (!entry.empty() && std::filesystem::exists(std::filesystem::path(entry) / "nvcc"))
          tried.push_back(std::filesystem::path(entry) / ".." / "include");
    }
    for (const auto& p : tried) {
      std::error_code ec;
      if (std::filesystem::exists(p / "cuda_bf16.h", ec))
        return std::filesystem::weakly_canonical(p, ec).string();
    }
    std::vector<std::string> names;
    for (const auto& p : tried) names.push_back(p.string());
    fail("nvrtc: no CUDA headers (cuda_bf16.h) found; tried {} (set CUDA_HOME)",
         fmt::join(names, ", "));
  }();
  return dir;
}

std::string gpu_architecture(int device) {
  int major = 0, minor = 0;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  // The arch-specific Hopper target (wgmma etc. available to generated code later).
  if (major == 9 && minor == 0) return "sm_90a";
  return fmt::format("sm_{}{}", major, minor);
}

namespace {

// The first "(line): error" of an NVRTC log, with that line of the source.
std::string error_context(const std::string& log, const std::string& source) {
  const size_t at = log.find("): error");
  if (at == std::string::npos) return "";
  const size_t open = log.rfind('(', at);
  if (open == std::string::npos) return "";
  int line = 0;
  try {
    line = std::stoi(log.substr(open + 1, at - open - 1));
  } catch (...) {
    return "";
  }
  std::stringstream ss(source);
  std::string text;
  for (int k = 1; std::getline(ss, text); ++k)
    if (k == line) return fmt::format("\nsource line {}: {}", line, text);
  return "";
}

}  // namespace

std::string nvrtc_compile(const std::string& source, const std::string& arch) {
  nvrtcProgram program = nullptr;
  KILN_NVRTC_CHECK(
      nvrtcCreateProgram(&program, source.c_str(), "kiln_fused.cu", 0, nullptr, nullptr));
  // Destroyed on every path out.
  std::unique_ptr<nvrtcProgram, void (*)(nvrtcProgram*)> guard(
      &program, [](nvrtcProgram* p) { nvrtcDestroyProgram(p); });
  const std::string arch_option = "--gpu-architecture=" + arch;
  const std::string include_option = "--include-path=" + cuda_include_dir();
  const char* options[] = {arch_option.c_str(), "-default-device", "--std=c++17",
                           include_option.c_str()};
  const nvrtcResult result =
      nvrtcCompileProgram(program, static_cast<int>(std::size(options)), options);
  size_t log_size = 0;
  KILN_NVRTC_CHECK(nvrtcGetProgramLogSize(program, &log_size));
  std::string log(log_size, '\0');
  if (log_size > 0) KILN_NVRTC_CHECK(nvrtcGetProgramLog(program, log.data()));
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  if (result != NVRTC_SUCCESS)
    fail("nvrtc: compiling the generated kernel for {} failed ({}):\n{}{}", arch,
         nvrtcGetErrorString(result), log, error_context(log, source));
  size_t size = 0;
  KILN_NVRTC_CHECK(nvrtcGetCUBINSize(program, &size));
  std::string cubin(size, '\0');
  KILN_NVRTC_CHECK(nvrtcGetCUBIN(program, cubin.data()));
  return cubin;
}

namespace {

// One distinct source: its image and its loaded library per architecture. Loading goes through
// the runtime's library API (cudaLibraryLoadData, context-independent), not the driver API, so
// kiln needs no libcuda at link time and starts on machines without a driver.
struct Compiled {
  std::mutex mutex;  // held while compiling or loading this entry only
  struct Loaded {
    cudaLibrary_t library = nullptr;
    cudaKernel_t entry = nullptr, scalar_entry = nullptr;
  };
  std::map<std::string, Loaded> loaded;  // arch -> library
};

struct Cache {
  std::mutex mutex;  // guards `entries` only
  std::unordered_map<std::string, std::shared_ptr<Compiled>> entries;
};
Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: modules stay loaded until exit
  return *c;
}

std::shared_ptr<Compiled> entry_for(const std::string& source) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto& slot = c.entries[source];
  if (!slot) slot = std::make_shared<Compiled>();
  return slot;
}

const Compiled::Loaded& load(const GeneratedKernel& kernel) {
  std::shared_ptr<Compiled> entry = entry_for(kernel.source);
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  const std::string arch = gpu_architecture(device);
  std::lock_guard<std::mutex> lock(entry->mutex);
  if (auto it = entry->loaded.find(arch); it != entry->loaded.end()) return it->second;
  const std::string cubin = nvrtc_compile(kernel.source, arch);
  Compiled::Loaded loaded;
  KILN_CUDA_CHECK(cudaLibraryLoadData(&loaded.library, cubin.data(), nullptr, nullptr, 0,
                                      nullptr, nullptr, 0));
  KILN_CUDA_CHECK(cudaLibraryGetKernel(&loaded.entry, loaded.library, kernel.entry.c_str()));
  if (!kernel.scalar_entry.empty())
    KILN_CUDA_CHECK(
        cudaLibraryGetKernel(&loaded.scalar_entry, loaded.library, kernel.scalar_entry.c_str()));
  return entry->loaded.emplace(arch, loaded).first->second;
}

}  // namespace

size_t nvrtc_cache_size() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.entries.size();
}

void launch_generated(const GeneratedKernel& kernel, const KernelArgs& args) {
  KILN_CHECK(args.inputs.size() + args.outputs.size() == kernel.param_element_bytes.size(),
             "nvrtc: the kernel takes {} tensors, {} inputs and {} outputs were given",
             kernel.param_element_bytes.size(), args.inputs.size(), args.outputs.size());
  if (kernel.rows == 0 || (kernel.kind == "elementwise" && kernel.row_length == 0)) return;
  std::vector<void*> pointers;
  for (const Tensor& t : args.inputs) pointers.push_back(t.raw());
  for (const Tensor& t : args.outputs) pointers.push_back(t.raw());
  bool aligned = true;
  for (size_t k = 0; k < pointers.size(); ++k) {
    const auto bytes = static_cast<uintptr_t>(kernel.vector_width) *
                       static_cast<uintptr_t>(kernel.param_element_bytes[k]);
    aligned = aligned && reinterpret_cast<uintptr_t>(pointers[k]) % bytes == 0;
  }
  const Compiled::Loaded& loaded = load(kernel);
  const bool vector = aligned || loaded.scalar_entry == nullptr;
  std::vector<void*> params;
  for (void*& p : pointers) params.push_back(&p);
  const int64_t blocks = vector ? kernel.blocks : kernel.scalar_blocks;
  // A cudaKernel_t from cudaLibraryGetKernel is launched like a kernel symbol.
  KILN_CUDA_CHECK(cudaLaunchKernel(
      reinterpret_cast<const void*>(vector ? loaded.entry : loaded.scalar_entry),
      dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(kernel.threads)),
      params.data(), 0, static_cast<cudaStream_t>(args.stream)));
}

// ---- GEMM epilogues --------------------------------------------------------------------------

namespace {

struct GemmBinding {
  Gemm gemm;
  int a = -1, b = -1, bias = -1, aux_in = -1;  // body input indices
  int d = -1, aux_out = -1, bias_grad = -1;     // body output indices
};

struct NoMatch {
  std::string why;
};
[[noreturn]] void no_match(std::string why) { throw NoMatch{std::move(why)}; }

GemmBinding match_gemm(const Graph& body) {
  // Consumers of each value, and which node produces it.
  std::map<ValueId, std::vector<int>> consumers;
  std::map<ValueId, int> producer;
  for (size_t k = 0; k < body.nodes.size(); ++k) {
    for (ValueId id : body.nodes[k].inputs) consumers[id].push_back(static_cast<int>(k));
    for (ValueId id : body.nodes[k].outputs) producer[id] = static_cast<int>(k);
  }
  auto output_index = [&](ValueId id) {
    for (size_t k = 0; k < body.outputs.size(); ++k)
      if (body.outputs[k] == id) return static_cast<int>(k);
    return -1;
  };
  int mm = -1;
  for (size_t k = 0; k < body.nodes.size(); ++k) {
    if (body.nodes[k].op != Op::kMatmul) continue;
    if (mm >= 0) no_match("more than one matmul");
    mm = static_cast<int>(k);
  }
  if (mm < 0) no_match("no matmul");
  const Node& matmul = body.nodes[mm];
  GemmBinding g;
  g.a = body.input_index(matmul.inputs[0]);
  g.b = body.input_index(matmul.inputs[1]);
  if (g.a < 0 || g.b < 0) no_match("a matmul operand is computed inside the group");
  const TensorType &at = body.type(matmul.inputs[0]), &bt = body.type(matmul.inputs[1]);
  const DType dtype = at.dtype;
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    no_match(fmt::format("dtype {} (f32, bf16, f16 only)", dtype_name(dtype)));
  const bool ta = matmul.attrs.b("transpose_a"), tb = matmul.attrs.b("transpose_b");
  if (bt.rank() != 2) no_match("b is batched");
  if (ta && at.rank() != 2) no_match("a is batched and transposed");
  Gemm& gemm = g.gemm;
  gemm.transpose_a = ta;
  gemm.transpose_b = tb;
  gemm.k = ta ? at.shape[0] : at.shape.back();
  gemm.m = ta ? at.shape[1] : (gemm.k == 0 ? 0 : numel(at.shape) / gemm.k);
  gemm.n = tb ? bt.shape[0] : bt.shape[1];
  gemm.a_type = gemm.d_type = dtype;
  gemm.tf32 = dtype == DType::kF32 && matmul_allow_tf32();
  const ValueId mm_out = matmul.outputs[0];
  const Shape bias_shape{gemm.n};

  // The single consumer of `id` inside the body, or -1.
  auto sole_consumer = [&](ValueId id) {
    auto it = consumers.find(id);
    if (it == consumers.end()) return -1;
    if (it->second.size() != 1) no_match("a value is read twice in the epilogue");
    return it->second[0];
  };
  auto input_of = [&](ValueId id) { return body.input_index(id); };
  auto is_rowsum = [&](const Node& n, const Shape& of) {
    // sum over every leading axis of a (rows, n) value, no keepdims: a bias gradient.
    if (n.op != Op::kSum || n.attrs.b("keepdims")) return false;
    std::vector<int64_t> axes = n.attrs.ints("axes");
    const int rank = static_cast<int>(of.size());
    if (rank < 2 || static_cast<int>(axes.size()) != rank - 1) return false;
    std::vector<bool> hit(rank, false);
    for (int64_t a : axes) hit[normalize_axis(a, rank)] = true;
    for (int d = 0; d + 1 < rank; ++d)
      if (!hit[d]) return false;
    return true;
  };

  size_t used_nodes = 1;
  ValueId pre = mm_out;
  int next = sole_consumer(mm_out);
  Epilogue epilogue = Epilogue::kNone;
  if (next >= 0 && body.nodes[next].op == Op::kAdd) {
    const Node& add = body.nodes[next];
    const ValueId other = add.inputs[0] == mm_out ? add.inputs[1] : add.inputs[0];
    g.bias = input_of(other);
    if (g.bias < 0 || body.type(other).shape != bias_shape || body.type(other).dtype != dtype)
      no_match("the add after the matmul is not a bias of shape (n,)");
    pre = add.outputs[0];
    epilogue = Epilogue::kBias;
    ++used_nodes;
    next = sole_consumer(pre);
  }
  if (next >= 0 && body.nodes[next].op == Op::kGelu) {
    if (body.nodes[next].attrs.s("approximate") != "tanh")
      no_match("gelu is the erf form; only the tanh form maps onto cuBLASLt's GELU epilogues");
    const ValueId y = body.nodes[next].outputs[0];
    g.d = output_index(y);
    g.aux_out = output_index(pre);
    if (g.d < 0) no_match("the gelu's result is not an output");
    const bool bias = epilogue == Epilogue::kBias;
    epilogue = g.aux_out >= 0 ? (bias ? Epilogue::kGeluAuxBias : Epilogue::kGeluAux)
                              : (bias ? Epilogue::kGeluBias : Epilogue::kGelu);
    ++used_nodes;
  } else if (next >= 0 && body.nodes[next].op == Op::kGeluGrad && epilogue == Epilogue::kNone) {
    const Node& gg = body.nodes[next];
    if (gg.attrs.s("approximate") != "tanh")
      no_match("gelu_grad is the erf form; only the tanh form maps onto DGELU");
    if (gg.inputs[1] != mm_out) no_match("the matmul is gelu_grad's x, not its dy");
    g.aux_in = input_of(gg.inputs[0]);
    if (g.aux_in < 0) no_match("gelu_grad's x is computed inside the group");
    const ValueId dx = gg.outputs[0];
    g.d = output_index(dx);
    if (g.d < 0) no_match("gelu_grad's result is not an output");
    epilogue = Epilogue::kDGelu;
    ++used_nodes;
    if (auto it = consumers.find(dx); it != consumers.end()) {
      if (it->second.size() != 1 || !is_rowsum(body.nodes[it->second[0]], body.type(dx).shape))
        no_match("gelu_grad's result is read by something other than a bias-gradient sum");
      g.bias_grad = output_index(body.nodes[it->second[0]].outputs[0]);
      if (g.bias_grad < 0) no_match("the bias gradient is not an output");
      epilogue = Epilogue::kDGeluBGrad;
      ++used_nodes;
    }
  } else if (next >= 0) {
    no_match(fmt::format("{} after the matmul has no cuBLASLt epilogue",
                         op_info(body.nodes[next].op).name));
  } else {
    g.d = output_index(pre);
    if (g.d < 0) no_match("the product is not an output");
  }
  if (epilogue == Epilogue::kBias) {
    g.d = output_index(pre);
    if (g.d < 0) no_match("the biased product is not an output");
  }
  // A bias gradient of an operand: sum over rows of B (stored (k, n)) or of A (stored (k, m)).
  if (epilogue == Epilogue::kNone) {
    for (size_t k = 0; k < body.nodes.size(); ++k) {
      const Node& n = body.nodes[k];
      if (static_cast<int>(k) == mm || n.op != Op::kSum) continue;
      const int which = input_of(n.inputs[0]);
      const int out = output_index(n.outputs[0]);
      if (out < 0 || !is_rowsum(n, body.type(n.inputs[0]).shape) ||
          body.type(n.inputs[0]).rank() != 2)
        no_match("a sum that is not a bias gradient of a matmul operand");
      if (which == g.b && !tb) {
        epilogue = Epilogue::kBGradB;
      } else if (which == g.a && ta) {
        epilogue = Epilogue::kBGradA;
      } else {
        no_match("the summed operand has no BGRAD layout (B must be (k, n), A must be (k, m))");
      }
      g.bias_grad = out;
      ++used_nodes;
      break;
    }
  }
  if (used_nodes != body.nodes.size()) no_match("the body has ops outside the epilogue pattern");
  // Every output is one the epilogue writes (no intermediate of the pattern escapes).
  for (size_t k = 0; k < body.outputs.size(); ++k) {
    const int o = static_cast<int>(k);
    if (o != g.d && o != g.aux_out && o != g.bias_grad)
      no_match(fmt::format("output {} is an intermediate the epilogue does not write", k));
  }
  if (epilogue_reads_aux(epilogue) || epilogue_writes_aux(epilogue)) {
    if (gemm.n % 8 != 0) no_match("n is not a multiple of 8 (cuBLASLt's GELU aux layout)");
  }
  if (epilogue == Epilogue::kDGelu || epilogue == Epilogue::kDGeluBGrad) {
    if (body.type(body.inputs[g.aux_in].value).shape != body.type(mm_out).shape)
      no_match("gelu_grad's x does not have the product's shape");
  }
  gemm.epilogue = epilogue;
  return g;
}

std::optional<GemmBinding> try_match(const Graph& body, std::string* why) {
  try {
    return match_gemm(body);
  } catch (const NoMatch& m) {
    if (why) *why = m.why;
  } catch (const Error& e) {
    if (why) *why = e.what();
  }
  return std::nullopt;
}

void run_gemm_epilogue(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "nvrtc: a gemm-epilogue fused node without its body");
  std::string why;
  std::optional<GemmBinding> g = try_match(*args.body, &why);
  KILN_CHECK(g.has_value(), "nvrtc: the gemm-epilogue body is not supported: {}", why);
  GemmOperands ops;
  ops.a = args.inputs[g->a].raw();
  ops.b = args.inputs[g->b].raw();
  ops.d = args.outputs[g->d].raw();
  if (g->bias >= 0) ops.bias = args.inputs[g->bias].raw();
  if (g->aux_in >= 0) ops.aux = args.inputs[g->aux_in].raw();
  if (g->aux_out >= 0) ops.aux = args.outputs[g->aux_out].raw();
  if (g->bias_grad >= 0) ops.bias_grad = args.outputs[g->bias_grad].raw();
  if (g->gemm.m == 0 || g->gemm.n == 0) return;
  g->gemm.run(ops, static_cast<cudaStream_t>(args.stream));
}

}  // namespace

bool gemm_epilogue_supported(const Graph& body, std::string* why) {
  return try_match(body, why).has_value();
}

std::string describe_gemm_epilogue(const Graph& body) {
  std::string why;
  std::optional<GemmBinding> g = try_match(body, &why);
  KILN_CHECK(g.has_value(), "nvrtc: the gemm-epilogue body is not supported: {}", why);
  return g->gemm.to_string();
}

std::string fused_kernel_listing(const Graph& body, const std::string& kind) {
  std::string ops;
  for (const Node& node : body.nodes)
    ops += (ops.empty() ? "" : ", ") + std::string(op_info(node.op).name);
  std::string why;
  if (kind == "gemm-epilogue") {
    if (gemm_epilogue_supported(body, &why))
      return fmt::format("// kiln fused node (gemm-epilogue): ops {}\n// runs as one cuBLASLt "
                         "product with a fused epilogue, no generated source:\n//   {}\n",
                         ops, describe_gemm_epilogue(body));
  } else if (can_generate(body, kind, &why)) {
    return generate_kernel(body, kind).source;
  }
  return fmt::format("// kiln fused node ({}): ops {}\n// not generated by the nvrtc dialect: {}\n"
                     "// (it runs on a lower-priority dialect)\n",
                     kind, ops, why);
}

// ---- registration ----------------------------------------------------------------------------

void register_nvrtc_kernels(KernelRegistry& registry) {
  registry.add(
      Op::kFused,
      KernelImpl{"nvrtc", Device::kCuda, kGeneratedPriority,
                 [](const NodeView& view) {
                   const Node& node = view.node;
                   if (!node.body || !node.attrs.has("kind")) return false;
                   const std::string& kind = node.attrs.s("kind");
                   if (kind == "gemm-epilogue") return gemm_epilogue_supported(*node.body);
                   return can_generate(*node.body, kind);
                 },
                 [](const KernelArgs& args) {
                   KILN_CHECK(args.body != nullptr, "nvrtc: a fused node without its body");
                   const std::string& kind = args.attrs.s("kind");
                   if (kind == "gemm-epilogue") {
                     run_gemm_epilogue(args);
                     return;
                   }
                   launch_generated(generate_kernel(*args.body, kind), args);
                 }});
}

}  // namespace kiln::cuda
