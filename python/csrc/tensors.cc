#include "tensors.h"

#include <memory>
#include <vector>

#include "support/error.h"

namespace nb = nanobind;

namespace kiln::python {
namespace {

using nb::dlpack::dtype_code;

constexpr int kDlpackCpu = 1, kDlpackCuda = 2;

nb::dlpack::dtype dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return {uint8_t(dtype_code::Float), 32, 1};
    case DType::kF64: return {uint8_t(dtype_code::Float), 64, 1};
    case DType::kF16: return {uint8_t(dtype_code::Float), 16, 1};
    case DType::kBF16: return {uint8_t(dtype_code::Bfloat), 16, 1};
    case DType::kI32: return {uint8_t(dtype_code::Int), 32, 1};
    case DType::kI64: return {uint8_t(dtype_code::Int), 64, 1};
    case DType::kBool: return {uint8_t(dtype_code::Bool), 8, 1};
    case DType::kU8: return {uint8_t(dtype_code::UInt), 8, 1};
  }
  fail("a kiln tensor of an unknown dtype");
}

std::string describe(nb::dlpack::dtype d) {
  static const char* const codes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  const char* code = d.code < 7 ? codes[d.code] : "dlpack code ";
  return d.code < 7 ? fmt::format("{}{}{}", code, d.bits, d.lanes != 1 ? fmt::format("x{}", d.lanes) : "")
                    : fmt::format("{}{} ({} bits)", code, d.code, d.bits);
}

}  // namespace

Tensor from_array(const Array& array, const std::string& what) {
  const nb::dlpack::dtype given = array.dtype();
  DType dtype = DType::kF32;
  bool known = false;
  for (DType d : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16, DType::kI32, DType::kI64, DType::kBool,
                  DType::kU8})
    if (dlpack_dtype(d) == given) dtype = d, known = true;
  KILN_CHECK(known, "{} is of dtype {}, which kiln has not (f32 f64 f16 bf16 i32 i64 bool u8)", what, describe(given));
  Shape shape;
  for (size_t i = 0; i < array.ndim(); ++i) shape.push_back(static_cast<int64_t>(array.shape(i)));
  const TensorType type{dtype, shape};
  // Row-major contiguous: each stride (in elements) the product of the sizes after it; a dim of
  // size 1 may have any stride (torch gives such dims arbitrary ones).
  int64_t expected = 1;
  for (size_t k = array.ndim(); k-- > 0;) {
    const int64_t size = static_cast<int64_t>(array.shape(k));
    KILN_CHECK(size == 1 || array.stride(k) == expected,
               "{} ({}) is not contiguous (strides {} in elements): kiln reads a tensor in place and never copies "
               "it; pass a contiguous one (tensor.contiguous(), numpy.ascontiguousarray)",
               what, to_string(type), fmt::join(std::vector<int64_t>(array.stride_ptr(), array.stride_ptr() + array.ndim()), ", "));
    expected *= size;
  }
  Device device = Device::kCpu;
  if (array.device_type() == kDlpackCuda) {
#ifdef KILN_HAVE_CUDA
    device = Device::kCuda;
#else
    fail("{} is a CUDA tensor, and this kiln was built without CUDA", what);
#endif
  } else {
    KILN_CHECK(array.device_type() == kDlpackCpu, "{} is on a DLPack device of type {}: kiln takes CPU and CUDA tensors",
               what, array.device_type());
  }
  std::byte* data = static_cast<std::byte*>(array.data_handle()) + array.byte_offset();
  const size_t element = dtype_size(dtype);
  KILN_CHECK(type.numel() == 0 || reinterpret_cast<uintptr_t>(data) % element == 0,
             "{} ({}) starts at an address that is not a multiple of its element size", what, to_string(type));
  // A view, not an owner: the Python object keeps the bytes (see the header).
  std::shared_ptr<std::byte[]> storage(data, [](std::byte*) {});
  return Tensor(type, std::move(storage), 0, device);
}

namespace {

// An array over `tensor`'s bytes as `dtype`, kept alive by `owner`.
nb::object array_over(const Tensor& tensor, DType dtype, int device_id, nb::handle owner) {
  std::vector<size_t> shape(tensor.shape().begin(), tensor.shape().end());
  const int device_type = tensor.device() == Device::kCuda ? kDlpackCuda : kDlpackCpu;
  nb::ndarray<nb::array_api> array(tensor.raw(), shape.size(), shape.data(), owner, nullptr, dlpack_dtype(dtype),
                                   device_type, tensor.device() == Device::kCuda ? device_id : 0);
  return nb::cast(array);
}

}  // namespace

nb::object to_array(const Tensor& tensor, int device_id) {
  // The capsule owns a Tensor sharing the storage: the bytes live while the array does.
  nb::capsule owner(new Tensor(tensor), [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  return array_over(tensor, tensor.dtype(), device_id, owner);
}

nb::object viewed_as(const Array& array, DType dtype, const std::string& what, nb::handle owner) {
  const Tensor tensor = from_array(array, what);
  KILN_CHECK(dtype_size(tensor.dtype()) == dtype_size(dtype), "{} ({}) cannot be viewed as {}: the sizes differ",
             what, to_string(tensor.type()), dtype_name(dtype));
  return array_over(tensor, dtype, array.device_id(), owner);
}

}  // namespace kiln::python
