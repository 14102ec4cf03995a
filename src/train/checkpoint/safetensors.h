// Checkpoints in Hugging Face's safetensors format, so kiln's weights load in PyTorch, JAX and
// numpy and theirs load here. Layout:
//   8 bytes         little-endian uint64 N, the header's length
//   N bytes         JSON: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
//                   ..., "__metadata__": {"key": "value"}}, padded with spaces so the data
//                   starts 8-byte aligned
//   the rest        the tensors' raw little-endian bytes; offsets are relative to its start
// Writes put tensors in name order and are atomic (a temp file, fsync, rename, fsync of the
// directory), so a crash mid-save leaves the previous checkpoint whole. Reads validate every
// field and throw kiln::Error naming the file and the problem: a truncated or corrupt file
// never crashes.
#pragma once

#include <map>
#include <string>

#include "tensor/tensor.h"

namespace kiln::train {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

// The safetensors dtype name of a kiln dtype ("F32", "BF16", "BOOL", ...) and back
// (std::nullopt for names kiln has no dtype for, e.g. "I8" or "F8_E4M3").
std::string_view safetensors_dtype_name(DType dtype);
std::optional<DType> parse_safetensors_dtype(std::string_view name);

// Throws kiln::Error for an empty name, the reserved name "__metadata__", an undefined tensor,
// or an I/O failure; in every case `path` is left as it was.
void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
SafetensorsFile load_safetensors(const std::string& path);
// The names, types and metadata alone (the header, validated as load_safetensors does).
struct SafetensorsHeader {
  std::map<std::string, TensorType> types;
  std::map<std::string, std::string> metadata;
};
SafetensorsHeader load_safetensors_header(const std::string& path);

// The serialized bytes without touching the file system (what save_safetensors writes), and
// the parser over bytes in memory (what load_safetensors runs); `source` names the bytes in
// error messages.
std::string serialize_safetensors(const std::map<std::string, Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});
SafetensorsFile parse_safetensors(std::string_view bytes, const std::string& source);

}  // namespace kiln::train
