// Host tensors: a TensorType plus shared storage. Kernels read and write them; the executor
// owns their memory. Copying a Tensor shares the storage (use clone() for a deep copy).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "ir/shape.h"
#include "support/error.h"

namespace kiln {

// Where a tensor's bytes live. CUDA tensors hold a device pointer: kernels get it through raw()
// or data<T>(); host-only accessors (get, set, to_f64, clone) refuse them.
enum class Device : uint8_t { kCpu, kCuda };
std::string_view device_name(Device device);

class Tensor {
 public:
  Tensor() = default;
  // Allocates zero-filled, 64-byte-aligned storage.
  explicit Tensor(TensorType type);
  // A view of `storage` at byte `offset` (e.g. a slot of the executor's arena). For kCuda,
  // `storage` holds device memory (its deleter frees it on the device).
  Tensor(TensorType type, std::shared_ptr<std::byte[]> storage, size_t offset,
         Device device = Device::kCpu);

  const TensorType& type() const { return type_; }
  DType dtype() const { return type_.dtype; }
  const Shape& shape() const { return type_.shape; }
  int rank() const { return type_.rank(); }
  int64_t numel() const { return type_.numel(); }
  size_t bytes() const { return type_.bytes(); }
  bool defined() const { return storage_ != nullptr; }
  Device device() const { return device_; }

  std::byte* raw() const { return storage_.get() + offset_; }
  // Typed pointer; throws kiln::Error if T is not the storage type of dtype().
  template <typename T>
  T* data() const {
    check_storage_type(sizeof(T), visit_dtype(type_.dtype, [](auto v) {
      return std::is_same_v<decltype(v), T>;
    }));
    return reinterpret_cast<T*>(raw());
  }

  // Element access through double, for any dtype (the reference kernels' path for floats).
  // A double does not hold every int64 (2^53 + 1 is not one): integer values go through the
  // exact accessors below.
  double get(int64_t index) const;
  void set(int64_t index, double value);
  std::vector<double> to_f64() const;
  static Tensor from_f64(TensorType type, std::span<const double> values);

  // Exact element access for integer and bool dtypes (an int64 holds every value of i32, i64,
  // u8 and bool). get_int refuses float dtypes (kiln::Error: no silent truncation). set_int
  // stores into integer dtypes modulo 2^bits (wrapping like the hardware), into bool as
  // value != 0, into float dtypes rounded to nearest.
  int64_t get_int(int64_t index) const;
  void set_int(int64_t index, int64_t value);
  std::vector<int64_t> to_i64() const;
  static Tensor from_i64(TensorType type, std::span<const int64_t> values);
  // Copies element `from` of `src`, which has this tensor's dtype, to element `index`: the
  // exact copy of data-movement kernels (gather, slice, concat, transpose), whatever the dtype.
  void copy_element(int64_t index, const Tensor& src, int64_t from);

  Tensor clone() const;
  // Same storage, another shape with the same element count (and dtype).
  Tensor reshaped(Shape shape) const;
  // Same storage and device, `byte_offset` bytes further in, seen as `type` (a slice of rows:
  // the memory plan's slice views). Throws kiln::Error unless those bytes lie inside this
  // tensor's.
  Tensor viewed(TensorType type, size_t byte_offset) const;

 private:
  void check_storage_type(size_t size, bool matches) const;
  void check_host() const;

  TensorType type_;
  std::shared_ptr<std::byte[]> storage_;
  size_t offset_ = 0;
  Device device_ = Device::kCpu;
};

// Uniform random values in [low, high) for float dtypes; integers in [low, high) (truncated);
// bools half true. Deterministic in `seed`.
Tensor random_tensor(const TensorType& type, uint64_t seed, double low = -1.0, double high = 1.0);
// Largest |a - b| / (atol + rtol * |b|) over all elements: <= 1 means "close".
double max_scaled_error(const Tensor& a, const Tensor& b, double atol, double rtol);
// One-line summary: type, min, max, mean, first values.
std::string summarize(const Tensor& t);

}  // namespace kiln
