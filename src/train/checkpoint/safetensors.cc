// safetensors writing (atomic) and reading (validated) for kiln's host Tensors (see
// safetensors.h).
#include "train/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

namespace kiln::train {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is copied to and from memory as is");

// Hugging Face's reader refuses headers over 100 MB; so do we, before allocating one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::string_view kMetadataKey = "__metadata__";

constexpr std::array<std::string_view, kNumDTypes> kNames = {"F32", "F64", "F16",  "BF16",
                                                             "I32", "I64", "BOOL", "U8"};

// One tensor as the header describes it; offsets are relative to the start of the data.
struct Entry {
  std::string name;
  TensorType type;
  uint64_t begin;
  uint64_t end;
};

struct Header {
  std::vector<Entry> entries;  // in name order
  std::map<std::string, std::string> metadata;
};

// The non-negative integer `value` of field `what`, or a kiln::Error.
uint64_t as_unsigned(const nlohmann::json& value, const std::string& source,
                     const std::string& what) {
  KILN_CHECK(value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0),
             "safetensors: {}: {} must be a non-negative integer, got {}", source, what,
             value.dump());
  return value.get<uint64_t>();
}

// Parses and validates the JSON header against a data section of `data_size` bytes.
Header parse_header(std::string_view text, uint64_t data_size, const std::string& source) {
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  KILN_CHECK(!json.is_discarded(), "safetensors: {}: the {}-byte header is not valid JSON", source,
             text.size());
  KILN_CHECK(json.is_object(), "safetensors: {}: the header must be a JSON object, got {}", source,
             json.type_name());
  Header header;
  for (auto& [name, value] : json.items()) {
    if (name == kMetadataKey) {
      KILN_CHECK(value.is_object(),
                 "safetensors: {}: __metadata__ must be an object of "
                 "strings, got {}",
                 source, value.type_name());
      for (auto& [key, text_value] : value.items()) {
        KILN_CHECK(text_value.is_string(),
                   "safetensors: {}: metadata \"{}\" must be a string, "
                   "got {}",
                   source, key, text_value.dump());
        header.metadata[key] = text_value.get<std::string>();
      }
      continue;
    }
    KILN_CHECK(value.is_object(), "safetensors: {}: tensor \"{}\" must be an object, got {}",
               source, name, value.type_name());
    for (const char* field : {"dtype", "shape", "data_offsets"})
      KILN_CHECK(value.contains(field), "safetensors: {}: tensor \"{}\" has no \"{}\"", source,
                 name, field);
    const nlohmann::json& dtype = value["dtype"];
    KILN_CHECK(dtype.is_string(), "safetensors: {}: tensor \"{}\": dtype must be a string, got {}",
               source, name, dtype.dump());
    std::optional<DType> parsed = parse_safetensors_dtype(dtype.get<std::string>());
    KILN_CHECK(parsed.has_value(),
               "safetensors: {}: tensor \"{}\" has dtype \"{}\", which kiln "
               "does not support (F32, F64, F16, BF16, I32, I64, BOOL, U8)",
               source, name, dtype.get<std::string>());
    const nlohmann::json& shape_json = value["shape"];
    KILN_CHECK(shape_json.is_array(),
               "safetensors: {}: tensor \"{}\": shape must be an array, "
               "got {}",
               source, name, shape_json.dump());
    Shape shape;
    uint64_t numel = 1;
    for (const nlohmann::json& dim_json : shape_json) {
      uint64_t dim = as_unsigned(dim_json, source, fmt::format("a dim of tensor \"{}\"", name));
      KILN_CHECK(dim <= uint64_t(std::numeric_limits<int64_t>::max()),
                 "safetensors: {}: tensor \"{}\" has a dim of {}, beyond int64", source, name, dim);
      // Saturate at data_size + 1 so nothing overflows: such a tensor is larger than the data
      // and fails the size check below; a later 0 dim still makes it empty.
      unsigned __int128 product = static_cast<unsigned __int128>(numel) * dim;
      numel = static_cast<uint64_t>(std::min<unsigned __int128>(product, data_size + 1));
      shape.push_back(static_cast<int64_t>(dim));
    }
    const nlohmann::json& offsets = value["data_offsets"];
    KILN_CHECK(offsets.is_array() && offsets.size() == 2,
               "safetensors: {}: tensor \"{}\": "
               "data_offsets must be [begin, end], got {}",
               source, name, offsets.dump());
    uint64_t begin = as_unsigned(offsets[0], source, "data_offsets of \"" + name + "\"");
    uint64_t end = as_unsigned(offsets[1], source, "data_offsets of \"" + name + "\"");
    KILN_CHECK(begin <= end && end <= data_size,
               "safetensors: {}: tensor \"{}\" has data_offsets "
               "[{}, {}], outside the {}-byte data (truncated file?)",
               source, name, begin, end, data_size);
    KILN_CHECK(numel <= data_size,
               "safetensors: {}: tensor \"{}\" of shape {} is larger than "
               "the {}-byte data",
               source, name, shape_json.dump(), data_size);
    uint64_t bytes = numel * dtype_size(*parsed);
    KILN_CHECK(end - begin == bytes,
               "safetensors: {}: tensor \"{}\" of {} {} is {} bytes but its "
               "data_offsets [{}, {}] span {}",
               source, name, dtype.get<std::string>(), shape_json.dump(), bytes, begin, end,
               end - begin);
    header.entries.push_back({name, TensorType{*parsed, std::move(shape)}, begin, end});
  }
  // No two tensors may share bytes (zero-size tensors take none).
  std::vector<const Entry*> by_offset;
  for (const Entry& e : header.entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  const Entry* previous = nullptr;
  for (const Entry* e : by_offset) {
    if (e->begin == e->end) continue;
    KILN_CHECK(!previous || previous->end <= e->begin,
               "safetensors: {}: tensors \"{}\" [{}, {}] "
               "and \"{}\" [{}, {}] overlap",
               source, previous->name, previous->begin, previous->end, e->name, e->begin, e->end);
    previous = e;
  }
  return header;
}

// kiln's bool storage must hold 0 or 1; any other byte would be undefined behaviour to read.
void check_bools(const Tensor& tensor, const std::string& name, const std::string& source) {
  if (tensor.dtype() != DType::kBool) return;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(tensor.raw());
  for (int64_t i = 0; i < tensor.numel(); ++i)
    KILN_CHECK(bytes[i] <= 1,
               "safetensors: {}: BOOL tensor \"{}\" holds byte {} at element {}, "
               "expected 0 or 1",
               source, name, bytes[i], i);
}

// The 8-byte length and the padded JSON header for `tensors` (validated), in name order.
std::string make_header(const std::map<std::string, Tensor>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::json json = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    KILN_CHECK(!name.empty(), "safetensors: a tensor has an empty name");
    KILN_CHECK(name != kMetadataKey,
               "safetensors: \"__metadata__\" is reserved for metadata and "
               "cannot name a tensor");
    KILN_CHECK(tensor.defined(), "safetensors: tensor \"{}\" is undefined (no storage)", name);
    json[name] = {{"dtype", safetensors_dtype_name(tensor.dtype())},
                  {"shape", tensor.shape()},
                  {"data_offsets", {offset, offset + tensor.bytes()}}};
    offset += tensor.bytes();
  }
  if (!metadata.empty()) json[std::string(kMetadataKey)] = metadata;
  std::string text;
  try {
    text = json.dump();
  } catch (const nlohmann::json::exception& e) {  // invalid UTF-8 in a name or a string
    fail("safetensors: cannot write the header: {}", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t length = text.size();
  std::memcpy(out.data(), &length, 8);
  return out + text;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) { return kNames[static_cast<int>(dtype)]; }

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (kNames[i] == name) return static_cast<DType>(i);
  return std::nullopt;
}

std::string serialize_safetensors(const std::map<std::string, Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  std::string out = make_header(tensors, metadata);
  for (const auto& [name, tensor] : tensors)
    out.append(reinterpret_cast<const char*>(tensor.raw()), tensor.bytes());
  return out;
}

SafetensorsFile parse_safetensors(std::string_view bytes, const std::string& source) {
  KILN_CHECK(bytes.size() >= 8,
             "safetensors: {}: {} bytes is too short for the 8-byte header "
             "length",
             source, bytes.size());
  uint64_t length;
  std::memcpy(&length, bytes.data(), 8);
  KILN_CHECK(length <= kMaxHeaderBytes && length <= bytes.size() - 8,
             "safetensors: {}: the "
             "header length {} exceeds the {} bytes after it (truncated or not a safetensors "
             "file?)",
             source, length, bytes.size() - 8);
  std::string_view data = bytes.substr(8 + length);
  Header header = parse_header(bytes.substr(8, length), data.size(), source);
  SafetensorsFile file{{}, std::move(header.metadata)};
  for (const Entry& e : header.entries) {
    Tensor tensor(e.type);
    std::memcpy(tensor.raw(), data.data() + e.begin, e.end - e.begin);
    check_bools(tensor, e.name, source);
    file.tensors.emplace(e.name, std::move(tensor));
  }
  return file;
}

namespace {

// An open file whose header has been read and validated.
struct OpenFile {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file{nullptr, std::fclose};
  std::string source;
  Header header;
  uint64_t data_start = 0;

  void read_exactly(void* out, uint64_t offset, uint64_t count, const std::string& what) const {
    KILN_CHECK(fseeko(file.get(), static_cast<off_t>(offset), SEEK_SET) == 0 &&
                   std::fread(out, 1, count, file.get()) == count,
               "safetensors: {}: cannot read {} ({} bytes at offset {}): {}", source, what, count,
               offset, std::feof(file.get()) ? "unexpected end of file" : errno_text());
  }
};

OpenFile open_safetensors(const std::string& path) {
  OpenFile open;
  open.source = "'" + path + "'";
  open.file.reset(std::fopen(path.c_str(), "rb"));
  if (!open.file) fail("safetensors: cannot open {}: {}", open.source, errno_text());
  struct stat info;
  KILN_CHECK(fstat(fileno(open.file.get()), &info) == 0 && S_ISREG(info.st_mode),
             "safetensors: {} is not a regular file", open.source);
  uint64_t size = static_cast<uint64_t>(info.st_size);
  KILN_CHECK(size >= 8, "safetensors: {}: {} bytes is too short for the 8-byte header length",
             open.source, size);
  uint64_t length;
  open.read_exactly(&length, 0, 8, "the header length");
  KILN_CHECK(length <= kMaxHeaderBytes && length <= size - 8,
             "safetensors: {}: the header "
             "length {} exceeds the {} bytes after it (truncated or not a safetensors file?)",
             open.source, length, size - 8);
  std::string text(length, '\0');
  open.read_exactly(text.data(), 8, length, "the header");
  open.data_start = 8 + length;
  open.header = parse_header(text, size - open.data_start, open.source);
  return open;
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path) {
  OpenFile open = open_safetensors(path);
  SafetensorsFile out{{}, std::move(open.header.metadata)};
  for (const Entry& e : open.header.entries) {
    Tensor tensor(e.type);
    if (e.end > e.begin)
      open.read_exactly(tensor.raw(), open.data_start + e.begin, e.end - e.begin, "tensor \"" + e.name + "\"");
    check_bools(tensor, e.name, open.source);
    out.tensors.emplace(e.name, std::move(tensor));
  }
  return out;
}

SafetensorsHeader load_safetensors_header(const std::string& path) {
  OpenFile open = open_safetensors(path);
  SafetensorsHeader out{{}, std::move(open.header.metadata)};
  for (const Entry& e : open.header.entries) out.types.emplace(e.name, e.type);
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::string header = make_header(tensors, metadata);  // validates before touching any file
  std::string temp = path + ".tmp";
  std::FILE* file = std::fopen(temp.c_str(), "wb");
  if (!file) fail("safetensors: cannot create '{}': {}", temp, errno_text());
  auto give_up = [&](const std::string& what) {
    std::string reason = errno_text();
    if (file) std::fclose(file);
    std::remove(temp.c_str());
    fail("safetensors: cannot save '{}': {} failed: {}; the previous file is unchanged", path, what,
         reason);
  };
  if (std::fwrite(header.data(), 1, header.size(), file) != header.size()) give_up("writing");
  for (const auto& [name, tensor] : tensors)
    if (std::fwrite(tensor.raw(), 1, tensor.bytes(), file) != tensor.bytes())
      give_up("writing tensor \"" + name + "\"");
  // The data must be on disk before the rename makes it the checkpoint.
  if (std::fflush(file) != 0) give_up("flushing");
  if (fsync(fileno(file)) != 0) give_up("fsync");
  int closed = std::fclose(file);
  file = nullptr;
  if (closed != 0) give_up("closing");
  if (std::rename(temp.c_str(), path.c_str()) != 0) give_up("renaming the temporary file");
  // The rename itself lives in the directory: sync it so the new name survives a crash. Best
  // effort: some file systems cannot fsync a directory, and the file is in place already.
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace kiln::train
