// IDX reader/writer tests on hand-built files: every element type, gzip and plain, and the
// error cases (missing file, bad magic, truncation, dims disagreeing with the length).
#include "train/data/idx.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include "train/temp_dir.h"

namespace kiln::train {
namespace {

using kiln::testing::read_bytes;
using kiln::testing::TempDir;
using kiln::testing::write_bytes;

std::string bytes(std::initializer_list<int> values) {
  std::string out;
  for (int v : values) out += static_cast<char>(v);
  return out;
}

void write_gzip(const std::string& path, const std::string& data) {
  gzFile file = gzopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(gzwrite(file, data.data(), static_cast<unsigned>(data.size())), int(data.size()));
  ASSERT_EQ(gzclose(file), Z_OK);
}

// u8, dims (2, 3), values 1 2 3 250 251 255.
const std::string kUByte2x3 =
    bytes({0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 250, 251, 255});

TEST(TrainIdx, ReadsUByteMatrix) {
  TempDir dir;
  write_bytes(dir.file("a.idx"), kUByte2x3);
  Tensor t = read_idx(dir.file("a.idx"));
  EXPECT_EQ(t.dtype(), DType::kU8);
  EXPECT_EQ(t.shape(), (Shape{2, 3}));
  EXPECT_EQ(t.to_f64(), (std::vector<double>{1, 2, 3, 250, 251, 255}));
}

TEST(TrainIdx, ReadsGzipCompressedLikeThePlainFile) {
  TempDir dir;
  write_gzip(dir.file("a.idx.gz"), kUByte2x3);
  Tensor t = read_idx(dir.file("a.idx.gz"));
  EXPECT_EQ(t.shape(), (Shape{2, 3}));
  EXPECT_EQ(t.to_f64(), (std::vector<double>{1, 2, 3, 250, 251, 255}));
}

TEST(TrainIdx, ReadsEveryElementTypeBigEndian) {
  TempDir dir;
  // int: 0x00000102 = 258, 0xFFFFFFFE = -2, 0x7FFFFFFF = 2147483647.
  write_bytes(dir.file("int"), bytes({0, 0, 0x0C, 1,    0,    0,    0,    3,    0,    0,
                                      1, 2, 0xFF, 0xFF, 0xFF, 0xFE, 0x7F, 0xFF, 0xFF, 0xFF}));
  Tensor ints = read_idx(dir.file("int"));
  EXPECT_EQ(ints.dtype(), DType::kI32);
  EXPECT_EQ(ints.to_f64(), (std::vector<double>{258, -2, 2147483647}));

  // float: 0x3FC00000 = 1.5 (exponent 127, mantissa .5), 0xC1200000 = -10 (-1.25 * 2^3).
  write_bytes(dir.file("float"),
              bytes({0, 0, 0x0D, 1, 0, 0, 0, 2, 0x3F, 0xC0, 0, 0, 0xC1, 0x20, 0, 0}));
  Tensor floats = read_idx(dir.file("float"));
  EXPECT_EQ(floats.dtype(), DType::kF32);
  EXPECT_EQ(floats.to_f64(), (std::vector<double>{1.5, -10.0}));

  // double: 0x400921FB54442D18 is the double nearest pi.
  write_bytes(dir.file("double"),
              bytes({0, 0, 0x0E, 1, 0, 0, 0, 1, 0x40, 0x09, 0x21, 0xFB, 0x54, 0x44, 0x2D, 0x18}));
  Tensor doubles = read_idx(dir.file("double"));
  EXPECT_EQ(doubles.dtype(), DType::kF64);
  EXPECT_EQ(doubles.get(0), 3.141592653589793);

  // sbyte 0xFF = -1, 0x7F = 127; short 0xFFFE = -2, 0x0100 = 256 (both widen to i32).
  write_bytes(dir.file("sbyte"), bytes({0, 0, 0x09, 1, 0, 0, 0, 2, 0xFF, 0x7F}));
  EXPECT_EQ(read_idx(dir.file("sbyte")).to_f64(), (std::vector<double>{-1, 127}));
  write_bytes(dir.file("short"), bytes({0, 0, 0x0B, 1, 0, 0, 0, 2, 0xFF, 0xFE, 0x01, 0x00}));
  Tensor shorts = read_idx(dir.file("short"));
  EXPECT_EQ(shorts.dtype(), DType::kI32);
  EXPECT_EQ(shorts.to_f64(), (std::vector<double>{-2, 256}));

  // Rank 0: a scalar, one element.
  write_bytes(dir.file("scalar"), bytes({0, 0, 0x08, 0, 42}));
  Tensor scalar = read_idx(dir.file("scalar"));
  EXPECT_EQ(scalar.shape(), Shape{});
  EXPECT_EQ(scalar.get(0), 42);
}

TEST(TrainIdx, WriterProducesTheHandBuiltBytesAndRoundTrips) {
  TempDir dir;
  Tensor t(TensorType{DType::kU8, {2, 3}});
  std::vector<double> values = {1, 2, 3, 250, 251, 255};
  for (int i = 0; i < 6; ++i) t.set(i, values[i]);
  write_idx(dir.file("plain"), t, /*compress=*/false);
  EXPECT_EQ(read_bytes(dir.file("plain")), kUByte2x3);

  write_idx(dir.file("packed.gz"), t, /*compress=*/true);
  std::string packed = read_bytes(dir.file("packed.gz"));
  ASSERT_GE(packed.size(), 2u);
  EXPECT_EQ(uint8_t(packed[0]), 0x1F);  // the gzip magic
  EXPECT_EQ(uint8_t(packed[1]), 0x8B);
  EXPECT_EQ(read_idx(dir.file("packed.gz")).to_f64(), values);

  Tensor f = random_tensor(TensorType{DType::kF32, {3, 4, 5}}, 7, 0.5, 2.0);
  write_idx(dir.file("f.gz"), f, true);
  Tensor back = read_idx(dir.file("f.gz"));
  EXPECT_EQ(back.type(), f.type());
  EXPECT_EQ(back.to_f64(), f.to_f64());

  Tensor d = random_tensor(TensorType{DType::kF64, {4}}, 8, -3.0, 3.0);
  write_idx(dir.file("d"), d, false);
  EXPECT_EQ(read_idx(dir.file("d")).to_f64(), d.to_f64());

  Tensor i = random_tensor(TensorType{DType::kI32, {6}}, 9, -100000.0, 100000.0);
  write_idx(dir.file("i"), i, false);
  EXPECT_EQ(read_idx(dir.file("i")).to_f64(), i.to_f64());
}

TEST(TrainIdx, WriterRejectsDTypesIdxCannotHold) {
  TempDir dir;
  Tensor t(TensorType{DType::kBF16, {2}});
  try {
    write_idx(dir.file("x"), t, false);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
}

// Runs read_idx on `contents` and checks the error names the file and `expected`.
void expect_idx_error(const std::string& contents, const std::string& expected, bool gzip = false) {
  TempDir dir;
  std::string path = dir.file(gzip ? "bad.idx.gz" : "bad.idx");
  if (gzip)
    write_gzip(path, contents);
  else
    write_bytes(path, contents);
  try {
    read_idx(path);
    ADD_FAILURE() << "expected kiln::Error mentioning '" << expected << "'";
  } catch (const Error& e) {
    std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
}

TEST(TrainIdx, MissingFileNamesThePath) {
  try {
    read_idx("/nonexistent/kiln/train-images.idx");
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/kiln/train-images.idx"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
}

TEST(TrainIdx, BadMagicIsAnError) {
  expect_idx_error(bytes({1, 0, 0x08, 1, 0, 0, 0, 1, 5}), "bad magic");  // first byte not 0
  expect_idx_error(bytes({0, 0, 0x0A, 1, 0, 0, 0, 1, 5}), "bad magic");  // type code 0x0A
  expect_idx_error(bytes({0, 0}), "too short");                          // no room for magic
  expect_idx_error("P5\n28 28\n255\n", "bad magic");                     // a PGM image
}

TEST(TrainIdx, TruncationIsAnError) {
  // Dims (2, 3) promise 6 bytes; 5 are there.
  expect_idx_error(bytes({0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5}), "truncated");
  // Three dims need a 16-byte header; 10 bytes are there.
  expect_idx_error(bytes({0, 0, 0x08, 3, 0, 0, 0, 2, 0, 0}), "truncated");
  // Same as gzip: the decompressed data is short.
  expect_idx_error(bytes({0, 0, 0x0C, 1, 0, 0, 0, 2, 0, 0, 0, 1}), "truncated", /*gzip=*/true);
  // Dims of 2^32 - 1 each: the element count overflows 64 bits; must not crash.
  expect_idx_error(bytes({0,    0,    0x0E, 4,    0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
                          0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 1,    2,    3}),
                   "truncated");
}

TEST(TrainIdx, DimsDisagreeingWithTheLengthAreAnError) {
  // Dims (2, 3) account for 6 bytes; 7 are there.
  expect_idx_error(bytes({0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6, 7}),
                   "dims disagree");
}

TEST(TrainIdx, CutGzipStreamIsAnError) {
  TempDir dir;
  // 4000 bytes of data so the compressed stream has a body to cut.
  std::string data = bytes({0, 0, 0x08, 1, 0, 0, 0x0F, 0xA0});
  for (int i = 0; i < 4000; ++i) data += static_cast<char>((i * 37) % 251);
  write_gzip(dir.file("full.gz"), data);
  std::string packed = read_bytes(dir.file("full.gz"));
  for (size_t cut : {packed.size() / 2, packed.size() - 4, packed.size() - 1}) {
    std::string path = dir.file("cut" + std::to_string(cut) + ".gz");
    write_bytes(path, packed.substr(0, cut));
    try {
      read_idx(path);
      ADD_FAILURE() << "expected kiln::Error for a gzip stream cut at " << cut;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace kiln::train
