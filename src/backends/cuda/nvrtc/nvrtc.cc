// NVRTC compilation and driver-API launch of generated kernels, GEMM-epilogue binding, and the
// "nvrtc" dialect's registration (see nvrtc.h, codegen.h).
#include "backends/cuda/nvrtc/nvrtc.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "backends/cuda/cublaslt/cublaslt.h"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/registration.h"
#include "backends/cuda/common/scratch.cuh"

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

// NVRTC's options for `arch`: one list for the compile and the cache key.
std::vector<std::string> compile_options(const std::string& arch) {
  return {"--gpu-architecture=" + arch, "-default-device", "--std=c++17",
          "--include-path=" + cuda_include_dir()};
}

// Bump when what a given key compiles to changes in a way the key does not show (e.g. a new
// post-processing of the CUBIN): older entries then miss.
constexpr int kNvrtcCacheVersion = 1;

}  // namespace

std::string nvrtc_compile(const std::string& source, const std::string& arch) {
  nvrtcProgram program = nullptr;
  KILN_NVRTC_CHECK(
      nvrtcCreateProgram(&program, source.c_str(), "kiln_fused.cu", 0, nullptr, nullptr));
  // Destroyed on every path out.
  std::unique_ptr<nvrtcProgram, void (*)(nvrtcProgram*)> guard(
      &program, [](nvrtcProgram* p) { nvrtcDestroyProgram(p); });
  const std::vector<std::string> option_text = compile_options(arch);
  std::vector<const char*> options;
  for (const std::string& o : option_text) options.push_back(o.c_str());
  const nvrtcResult result =
      nvrtcCompileProgram(program, static_cast<int>(options.size()), options.data());
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

std::string nvrtc_cache_key(const std::string& source, const std::string& arch) {
  int major = 0, minor = 0;
  KILN_NVRTC_CHECK(nvrtcVersion(&major, &minor));
  return fmt::format("kiln nvrtc cache key {}\nnvrtc {}.{}\narch {}\noptions {}\nsource\n{}",
                     kNvrtcCacheVersion, major, minor, arch,
                     fmt::join(compile_options(arch), " "), source);
}

std::string nvrtc_compile_cached(const std::string& source, const std::string& arch,
                                 CompileCache* cache) {
  CompileCache& disk = cache != nullptr ? *cache : CompileCache::global("nvrtc");
  if (!disk.enabled()) return nvrtc_compile(source, arch);
  const std::string key = nvrtc_cache_key(source, arch);
  if (std::optional<std::string> cubin = disk.load(key)) return std::move(*cubin);
  std::string cubin = nvrtc_compile(source, arch);
  disk.store(key, cubin);
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
    cudaKernel_t entry = nullptr, scalar_entry = nullptr, finish_entry = nullptr;
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

// The kernel compiled (or read from the compile cache) and loaded for the current device.
// `ahead`: a prepare's call, which returns at once (nullptr) when another thread is compiling
// the same source: the executor prepares nodes on several threads and waits for all of them,
// so the node is ready when the executor is, and this thread goes on to a kernel nobody compiles
// yet instead of waiting (GPT-2's 74 fused nodes share 7 sources).
const Compiled::Loaded* load(const GeneratedKernel& kernel, bool ahead) {
  std::shared_ptr<Compiled> entry = entry_for(kernel.source);
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  const std::string arch = gpu_architecture(device);
  std::unique_lock<std::mutex> lock(entry->mutex, std::defer_lock);
  if (!ahead) lock.lock();
  else if (!lock.try_lock()) return nullptr;
  if (auto it = entry->loaded.find(arch); it != entry->loaded.end()) return &it->second;
  const std::string cubin = nvrtc_compile_cached(kernel.source, arch);
  Compiled::Loaded loaded;
  KILN_CUDA_CHECK(cudaLibraryLoadData(&loaded.library, cubin.data(), nullptr, nullptr, 0,
                                      nullptr, nullptr, 0));
  KILN_CUDA_CHECK(cudaLibraryGetKernel(&loaded.entry, loaded.library, kernel.entry.c_str()));
  if (!kernel.scalar_entry.empty() && kernel.scalar_source.empty())  // else in its own source
    KILN_CUDA_CHECK(
        cudaLibraryGetKernel(&loaded.scalar_entry, loaded.library, kernel.scalar_entry.c_str()));
  if (!kernel.finish_entry.empty())
    KILN_CUDA_CHECK(
        cudaLibraryGetKernel(&loaded.finish_entry, loaded.library, kernel.finish_entry.c_str()));
  return &entry->loaded.emplace(arch, loaded).first->second;
}

const Compiled::Loaded& load(const GeneratedKernel& kernel) { return *load(kernel, false); }

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
  const bool columns = !kernel.column_outputs.empty();
  if ((kernel.kind == FusedKind::kElementwise && kernel.row_length == 0) ||
      (kernel.rows == 0 && !columns))
    return;
  const auto stream = static_cast<cudaStream_t>(args.stream);
  std::vector<void*> pointers;
  for (const Tensor& t : args.inputs) pointers.push_back(t.raw());
  for (const Tensor& t : args.outputs) pointers.push_back(t.raw());
  // Column outputs are written by the finish kernel, element by element: their alignment does
  // not matter.
  std::vector<bool> checked(pointers.size(), true);
  for (int o : kernel.column_outputs) checked[args.inputs.size() + static_cast<size_t>(o)] = false;
  bool aligned = true;
  for (size_t k = 0; k < pointers.size(); ++k) {
    const auto bytes = static_cast<uintptr_t>(kernel.vector_width) *
                       static_cast<uintptr_t>(kernel.param_element_bytes[k]);
    aligned = aligned && (!checked[k] || reinterpret_cast<uintptr_t>(pointers[k]) % bytes == 0);
  }
  // Unaligned pointers with a separate scalar source: that source's module, compiled now.
  std::optional<GeneratedKernel> scalar;
  if (!aligned && !kernel.scalar_source.empty()) {
    scalar = kernel;
    scalar->source = kernel.scalar_source;
    scalar->entry = kernel.scalar_entry;
    scalar->scalar_entry.clear();
    scalar->scalar_source.clear();
  }
  const Compiled::Loaded& loaded = load(scalar ? *scalar : kernel);
  const bool vector = !scalar && (aligned || loaded.scalar_entry == nullptr);
  // The partial sums: stream-ordered, freed after both kernels (legal in graph capture).
  std::optional<Scratch> partials;
  if (columns) {
    partials.emplace(kernel.partials_bytes, stream);
    pointers.push_back(partials->as<void>());
  }
  std::vector<void*> params;
  for (void*& p : pointers) params.push_back(&p);
  const int64_t blocks = vector ? kernel.blocks : kernel.scalar_blocks;
  // A cudaKernel_t from cudaLibraryGetKernel is launched like a kernel symbol.
  if (kernel.rows > 0) {
    KILN_CUDA_CHECK(cudaLaunchKernel(
        reinterpret_cast<const void*>(vector || scalar ? loaded.entry : loaded.scalar_entry),
        dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(kernel.blocks_y)),
        dim3(static_cast<unsigned>(kernel.threads)), params.data(), 0, stream));
  }
  if (columns) {
    KILN_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(loaded.finish_entry),
                                     dim3(static_cast<unsigned>(kernel.finish_blocks)),
                                     dim3(static_cast<unsigned>(kernel.finish_threads)),
                                     params.data(), 0, stream));
  }
}

// ---- GEMM epilogues --------------------------------------------------------------------------

namespace {

std::atomic<int>& mixed_bias_setting() {  // -1: not read yet
  static std::atomic<int> v{-1};
  return v;
}

}  // namespace

bool mixed_bias_gemm() {
  int v = mixed_bias_setting().load();
  if (v < 0) {
    const char* env = std::getenv("KILN_MIXED_BIAS_GEMM");
    v = env != nullptr && env[0] != '\0' && std::string(env) != "0" ? 1 : 0;
    mixed_bias_setting().store(v);
  }
  return v == 1;
}
void set_mixed_bias_gemm(bool on) { mixed_bias_setting().store(on ? 1 : 0); }

namespace {

struct NoMatch {
  std::string why;
};
[[noreturn]] void no_match(std::string why) { throw NoMatch{std::move(why)}; }

// Who reads each value of a body, and where it is an output.
struct BodyUses {
  explicit BodyUses(const Graph& body) : body(body) {
    for (size_t k = 0; k < body.nodes.size(); ++k)
      for (ValueId id : body.nodes[k].inputs) consumers[id].push_back(static_cast<int>(k));
  }
  int output_index(ValueId id) const {
    for (size_t k = 0; k < body.outputs.size(); ++k)
      if (body.outputs[k] == id) return static_cast<int>(k);
    return -1;
  }
  // The single node reading `id`, -1 when none; no match when several do.
  int sole_consumer(ValueId id) const {
    auto it = consumers.find(id);
    if (it == consumers.end()) return -1;
    if (it->second.size() != 1) no_match("a value is read twice in the epilogue");
    return it->second[0];
  }
  const Graph& body;
  std::map<ValueId, std::vector<int>> consumers;
};

// The body's one matmul as a Gemm (d_type = a_type, no epilogue) over two body inputs.
struct GemmCore {
  int node = -1;
  Gemm gemm;
  int a = -1, b = -1;  // body input indices
  int a_slice = -1;    // the body's slice node A is read through, or -1
};

// The slice node defining `id` when it keeps a prefix of a body input's last axis and all of
// its other axes (x[..., :k], steps 1): a matrix of rows of k read with the input's row stride.
// -1 otherwise.
int prefix_slice(const Graph& body, ValueId id) {
  for (size_t k = 0; k < body.nodes.size(); ++k) {
    const Node& n = body.nodes[k];
    if (n.outputs.empty() || n.outputs[0] != id) continue;
    if (n.op != Op::kSlice || body.input_index(n.inputs[0]) < 0) return -1;
    const Shape& in = body.type(n.inputs[0]).shape;
    const Shape& out = body.type(id).shape;
    const std::vector<int64_t>& steps = n.attrs.ints("steps");
    for (int64_t s : steps)
      if (s != 1) return -1;
    if (in.empty() || out.size() != in.size()) return -1;
    for (size_t d = 0; d + 1 < in.size(); ++d)
      if (out[d] != in[d]) return -1;
    for (int64_t s : n.attrs.ints("starts"))
      if (s != 0) return -1;
    return static_cast<int>(k);
  }
  return -1;
}

GemmCore gemm_core(const Graph& body) {
  GemmCore core;
  for (size_t k = 0; k < body.nodes.size(); ++k) {
    if (body.nodes[k].op != Op::kMatmul) continue;
    if (core.node >= 0) no_match("more than one matmul");
    core.node = static_cast<int>(k);
  }
  if (core.node < 0) no_match("no matmul");
  const Node& matmul = body.nodes[core.node];
  const bool ta = matmul.attrs.b("transpose_a"), tb = matmul.attrs.b("transpose_b");
  core.a = body.input_index(matmul.inputs[0]);
  core.b = body.input_index(matmul.inputs[1]);
  // A read through a prefix slice: the slice costs nothing, cuBLASLt reads A with lda.
  if (core.a < 0 && !ta) core.a_slice = prefix_slice(body, matmul.inputs[0]);
  if (core.a_slice >= 0) {
    const ValueId padded = body.nodes[core.a_slice].inputs[0];
    core.a = body.input_index(padded);
    core.gemm.lda = body.type(padded).shape.back();
  }
  if (core.a < 0 || core.b < 0) no_match("a matmul operand is computed inside the group");
  const TensorType &at = body.type(matmul.inputs[0]), &bt = body.type(matmul.inputs[1]);
  const DType dtype = at.dtype;
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    no_match(fmt::format("dtype {} (f32, bf16, f16 only)", dtype_name(dtype)));
  if (bt.rank() != 2) no_match("b is batched");
  if (ta && at.rank() != 2) no_match("a is batched and transposed");
  Gemm& gemm = core.gemm;
  gemm.transpose_a = ta;
  gemm.transpose_b = tb;
  gemm.k = ta ? at.shape[0] : at.shape.back();
  gemm.m = ta ? at.shape[1] : (gemm.k == 0 ? 0 : numel(at.shape) / gemm.k);
  gemm.n = tb ? bt.shape[0] : bt.shape[1];
  gemm.a_type = gemm.d_type = dtype;
  gemm.tf32 = dtype == DType::kF32 && matmul_allow_tf32();
  if (gemm.k == 0) no_match("k is 0 (an empty product)");
  if (!set_fp8(gemm, matmul.attrs))
    no_match("an fp8 product off the fp8 rules (A read through a slice, or k % 16 != 0)");
  return core;
}

// A cast of the 16-bit product to f32 that the GEMM can absorb (cuBLASLt then writes f32 from
// its f32 accumulator: the product is not rounded to 16 bits first): the index of the cast
// node, or -1.
int absorbed_cast(const Graph& body, const BodyUses& uses, const GemmCore& core) {
  const ValueId mm_out = body.nodes[core.node].outputs[0];
  if (core.gemm.a_type != DType::kBF16 && core.gemm.a_type != DType::kF16) return -1;
  if (uses.output_index(mm_out) >= 0) return -1;
  auto it = uses.consumers.find(mm_out);
  if (it == uses.consumers.end() || it->second.size() != 1) return -1;
  const Node& cast = body.nodes[it->second[0]];
  if (cast.op != Op::kCast || cast.attrs.dtype("dtype") != DType::kF32) return -1;
  return it->second[0];
}

// A body that is one cuBLASLt product with a fused epilogue.
struct GemmBinding {
  Gemm gemm;
  int a = -1, b = -1, bias = -1, aux_in = -1, c = -1;  // body input indices
  int d = -1, aux_out = -1, bias_grad = -1;            // body output indices
};

bool is_rowsum(const Node& n, const Shape& of) {
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
}

GemmBinding match_gemm(const Graph& body) {
  const BodyUses uses(body);
  const GemmCore core = gemm_core(body);
  const int mm = core.node;
  GemmBinding g;
  g.gemm = core.gemm;
  g.a = core.a;
  g.b = core.b;
  Gemm& gemm = g.gemm;
  auto input_of = [&](ValueId id) { return body.input_index(id); };
  const ValueId mm_out = body.nodes[mm].outputs[0];
  const Shape bias_shape{gemm.n};

  size_t used_nodes = core.a_slice >= 0 ? 2 : 1;
  ValueId pre = mm_out;
  DType dt = gemm.d_type;  // of `pre`: the product's dtype, f32 once a cast is absorbed
  int next = uses.sole_consumer(pre);
  Epilogue epilogue = Epilogue::kNone;
  // Adds and one cast: a bias of shape (n,) (the BIAS epilogue) and an addend of the product's
  // shape (C, with beta 1), each at most once, in the dtype of what they add to; and a cast of a
  // bf16/f16 value to f32, absorbed (cuBLASLt writes f32 from its f32 accumulator), before,
  // between or after them. So GPT-2's residual projection under amp, x + f32(matmul(y, W) + b)
  // with a bf16 bias b and an f32 residual x, is one call: D (f32) = A B + bias (bf16, read
  // through CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, or widened to f32 first where cuBLASLt refuses
  // that: see mixed_bias_gemm()) + C. C takes D's dtype, so a 16-bit addend before the cast is
  // not mapped.
  // Numerics: a GEMM group computes its whole epilogue from the f32 accumulator and rounds once
  // per stored output. The 16-bit roundings the body states between the product, its bias and
  // the cast (matmul(y, W) and + b rounded to bf16 each) are skipped, as the generated kernels
  // already skip every intermediate rounding and cuBLASLt's BIAS epilogue adds the bias before
  // rounding: results differ from the reference by those roundings (2^-8 relative for bf16).
  const bool sixteen_bit = gemm.a_type == DType::kBF16 || gemm.a_type == DType::kF16;
  bool cast_seen = false;
  while (next >= 0) {
    const Node& node = body.nodes[next];
    if (node.op == Op::kCast && sixteen_bit && !cast_seen &&
        node.attrs.dtype("dtype") == DType::kF32) {
      if (g.c >= 0)
        no_match(fmt::format("an addend in {} before the cast to f32 (cuBLASLt's C has D's dtype)",
                             dtype_name(dt)));
      cast_seen = true;
      gemm.d_type = dt = DType::kF32;
    } else if (node.op == Op::kAdd) {
      if (node.inputs[0] == node.inputs[1]) no_match("the product is added to itself");
      const ValueId other = node.inputs[0] == pre ? node.inputs[1] : node.inputs[0];
      const int in = input_of(other);
      const TensorType& ot = body.type(other);
      if (in >= 0 && ot.dtype == dt && ot.shape == body.type(pre).shape && g.c < 0 &&
          body.type(node.outputs[0]).shape == ot.shape) {
        g.c = in;
      } else if (in >= 0 && ot.dtype == dt && ot.shape == bias_shape && g.bias < 0) {
        g.bias = in;
        gemm.bias_type = dt;
        epilogue = Epilogue::kBias;
      } else {
        no_match(fmt::format("the add after the matmul is neither a bias of shape ({},) nor an "
                             "addend of the product's shape {} in {} (each at most once): it "
                             "adds {}",
                             gemm.n, to_string(body.type(pre).shape), dtype_name(dt),
                             to_string(ot)));
      }
    } else {
      break;
    }
    pre = node.outputs[0];
    ++used_nodes;
    next = uses.sole_consumer(pre);
  }
  // A bias in D's dtype needs no bias_type (the description stays the one it always was).
  if (gemm.bias_type == gemm.d_type) gemm.bias_type.reset();
  if (gemm.bias_type && !mixed_bias_gemm())
    no_match(fmt::format("a {} bias on a product cast to f32 (cuBLASLt refused it on the H100; "
                         "KILN_MIXED_BIAS_GEMM=1 binds it with the bias widened first)",
                         dtype_name(*gemm.bias_type)));
  auto output_index = [&](ValueId id) { return uses.output_index(id); };
  if (next >= 0 && body.nodes[next].op == Op::kGelu) {
    if (body.nodes[next].attrs.s("approximate") != "tanh")
      no_match("gelu is the erf form; only the tanh form maps onto cuBLASLt's GELU epilogues");
    if (g.c >= 0) no_match("an addend before gelu (not mapped onto cuBLASLt's GELU epilogues)");
    const ValueId y = body.nodes[next].outputs[0];
    g.d = output_index(y);
    g.aux_out = output_index(pre);
    if (g.d < 0) no_match("the gelu's result is not an output");
    const bool bias = epilogue == Epilogue::kBias;
    epilogue = g.aux_out >= 0 ? (bias ? Epilogue::kGeluAuxBias : Epilogue::kGeluAux)
                              : (bias ? Epilogue::kGeluBias : Epilogue::kGelu);
    ++used_nodes;
  } else if (next >= 0 && body.nodes[next].op == Op::kGeluGrad && epilogue == Epilogue::kNone &&
             g.c < 0) {
    const Node& gg = body.nodes[next];
    if (gg.attrs.s("approximate") != "tanh")
      no_match("gelu_grad is the erf form; only the tanh form maps onto DGELU");
    if (gg.inputs[1] != pre) no_match("the matmul is gelu_grad's x, not its dy");
    g.aux_in = input_of(gg.inputs[0]);
    if (g.aux_in < 0) no_match("gelu_grad's x is computed inside the group");
    if (body.type(gg.inputs[0]).dtype != dt)
      no_match("gelu_grad's x is not in the product's dtype");
    const ValueId dx = gg.outputs[0];
    g.d = output_index(dx);
    if (g.d < 0) no_match("gelu_grad's result is not an output");
    epilogue = Epilogue::kDGelu;
    ++used_nodes;
    if (auto it = uses.consumers.find(dx); it != uses.consumers.end()) {
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
  // A bias gradient of an operand: sum over rows of B (stored (k, n)) or of A (stored (k, m)),
  // in the product's dtype.
  if (epilogue == Epilogue::kNone && g.c < 0) {
    for (size_t k = 0; k < body.nodes.size(); ++k) {
      const Node& n = body.nodes[k];
      if (static_cast<int>(k) == mm || n.op != Op::kSum) continue;
      const int which = input_of(n.inputs[0]);
      const int out = output_index(n.outputs[0]);
      if (out < 0 || !is_rowsum(n, body.type(n.inputs[0]).shape) ||
          body.type(n.inputs[0]).rank() != 2 || body.type(n.outputs[0]).dtype != dt)
        no_match("a sum that is not a bias gradient of a matmul operand");
      if (which == g.b && !gemm.transpose_b) {
        epilogue = Epilogue::kBGradB;
      } else if (which == g.a && gemm.transpose_a) {
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
  // Kept to what the GPU tests cover with a 16-bit product written as f32 (the rest runs as a
  // product + generated epilogue): no epilogue, or a bias in f32 or in the product's 16 bits.
  if (gemm.d_type != gemm.a_type && epilogue != Epilogue::kNone && epilogue != Epilogue::kBias)
    no_match(fmt::format("epilogue {} on a product cast to f32 is not mapped (none and bias are)",
                         epilogue_name(epilogue)));
  if (gemm.fp8() && epilogue != Epilogue::kNone && epilogue != Epilogue::kBias)
    no_match(fmt::format("epilogue {} on an fp8 product (none and bias are mapped)", epilogue_name(epilogue)));
  gemm.epilogue = epilogue;
  return g;
}

// A body that is a cuBLASLt product (no epilogue, or with a cast to f32 absorbed) followed by a
// generated kernel over it: the rest of the body, with the product as one more input.
struct SplitGemm {
  GemmCore core;
  ValueId product = -1;      // the value the GEMM writes
  int product_output = -1;   // the body output it is written to; -1: a scratch buffer
  std::shared_ptr<Graph> epilogue;
  FusedKind kind = FusedKind::kElementwise;  // of the epilogue kernel: elementwise or rows
  std::vector<int> outputs;  // per epilogue output: the body output it is
};

SplitGemm split_gemm(const Graph& body) {
  const BodyUses uses(body);
  SplitGemm s;
  s.core = gemm_core(body);
  std::set<int> removed{s.core.node};
  if (s.core.a_slice >= 0) removed.insert(s.core.a_slice);
  s.product = body.nodes[s.core.node].outputs[0];
  // The cast to f32 is absorbed only where its f32 value is a stored output anyway. A product
  // that goes to scratch for the generated kernel stays in the body's 16 bits: half the bytes
  // written and read back (GPT-2's LayerNorm-gradient groups: 100 MB less per layer at B=32),
  // and the reference's rounding exactly.
  if (const int cast = absorbed_cast(body, uses, s.core);
      cast >= 0 && uses.output_index(body.nodes[cast].outputs[0]) >= 0) {
    s.core.gemm.d_type = DType::kF32;
    s.product = body.nodes[cast].outputs[0];
    removed.insert(cast);
  }
  s.product_output = uses.output_index(s.product);
  auto e = std::make_shared<Graph>();
  e->name = body.name + "_epilogue";
  e->values = body.values;
  e->inputs = body.inputs;
  e->inputs.push_back(GraphInput{s.product, Role::kData});
  for (size_t k = 0; k < body.nodes.size(); ++k)
    if (!removed.count(static_cast<int>(k))) e->nodes.push_back(body.nodes[k]);
  for (size_t k = 0; k < body.outputs.size(); ++k) {
    if (static_cast<int>(k) == s.product_output) continue;
    e->outputs.push_back(body.outputs[k]);
    s.outputs.push_back(static_cast<int>(k));
  }
  if (e->outputs.empty()) no_match("nothing but the product is computed");
  std::string why_elementwise, why_rows;
  if (can_generate(*e, FusedKind::kElementwise, &why_elementwise)) {
    s.kind = FusedKind::kElementwise;
  } else if (can_generate(*e, FusedKind::kRows, &why_rows)) {
    s.kind = FusedKind::kRows;
  } else {
    no_match(fmt::format("the epilogue after the product cannot be generated: {}",
                         why_elementwise));
  }
  s.epilogue = std::move(e);
  return s;
}

template <class T, class F>
std::optional<T> try_match(F&& match, const Graph& body, std::string* why) {
  try {
    return match(body);
  } catch (const NoMatch& m) {
    if (why) *why = m.why;
  } catch (const Error& e) {
    if (why) *why = e.what();
  }
  return std::nullopt;
}

std::optional<GemmBinding> try_binding(const Graph& body, std::string* why) {
  return try_match<GemmBinding>(match_gemm, body, why);
}
std::optional<SplitGemm> try_split(const Graph& body, std::string* why) {
  return try_match<SplitGemm>(split_gemm, body, why);
}

void run_binding(const GemmBinding& g, const KernelArgs& args) {
  GemmOperands ops;
  ops.a = args.inputs[g.a].raw();
  ops.b = args.inputs[g.b].raw();
  ops.d = args.outputs[g.d].raw();
  if (g.bias >= 0) ops.bias = args.inputs[g.bias].raw();
  if (g.c >= 0) {
    ops.c = args.inputs[g.c].raw();
    ops.beta = 1.0;
  }
  if (g.aux_in >= 0) ops.aux = args.inputs[g.aux_in].raw();
  if (g.aux_out >= 0) ops.aux = args.outputs[g.aux_out].raw();
  if (g.bias_grad >= 0) ops.bias_grad = args.outputs[g.bias_grad].raw();
  if (g.gemm.m == 0 || g.gemm.n == 0) return;
  g.gemm.run(ops, static_cast<cudaStream_t>(args.stream));
}

void run_split(const SplitGemm& s, const KernelArgs& args) {
  const auto stream = static_cast<cudaStream_t>(args.stream);
  const TensorType& type = s.epilogue->type(s.product);
  Tensor product;
  if (s.product_output >= 0) {
    product = args.outputs[s.product_output];
  } else {
    void* base = nullptr;
    KILN_CUDA_CHECK(cudaMallocAsync(&base, std::max<size_t>(type.bytes(), 16), stream));
    // Freed on the stream after the epilogue kernel, when the last copy of `product` goes.
    std::shared_ptr<std::byte[]> storage(static_cast<std::byte*>(base),
                                         [stream](std::byte* p) { cudaFreeAsync(p, stream); });
    product = Tensor(type, storage, 0, Device::kCuda);
  }
  GemmOperands ops;
  ops.a = args.inputs[s.core.a].raw();
  ops.b = args.inputs[s.core.b].raw();
  ops.d = product.raw();
  if (s.core.gemm.m > 0 && s.core.gemm.n > 0) s.core.gemm.run(ops, stream);
  std::vector<Tensor> inputs(args.inputs.begin(), args.inputs.end());
  inputs.push_back(product);
  std::vector<Tensor> outputs;
  for (int o : s.outputs) outputs.push_back(args.outputs[o]);
  launch_generated(generate_kernel(*s.epilogue, s.kind),
                   KernelArgs{args.attrs, inputs, outputs, args.stream, s.epilogue.get()});
}

void run_gemm_epilogue(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "nvrtc: a gemm-epilogue fused node without its body");
  std::string why_binding, why_split;
  if (std::optional<GemmBinding> g = try_binding(*args.body, &why_binding)) {
    run_binding(*g, args);
    return;
  }
  std::optional<SplitGemm> s = try_split(*args.body, &why_split);
  KILN_CHECK(s.has_value(), "nvrtc: the gemm-epilogue body is not supported: {}; {}", why_binding,
             why_split);
  run_split(*s, args);
}

// KernelImpl::prepare: compile (and load) the node's generated kernel ahead of its first run;
// a cuBLASLt binding has nothing to compile. The cache makes the first run's load() a lookup.
void prepare_fused(const Node& node) {
  if (!node.body) return;
  const FusedKind kind = fused_kind(node);
  if (kind != FusedKind::kGemmEpilogue) {
    load(generate_kernel(*node.body, kind), /*ahead=*/true);
    return;
  }
  if (try_binding(*node.body, nullptr)) return;
  if (std::optional<SplitGemm> s = try_split(*node.body, nullptr))
    load(generate_kernel(*s->epilogue, s->kind), /*ahead=*/true);
}

}  // namespace

bool gemm_epilogue_supported(const Graph& body, std::string* why) {
  return try_binding(body, why).has_value();
}

bool gemm_split_supported(const Graph& body, std::string* why) {
  return try_split(body, why).has_value();
}

std::string describe_gemm_epilogue(const Graph& body) {
  std::string why;
  std::optional<GemmBinding> g = try_binding(body, &why);
  KILN_CHECK(g.has_value(), "nvrtc: the gemm-epilogue body is not supported: {}", why);
  return g->gemm.to_string() + (g->c >= 0 ? " + c (beta 1)" : "");
}

bool nvrtc_supports(const Graph& body, FusedKind kind, std::string* why) {
  if (kind != FusedKind::kGemmEpilogue) return can_generate(body, kind, why);
  std::string why_binding, why_split;
  if (gemm_epilogue_supported(body, &why_binding) || gemm_split_supported(body, &why_split))
    return true;
  if (why)
    *why = fmt::format("no cuBLASLt epilogue: {}; no product + generated epilogue: {}",
                       why_binding, why_split);
  return false;
}

namespace {

// The listing of a fused node without its value names (see fused_kernel_listing).
std::string fused_kernel_text(const Graph& body, FusedKind kind) {
  std::string ops;
  for (const Node& node : body.nodes)
    ops += (ops.empty() ? "" : ", ") + std::string(op_info(node.op).name);
  std::string why;
  if (!is_fusion_group(kind))
    return fmt::format("// kiln fused node ({}): ops {}\n// not a kind the nvrtc dialect runs: a "
                       "dialect of its own runs it\n",
                       fused_kind_name(kind), ops);
  if (kind == FusedKind::kGemmEpilogue) {
    if (gemm_epilogue_supported(body))
      return fmt::format("// kiln fused node (gemm-epilogue): ops {}\n// runs as one cuBLASLt "
                         "product with a fused epilogue, no generated source:\n//   {}\n",
                         ops, describe_gemm_epilogue(body));
    if (std::optional<SplitGemm> s = try_split(body, nullptr))
      return fmt::format(
          "// kiln fused node (gemm-epilogue): ops {}\n// runs as a cuBLASLt product into {}:\n"
          "//   {}\n// then the generated epilogue kernel below, which reads the product as its "
          "last input:\n{}",
          ops,
          s->product_output >= 0 ? fmt::format("output {}", s->product_output)
                                 : std::string("a scratch buffer"),
          s->core.gemm.to_string(), generate_kernel(*s->epilogue, s->kind).source);
    (void)nvrtc_supports(body, kind, &why);
  } else if (can_generate(body, kind, &why)) {
    return generate_kernel(body, kind).source;
  }
  return fmt::format("// kiln fused node ({}): ops {}\n// not generated by the nvrtc dialect: {}\n"
                     "// (it runs on a lower-priority dialect)\n",
                     fused_kind_name(kind), ops, why);
}

}  // namespace

std::string fused_kernel_listing(const Graph& body, FusedKind kind) {
  // The body's value names, for the reader: the generated source itself carries types only.
  std::string names = "// values:";
  for (size_t k = 0; k < body.inputs.size(); ++k)
    names += fmt::format(" in{} %{}", k, body.value(body.inputs[k].value).name);
  for (size_t k = 0; k < body.outputs.size(); ++k)
    names += fmt::format(" out{} %{}", k, body.value(body.outputs[k]).name);
  return names + "\n" + fused_kernel_text(body, kind);
}


// ---- registration ----------------------------------------------------------------------------

void register_nvrtc_kernels(KernelRegistry& registry) {
  registry.add(
      Op::kFused,
      KernelImpl{"nvrtc", Device::kCuda, kGeneratedPriority,
                 [](const NodeView& view) {
                   const Node& node = view.node;
                   if (!node.body) return false;
                   return nvrtc_supports(*node.body, fused_kind(node));
                 },
                 [](const KernelArgs& args) {
                   KILN_CHECK(args.body != nullptr, "nvrtc: a fused node without its body");
                   const FusedKind kind = fused_kind(args.attrs);
                   if (kind == FusedKind::kGemmEpilogue) {
                     run_gemm_epilogue(args);
                     return;
                   }
                   launch_generated(generate_kernel(*args.body, kind), args);
                 },
                 /*in_place_ok=*/false,
                 [](const NodeView& view) { prepare_fused(view.node); }});
}

}  // namespace kiln::cuda
