#include "distributed/comm_profile.h"

#include <chrono>
#include <sstream>

#include "support/compile_cache.h"
#include "support/error.h"

namespace kiln {
namespace {

constexpr const char* kStoreKey = "kiln/comm_profile";
constexpr int kWarmup = 2, kReps = 5;

// Seconds per call of `run` on every rank at once (the barrier lines the ranks up first).
template <typename Fn>
double time_calls(ProcessGroup& group, const DeviceStream& stream, Fn&& run) {
  for (int i = 0; i < kWarmup; ++i) run();
  stream.synchronize();
  group.barrier();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kReps; ++i) run();
  stream.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kReps;
}

// (bytes, seconds) per size, for one kind. Bytes: the larger of input and output, as
// collective_bytes counts them.
std::vector<std::pair<double, double>> sweep(ProcessGroup& group, const DeviceRuntime& runtime, Op kind,
                                             const std::vector<int64_t>& sizes) {
  const Communicator& comm = *group.communicator();
  const int64_t world = group.world_size();
  const std::unique_ptr<DeviceStream> stream = runtime.create_stream();
  std::vector<std::pair<double, double>> samples;
  for (int64_t bytes : sizes) {
    const int64_t full = bytes / 4 / world * world;  // f32 elements, divisible by the group
    const Tensor big = runtime.device_tensor(TensorType{DType::kF32, {full}});
    const Tensor small = runtime.device_tensor(TensorType{DType::kF32, {full / world}});
    double s = 0;
    switch (kind) {
      case Op::kAllGather:
        s = time_calls(group, *stream, [&] { comm.all_gather(small, big, stream->handle()); });
        break;
      case Op::kReduceScatter:
        s = time_calls(group, *stream, [&] { comm.reduce_scatter(big, small, ReduceOp::kSum, stream->handle()); });
        break;
      default:
        s = time_calls(group, *stream, [&] { comm.all_reduce(big, big, ReduceOp::kSum, stream->handle()); });
        break;
    }
    samples.push_back({static_cast<double>(full * 4), s});
  }
  return samples;
}

std::string format_fits(const CostModel& m) {
  return fmt::format("{:.17g} {:.17g} {:.17g} {:.17g} {:.17g} {:.17g}", m.all_gather.latency_s, m.all_gather.bytes_per_s,
                     m.reduce_scatter.latency_s, m.reduce_scatter.bytes_per_s, m.all_reduce.latency_s,
                     m.all_reduce.bytes_per_s);
}

bool parse_fits(const std::string& text, CostModel& m) {
  std::istringstream in(text);
  CostModel parsed = m;
  in >> parsed.all_gather.latency_s >> parsed.all_gather.bytes_per_s >> parsed.reduce_scatter.latency_s >>
      parsed.reduce_scatter.bytes_per_s >> parsed.all_reduce.latency_s >> parsed.all_reduce.bytes_per_s;
  if (!in || parsed.all_gather.bytes_per_s <= 0 || parsed.reduce_scatter.bytes_per_s <= 0 ||
      parsed.all_reduce.bytes_per_s <= 0)
    return false;
  m = parsed;
  return true;
}

}  // namespace

CollectiveFit fit_collective(const std::vector<std::pair<double, double>>& samples) {
  KILN_CHECK(samples.size() >= 2, "fitting a collective's time needs two sizes or more, got {}", samples.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = static_cast<double>(samples.size());
  for (const auto& [x, y] : samples) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double denom = n * sxx - sx * sx;
  KILN_CHECK(denom > 0, "fitting a collective's time needs two different sizes");
  double slope = (n * sxy - sx * sy) / denom;
  double intercept = (sy - slope * sx) / n;
  if (intercept < 0) {  // noise: refit through the origin
    intercept = 0;
    slope = sxy / sxx;
  }
  KILN_CHECK(slope > 0, "collective times do not grow with size ({} samples): cannot fit a bandwidth", samples.size());
  return CollectiveFit{intercept, 1.0 / slope};
}

CostModel comm_cost_model(ProcessGroup& group, const DeviceRuntime& runtime) {
  CostModel m = CostModel::defaults(runtime.device());
  const Communicator& comm = *group.communicator();
  CompileCache& cache = CompileCache::global("comm");
  const std::string key =
      fmt::format("comm-profile v1 {} {} world {}", runtime.name(), comm.engine(), group.world_size());
  std::string decision;
  if (group.rank() == 0) {
    const std::optional<std::string> cached = cache.load(key);
    decision = cached && parse_fits(*cached, m) ? "fit " + *cached : "sweep";
    group.store().set(kStoreKey, decision);
  } else {
    decision = group.store().get(kStoreKey);
  }
  if (decision.rfind("fit ", 0) == 0) {
    KILN_CHECK(parse_fits(decision.substr(4), m), "internal: rank 0's collective fits '{}' do not parse", decision);
    m.source = fmt::format("{} measured on {} ranks, cached", comm.engine(), group.world_size());
    return m;
  }
  // The sweep: sizes a step's collectives span (a CPU's Gloo sweep stays small and quick).
  const std::vector<int64_t> sizes = runtime.device() == Device::kCuda
                                         ? std::vector<int64_t>{int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 24,
                                                                int64_t{1} << 26}
                                         : std::vector<int64_t>{int64_t{1} << 12, int64_t{1} << 16, int64_t{1} << 20};
  // Every rank takes part in the sweep; rank 0's times are the ones fitted. A kind whose times
  // do not fit (a busy machine: a larger size ran faster) keeps its default.
  CostModel measured = m;
  std::vector<std::string> kept_defaults;
  for (auto [kind, fit] : {std::pair{Op::kAllGather, &measured.all_gather},
                           std::pair{Op::kReduceScatter, &measured.reduce_scatter},
                           std::pair{Op::kAllReduce, &measured.all_reduce}}) {
    const std::vector<std::pair<double, double>> samples = sweep(group, runtime, kind, sizes);
    if (group.rank() != 0) continue;
    try {
      *fit = fit_collective(samples);
    } catch (const Error&) {
      kept_defaults.emplace_back(op_name(kind));
    }
  }
  const std::string fit_key = std::string(kStoreKey) + "/fit";
  if (group.rank() == 0) {
    // Every rank (this one too) plans with the numbers as the text carries them: bit for bit
    // the same everywhere.
    const std::string text = format_fits(measured);
    cache.store(key, text);
    group.store().set(fit_key, text);
    KILN_CHECK(parse_fits(text, m), "internal: collective fits '{}' do not parse", text);
  } else {
    KILN_CHECK(parse_fits(group.store().get(fit_key), m), "internal: rank 0's collective fits do not parse");
  }
  m.source = fmt::format("{} measured on {} ranks", comm.engine(), group.world_size());
  if (!kept_defaults.empty()) m.source += fmt::format(" (defaults for {}: times did not fit)", fmt::join(kept_defaults, ", "));
  return m;
}

}  // namespace kiln
