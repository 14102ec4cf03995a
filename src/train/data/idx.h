// IDX files, the format MNIST and Fashion-MNIST ship in: a 4-byte magic (0, 0, element type,
// number of dims), the dims as big-endian uint32, then the elements, big-endian, row-major.
// Files may be gzip-compressed (.gz, as Debian's dataset packages install them) or plain:
// zlib's gzread reads both, so one code path serves either.
#pragma once

#include <string>

#include "tensor/tensor.h"

namespace kiln::train {

// IDX element type codes (the third magic byte).
inline constexpr int kIdxUByte = 0x08;
inline constexpr int kIdxSByte = 0x09;
inline constexpr int kIdxShort = 0x0B;
inline constexpr int kIdxInt = 0x0C;
inline constexpr int kIdxFloat = 0x0D;
inline constexpr int kIdxDouble = 0x0E;

// Reads an IDX file (gzip-compressed or plain) into a host Tensor with the file's dims as its
// shape. Element types map to u8 (ubyte), i32 (sbyte, short, int: kiln has no i8/i16), f32
// (float) and f64 (double). Throws kiln::Error naming the file and the problem: missing file,
// bad magic, truncated data, dims that disagree with the file length.
Tensor read_idx(const std::string& path);

// Writes `tensor` as IDX (u8 -> ubyte, i32 -> int, f32 -> float, f64 -> double; other dtypes
// are rejected), gzip-compressed when `compress` is true. For making small datasets in the
// IDX format (tests, examples); not atomic.
void write_idx(const std::string& path, const Tensor& tensor, bool compress);

}  // namespace kiln::train
