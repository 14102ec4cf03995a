#include "tensor/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "support/parallel.h"
#include "tensor/host_memory.h"

namespace kiln {

std::shared_ptr<std::byte[]> allocate_host(size_t bytes, bool zero) {
  size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  constexpr size_t kHugePage = size_t{2} << 20;
  const bool large = rounded >= 8 * kHugePage;
  const size_t alignment = large ? kHugePage : 64;
  if (large) rounded = (rounded + kHugePage - 1) / kHugePage * kHugePage;
  std::byte* p = static_cast<std::byte*>(std::aligned_alloc(alignment, rounded));
  if (!p) fail("out of host memory allocating {} bytes", rounded);
  // No madvise(MADV_HUGEPAGE): on a 2-core VM (THP "madvise") it made drawing llama-8b's
  // shards into fresh memory spend more system time (6.9 ns a value against 2.7), not less.
  // Large blocks are zeroed by all threads: the first touch of fresh pages is most of the cost
  // (llama-1b's 4.4 GB of params spent ~4 s of a GPU machine's setup here on one thread).
  if (zero && large)
    parallel_for(0, static_cast<int64_t>(rounded / kHugePage), 4, [&](int64_t b, int64_t e) {
      std::memset(p + static_cast<size_t>(b) * kHugePage, 0, static_cast<size_t>(e - b) * kHugePage);
    });
  else if (zero)
    std::memset(p, 0, rounded);
  return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { std::free(q); });
}

Tensor::Tensor(TensorType type) : type_(std::move(type)) {
  try {
    storage_ = allocate_host(type_.bytes());
  } catch (const Error& e) {
    fail("{} for {}", e.what(), to_string(type_));
  }
}

Tensor::Tensor(TensorType type, std::shared_ptr<std::byte[]> storage, size_t offset,
               Device device)
    : type_(std::move(type)), storage_(std::move(storage)), offset_(offset), device_(device) {}

std::string_view device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

void Tensor::check_host() const {
  KILN_CHECK(device_ == Device::kCpu, "tensor of {} is on {}: copy it to the host first",
             to_string(type_), device_name(device_));
}

void Tensor::check_storage_type(size_t size, bool matches) const {
  KILN_CHECK(matches && size == dtype_size(type_.dtype),
             "tensor of {} accessed with an element type of {} bytes", to_string(type_), size);
}

double Tensor::get(int64_t index) const {
  if (device_ != Device::kCpu) check_host();
  return visit_dtype(type_.dtype, [&](auto tag) {
    using T = decltype(tag);
    return to_double(reinterpret_cast<const T*>(raw())[index]);
  });
}

void Tensor::set(int64_t index, double value) {
  if (device_ != Device::kCpu) check_host();
  visit_dtype(type_.dtype, [&](auto tag) {
    using T = decltype(tag);
    reinterpret_cast<T*>(raw())[index] = from_double<T>(value);
  });
}

std::vector<double> Tensor::to_f64() const {
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
  return out;
}

Tensor Tensor::from_f64(TensorType type, std::span<const double> values) {
  Tensor t(std::move(type));
  KILN_CHECK(static_cast<int64_t>(values.size()) == t.numel(),
             "{} values given for a tensor of {}", values.size(), to_string(t.type()));
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, values[i]);
  return t;
}

int64_t Tensor::get_int(int64_t index) const {
  if (device_ != Device::kCpu) check_host();
  return visit_dtype(type_.dtype, [&](auto tag) -> int64_t {
    using T = decltype(tag);
    if constexpr (std::is_integral_v<T>) {
      return static_cast<int64_t>(reinterpret_cast<const T*>(raw())[index]);
    } else {
      fail("tensor of {} read as integers: its elements are floats (read them with get)",
           to_string(type_));
    }
  });
}

void Tensor::set_int(int64_t index, int64_t value) {
  if (device_ != Device::kCpu) check_host();
  visit_dtype(type_.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* data = reinterpret_cast<T*>(raw());
    if constexpr (std::is_same_v<T, bool>) {
      data[index] = value != 0;
    } else if constexpr (std::is_integral_v<T>) {
      data[index] = static_cast<T>(value);  // modulo 2^bits (C++20)
    } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      data[index] = static_cast<T>(value);  // one rounding, not two through double
    } else {
      data[index] = from_double<T>(static_cast<double>(static_cast<float>(value)));
    }
  });
}

std::vector<int64_t> Tensor::to_i64() const {
  std::vector<int64_t> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = get_int(i);
  return out;
}

Tensor Tensor::from_i64(TensorType type, std::span<const int64_t> values) {
  Tensor t(std::move(type));
  KILN_CHECK(static_cast<int64_t>(values.size()) == t.numel(),
             "{} values given for a tensor of {}", values.size(), to_string(t.type()));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_int(i, values[i]);
  return t;
}

void Tensor::copy_element(int64_t index, const Tensor& src, int64_t from) {
  if (device_ != Device::kCpu) check_host();
  if (src.device_ != Device::kCpu) src.check_host();
  KILN_CHECK(src.dtype() == dtype(), "copying an element of {} into a tensor of {}",
             to_string(src.type()), to_string(type_));
  const size_t size = dtype_size(type_.dtype);
  std::memcpy(raw() + static_cast<size_t>(index) * size,
              src.raw() + static_cast<size_t>(from) * size, size);
}

Tensor Tensor::clone() const {
  check_host();
  Tensor t(type_);
  std::memcpy(t.raw(), raw(), bytes());
  return t;
}

Tensor Tensor::reshaped(Shape shape) const {
  KILN_CHECK(kiln::numel(shape) == numel(), "cannot view {} as shape {}", to_string(type_),
             to_string(shape));
  return Tensor(TensorType{type_.dtype, std::move(shape)}, storage_, offset_, device_);
}

Tensor Tensor::viewed(TensorType type, size_t byte_offset) const {
  KILN_CHECK(defined(), "cannot view an undefined tensor as {}", to_string(type));
  KILN_CHECK(byte_offset <= bytes() && type.bytes() <= bytes() - byte_offset,
             "cannot view {} bytes in as {} ({} bytes): past the end of {} ({} bytes)", byte_offset,
             to_string(type), type.bytes(), to_string(type_), bytes());
  return Tensor(std::move(type), storage_, offset_ + byte_offset, device_);
}

Tensor random_tensor(const TensorType& type, uint64_t seed, double low, double high) {
  Tensor t(type);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(low, high);
  for (int64_t i = 0; i < t.numel(); ++i) {
    double u = uniform(rng);
    if (type.dtype == DType::kBool) u = (rng() & 1) ? 1.0 : 0.0;
    else if (is_integer(type.dtype)) u = std::floor(u);
    t.set(i, u);
  }
  return t;
}

double max_scaled_error(const Tensor& a, const Tensor& b, double atol, double rtol) {
  KILN_CHECK(a.shape() == b.shape(), "comparing tensors of shapes {} and {}",
             to_string(a.shape()), to_string(b.shape()));
  if (!is_float(a.dtype()) && !is_float(b.dtype())) {  // integers and bools: exact or nothing
    for (int64_t i = 0; i < a.numel(); ++i)
      if (a.get_int(i) != b.get_int(i)) return INFINITY;
    return 0.0;
  }
  double worst = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = a.get(i), y = b.get(i);
    if (std::isnan(x) || std::isnan(y)) {
      if (std::isnan(x) != std::isnan(y)) return INFINITY;
      continue;
    }
    if (x == y) continue;  // equal infinities too
    worst = std::max(worst, std::abs(x - y) / (atol + rtol * std::abs(y)));
  }
  return worst;
}

std::string summarize(const Tensor& t) {
  std::vector<double> v = t.to_f64();
  double lo = INFINITY, hi = -INFINITY, sum = 0.0;
  for (double x : v) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    sum += x;
  }
  std::string head;
  for (size_t i = 0; i < std::min<size_t>(v.size(), 6); ++i)
    head += fmt::format("{}{:.6g}", i ? ", " : "", v[i]);
  if (v.size() > 6) head += ", ...";
  if (v.empty()) return fmt::format("{} (empty)", to_string(t.type()));
  return fmt::format("{}  min {:.6g}  max {:.6g}  mean {:.6g}  [{}]", to_string(t.type()), lo, hi,
                     sum / static_cast<double>(v.size()), head);
}

}  // namespace kiln
