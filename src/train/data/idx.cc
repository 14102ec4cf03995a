// IDX reading and writing (format in idx.h): the whole file is decompressed into memory, checked
// against its dims, then byte-swapped from big-endian into a Tensor.
#include "train/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

namespace kiln::train {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the IDX reader swaps big-endian data to a little-endian host");

// Reads the whole (decompressed) file. gzread passes plain files through unchanged.
std::vector<uint8_t> read_all(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (!file) fail("idx: cannot open '{}': {}", path, std::strerror(errno));
  std::vector<uint8_t> bytes;
  constexpr int kChunk = 1 << 20;
  while (true) {
    size_t old_size = bytes.size();
    bytes.resize(old_size + kChunk);
    int n = gzread(file, bytes.data() + old_size, kChunk);
    if (n < 0) {
      int code = 0;
      std::string message = gzerror(file, &code);
      gzclose(file);
      fail("idx: cannot read '{}': {}", path, message);
    }
    bytes.resize(old_size + static_cast<size_t>(n));
    if (n < kChunk) break;
  }
  // A gzip stream cut short reads as a short count; gzerror then reports the missing end.
  int code = Z_OK;
  std::string message = gzerror(file, &code);
  gzclose(file);
  if (code != Z_OK && code != Z_STREAM_END)
    fail("idx: '{}' is a damaged or truncated gzip file: {}", path, message);
  return bytes;
}

uint32_t load_be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

void store_be(uint8_t* out, uint64_t value, int size) {
  for (int i = 0; i < size; ++i) out[i] = uint8_t(value >> (8 * (size - 1 - i)));
}

uint64_t load_be(const uint8_t* p, int size) {
  uint64_t v = 0;
  for (int i = 0; i < size; ++i) v = (v << 8) | p[i];
  return v;
}

int element_size(int type_code) {
  switch (type_code) {
    case kIdxUByte:
    case kIdxSByte:
      return 1;
    case kIdxShort:
      return 2;
    case kIdxInt:
    case kIdxFloat:
      return 4;
    case kIdxDouble:
      return 8;
    default:
      return 0;
  }
}

}  // namespace

Tensor read_idx(const std::string& path) {
  std::vector<uint8_t> bytes = read_all(path);
  KILN_CHECK(bytes.size() >= 4, "idx: '{}' is {} bytes long, too short for the 4-byte magic", path,
             bytes.size());
  int type_code = bytes[2];
  int rank = bytes[3];
  int size = element_size(type_code);
  KILN_CHECK(bytes[0] == 0 && bytes[1] == 0 && size != 0,
             "idx: '{}' has a bad magic {:02x} {:02x} {:02x} {:02x}: expected 00 00, a type code "
             "(08 ubyte, 09 sbyte, 0b short, 0c int, 0d float, 0e double) and the number of dims",
             path, bytes[0], bytes[1], bytes[2], bytes[3]);
  size_t header = 4 + 4 * static_cast<size_t>(rank);
  KILN_CHECK(bytes.size() >= header,
             "idx: '{}' is truncated: {} dims need a {}-byte header, the "
             "file has {} bytes",
             path, rank, header, bytes.size());
  Shape shape(rank);
  // Dims are up to 2^32 each, so a corrupt header can overflow the element count: guard it.
  uint64_t count = 1;
  bool overflow = false;
  for (int i = 0; i < rank; ++i) {
    shape[i] = load_be32(&bytes[4 + 4 * i]);
    if (shape[i] != 0 && count > std::numeric_limits<uint64_t>::max() / 8 / uint64_t(shape[i]))
      overflow = true;
    else
      count *= uint64_t(shape[i]);
  }
  size_t payload = bytes.size() - header;
  KILN_CHECK(!overflow && count * size <= payload,
             "idx: '{}' is truncated: dims {} need {} bytes of data, the file has {}", path,
             to_string(shape), overflow ? std::string("too many") : std::to_string(count * size),
             payload);
  KILN_CHECK(count * size == payload,
             "idx: '{}' has {} bytes of data but its dims {} account for only {}: dims disagree "
             "with the file length",
             path, payload, to_string(shape), count * size);

  const uint8_t* data = bytes.data() + header;
  DType dtype = type_code == kIdxUByte    ? DType::kU8
                : type_code == kIdxFloat  ? DType::kF32
                : type_code == kIdxDouble ? DType::kF64
                                          : DType::kI32;
  Tensor out(TensorType{dtype, shape});
  int64_t n = static_cast<int64_t>(count);
  switch (type_code) {
    case kIdxUByte:
      std::memcpy(out.raw(), data, count);
      break;
    case kIdxSByte: {
      int32_t* o = out.data<int32_t>();
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int8_t>(data[i]);
      break;
    }
    case kIdxShort: {
      int32_t* o = out.data<int32_t>();
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int16_t>(load_be(data + 2 * i, 2));
      break;
    }
    case kIdxInt: {
      int32_t* o = out.data<int32_t>();
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int32_t>(load_be(data + 4 * i, 4));
      break;
    }
    case kIdxFloat: {
      float* o = out.data<float>();
      for (int64_t i = 0; i < n; ++i)
        o[i] = std::bit_cast<float>(uint32_t(load_be(data + 4 * i, 4)));
      break;
    }
    case kIdxDouble: {
      double* o = out.data<double>();
      for (int64_t i = 0; i < n; ++i) o[i] = std::bit_cast<double>(load_be(data + 8 * i, 8));
      break;
    }
  }
  return out;
}

void write_idx(const std::string& path, const Tensor& tensor, bool compress) {
  int type_code = 0;
  switch (tensor.dtype()) {
    case DType::kU8:
      type_code = kIdxUByte;
      break;
    case DType::kI32:
      type_code = kIdxInt;
      break;
    case DType::kF32:
      type_code = kIdxFloat;
      break;
    case DType::kF64:
      type_code = kIdxDouble;
      break;
    default:
      fail("idx: cannot write a tensor of {} to '{}': IDX holds u8, i32, f32 or f64",
           to_string(tensor.type()), path);
  }
  KILN_CHECK(tensor.rank() <= 255, "idx: cannot write rank {} to '{}': IDX allows at most 255 dims",
             tensor.rank(), path);
  int size = element_size(type_code);
  std::vector<uint8_t> bytes(4 + 4 * tensor.rank() + tensor.bytes());
  bytes[2] = uint8_t(type_code);
  bytes[3] = uint8_t(tensor.rank());
  for (int i = 0; i < tensor.rank(); ++i) {
    KILN_CHECK(tensor.shape()[i] <= 0xffffffffLL, "idx: dim {} of {} does not fit IDX's uint32", i,
               to_string(tensor.shape()));
    store_be(&bytes[4 + 4 * i], uint64_t(tensor.shape()[i]), 4);
  }
  uint8_t* data = bytes.data() + 4 + 4 * tensor.rank();
  const uint8_t* src = reinterpret_cast<const uint8_t*>(tensor.raw());
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    uint64_t v = 0;
    std::memcpy(&v, src + i * size, size);  // little-endian host: low bytes first
    store_be(data + i * size, v, size);
  }
  gzFile file = gzopen(path.c_str(), compress ? "wb" : "wbT");  // "T": write without gzip
  if (!file) fail("idx: cannot create '{}': {}", path, std::strerror(errno));
  size_t written = 0;
  while (written < bytes.size()) {
    unsigned chunk = static_cast<unsigned>(std::min<size_t>(bytes.size() - written, 1 << 30));
    int n = gzwrite(file, bytes.data() + written, chunk);
    if (n <= 0) {
      int code = 0;
      std::string message = gzerror(file, &code);
      gzclose(file);
      fail("idx: cannot write '{}': {}", path, message);
    }
    written += static_cast<size_t>(n);
  }
  KILN_CHECK(gzclose(file) == Z_OK, "idx: cannot finish writing '{}'", path);
}

}  // namespace kiln::train
