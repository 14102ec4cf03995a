// safetensors checkpoints: the exact byte layout of a small file (worked out by hand), round
// trips of every dtype and of metadata, validation of hand-corrupted headers, truncation at
// every cut point and random header corruption (always kiln::Error, never a crash), and the
// atomic save that leaves the old file untouched when it fails.
#include "train/checkpoint/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "test_util.h"
#include "train/temp_dir.h"

namespace kiln::train {
namespace {

using kiln::testing::read_bytes;
using kiln::testing::error_of;
using kiln::testing::TempDir;
using kiln::testing::write_bytes;


// The 8-byte little-endian length followed by `json`.
std::string with_length(const std::string& json) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json;
}

TEST(TrainSafetensors, ByteLayoutOfASmallFile) {
  Tensor a(TensorType{DType::kF32, {2}});
  a.set(0, 1.0);
  a.set(1, 2.0);
  std::string bytes = serialize_safetensors({{"a", a}});
  // {"a":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}} is 5 + 16 + 6 + 8 + 6 + 8 + 3 + 2 =
  // 54 characters; 2 spaces pad it to 56 = 0x38 so the data starts at 64. 1.0f is 0x3F800000
  // and 2.0f is 0x40000000, little-endian.
  std::string expected = std::string("\x38\0\0\0\0\0\0\0", 8) +
                         "{\"a\":{\"data_offsets\":[0,8],\"dtype\":\"F32\",\"shape\":[2]}}  " +
                         std::string("\0\0\x80\x3F\0\0\0\x40", 8);
  EXPECT_EQ(bytes, expected);
}

TEST(TrainSafetensors, TensorsAreStoredInNameOrderAndHeaderIsAligned) {
  Tensor x = random_tensor(TensorType{DType::kF64, {3}}, 1);
  Tensor y = random_tensor(TensorType{DType::kU8, {5}}, 2, 1, 200);
  std::string bytes = serialize_safetensors({{"y", y}, {"b.weight", x}}, {{"step", "7"}});
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  // "b.weight" sorts before "y": its 24 bytes come first.
  EXPECT_EQ(bytes.substr(8 + n, 24), std::string(reinterpret_cast<const char*>(x.raw()), 24));
  EXPECT_EQ(bytes.substr(8 + n + 24), std::string(reinterpret_cast<const char*>(y.raw()), 5));
  EXPECT_NE(bytes.find("\"y\":{\"data_offsets\":[24,29]"), std::string::npos) << bytes;
}

TEST(TrainSafetensors, RoundTripsEveryDTypeAndShape) {
  TempDir dir;
  std::map<std::string, Tensor> tensors;
  const DType dtypes[] = {DType::kF32, DType::kF64, DType::kF16,  DType::kBF16,
                          DType::kI32, DType::kI64, DType::kBool, DType::kU8};
  const Shape shapes[] = {{2, 3}, {7}, {}, {0, 4}, {2, 1, 3, 2}};
  uint64_t seed = 1;
  for (DType dtype : dtypes) {
    for (const Shape& shape : shapes) {
      double low = dtype == DType::kU8 ? 1 : -100, high = dtype == DType::kU8 ? 255 : 100;
      tensors[fmt::format("{}/{}", dtype_name(dtype), to_string(shape))] =
          random_tensor(TensorType{dtype, shape}, seed++, low, high);
    }
  }
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"step", "1200"},
      {"note", "quotes \" and \\ and é 日本"},
      {"empty", ""}};
  save_safetensors(dir.file("model.safetensors"), tensors, metadata);
  EXPECT_FALSE(std::filesystem::exists(dir.file("model.safetensors.tmp")));
  SafetensorsFile loaded = load_safetensors(dir.file("model.safetensors"));
  EXPECT_EQ(loaded.metadata, metadata);
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    ASSERT_TRUE(loaded.tensors.count(name)) << name;
    const Tensor& back = loaded.tensors.at(name);
    EXPECT_EQ(back.type(), tensor.type()) << name;
    EXPECT_EQ(std::memcmp(back.raw(), tensor.raw(), tensor.bytes()), 0) << name;
  }
  // The in-memory parser agrees with the file reader.
  SafetensorsFile parsed =
      parse_safetensors(read_bytes(dir.file("model.safetensors")), "model.safetensors");
  EXPECT_EQ(parsed.tensors.size(), tensors.size());
  EXPECT_EQ(parsed.metadata, metadata);
  // No metadata: no "__metadata__" key at all.
  EXPECT_EQ(serialize_safetensors({{"a", tensors.begin()->second}}).find("__metadata__"),
            std::string::npos);
}

void expect_parse_error(const std::string& bytes, const std::string& expected) {
  std::string message = error_of([&] { parse_safetensors(bytes, "test.safetensors"); });
  EXPECT_NE(message.find("test.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find(expected), std::string::npos) << message;
}

TEST(TrainSafetensors, ValidatesTheHeader) {
  std::string data8(8, '\x01');
  expect_parse_error("abc", "too short");
  expect_parse_error(with_length("{}").substr(0, 9), "exceeds");
  expect_parse_error(with_length("{\"a\": ") + data8, "not valid JSON");
  expect_parse_error(with_length("[1, 2]"), "must be a JSON object");
  expect_parse_error(
      with_length(R"({"a":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}})") + data8,
      "F8_E4M3");
  expect_parse_error(
      with_length(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})") + data8,
      "outside the 8-byte data");
  expect_parse_error(
      with_length(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})") + data8,
      "is 12 bytes");
  expect_parse_error(
      with_length(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})") + data8, "[8, 0]");
  expect_parse_error(
      with_length(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})") + data8,
      "non-negative");
  expect_parse_error(with_length(R"({"a":{"dtype":"F32","shape":[2]}})") + data8,
                     "has no \"data_offsets\"");
  expect_parse_error(with_length(R"({"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},)"
                                 R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})") +
                         data8,
                     "overlap");
  expect_parse_error(with_length(R"({"__metadata__":{"step":3}})"), "metadata \"step\"");
  expect_parse_error(
      with_length(R"({"a":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})") + "\x01\x02",
      "byte 2");
  // A shape whose element count overflows 64 bits must not wrap around to a small size.
  expect_parse_error(with_length(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],)"
                                 R"("data_offsets":[0,0]}})"),
                     "larger than the 0-byte data");
  // Zero-size tensors take no bytes and may share an offset with others.
  SafetensorsFile ok =
      parse_safetensors(with_length(R"({"e":{"dtype":"F32","shape":[0,5],"data_offsets":[0,0]},)"
                                    R"("u":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})") +
                            "\x05\x06",
                        "ok");
  EXPECT_EQ(ok.tensors.at("e").shape(), (Shape{0, 5}));
  EXPECT_EQ(ok.tensors.at("u").to_f64(), (std::vector<double>{5, 6}));
}

std::string sample_file() {
  std::map<std::string, Tensor> tensors = {
      {"w", random_tensor(TensorType{DType::kF32, {4, 3}}, 3)},
      {"b", random_tensor(TensorType{DType::kBF16, {3}}, 4)},
      {"mask", random_tensor(TensorType{DType::kBool, {5}}, 5)},
      {"step", random_tensor(TensorType{DType::kI64, {}}, 6, 1, 1000)}};
  return serialize_safetensors(tensors, {{"epoch", "3"}});
}

TEST(TrainSafetensors, EveryTruncationIsAnError) {
  TempDir dir;
  std::string full = sample_file();
  ASSERT_NO_THROW(parse_safetensors(full, "full"));
  for (size_t cut = 0; cut < full.size(); ++cut) {
    std::string path = dir.file("cut.safetensors");
    write_bytes(path, full.substr(0, cut));
    EXPECT_THROW(load_safetensors(path), Error) << "cut at " << cut;
    EXPECT_THROW(parse_safetensors(full.substr(0, cut), "cut"), Error) << "cut at " << cut;
  }
}

TEST(TrainSafetensors, RandomHeaderCorruptionNeverCrashes) {
  TempDir dir;
  std::string full = sample_file();
  uint64_t header;
  std::memcpy(&header, full.data(), 8);
  std::mt19937_64 rng(123);
  int errors = 0, loaded = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bytes = full;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      // Mostly the JSON, sometimes the length field.
      size_t pos = rng() % 10 == 0 ? rng() % 8 : 8 + rng() % header;
      bytes[pos] = static_cast<char>(rng() % 256);
    }
    try {
      parse_safetensors(bytes, "corrupt");
      ++loaded;  // e.g. a changed padding space or a dtype "F32" -> "I32": still a valid file
    } catch (const Error&) {
      ++errors;
    }
    if (trial % 100 == 0) {  // the file path too, on a sample
      write_bytes(dir.file("c.safetensors"), bytes);
      try {
        load_safetensors(dir.file("c.safetensors"));
      } catch (const Error&) {
      }
    }
  }
  EXPECT_EQ(errors + loaded, 3000);
  EXPECT_GT(errors, 1500);  // most random damage is detected
}

TEST(TrainSafetensors, FailedSaveLeavesTheOldFileUntouched) {
  TempDir dir;
  std::string path = dir.file("ckpt.safetensors");
  Tensor v1 = random_tensor(TensorType{DType::kF32, {8}}, 1);
  save_safetensors(path, {{"w", v1}}, {{"version", "1"}});
  std::string before = read_bytes(path);

  // Invalid input: rejected before any file is touched.
  std::string message = error_of([&] { save_safetensors(path, {{"", v1}}); });
  EXPECT_NE(message.find("empty name"), std::string::npos) << message;
  message = error_of([&] { save_safetensors(path, {{"__metadata__", v1}}); });
  EXPECT_NE(message.find("reserved"), std::string::npos) << message;
  message = error_of([&] { save_safetensors(path, {{"w", Tensor()}}); });
  EXPECT_NE(message.find("undefined"), std::string::npos) << message;
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  // An I/O failure: the temporary file cannot be created (a directory holds its name).
  std::filesystem::create_directory(path + ".tmp");
  Tensor v2 = random_tensor(TensorType{DType::kF32, {8}}, 2);
  message = error_of([&] { save_safetensors(path, {{"w", v2}}); });
  EXPECT_NE(message.find(path + ".tmp"), std::string::npos) << message;
  EXPECT_EQ(read_bytes(path), before);
  std::filesystem::remove(path + ".tmp");

  // A directory that does not exist.
  message = error_of([&] { save_safetensors(dir.file("no/such/dir/x.safetensors"), {{"w", v2}}); });
  EXPECT_NE(message.find("no/such/dir"), std::string::npos) << message;

  // A good save replaces the file whole.
  save_safetensors(path, {{"w", v2}}, {{"version", "2"}});
  SafetensorsFile loaded = load_safetensors(path);
  EXPECT_EQ(loaded.metadata.at("version"), "2");
  EXPECT_EQ(loaded.tensors.at("w").to_f64(), v2.to_f64());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(TrainSafetensors, LoadErrorsNameTheFile) {
  std::string message = error_of([] { load_safetensors("/nonexistent/model.safetensors"); });
  EXPECT_NE(message.find("/nonexistent/model.safetensors"), std::string::npos) << message;
  TempDir dir;
  message = error_of([&] { load_safetensors(dir.path().string()); });
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
  write_bytes(dir.file("huge.safetensors"), std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10));
  message = error_of([&] { load_safetensors(dir.file("huge.safetensors")); });
  EXPECT_NE(message.find("huge.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("exceeds"), std::string::npos) << message;
}

TEST(TrainSafetensors, DTypeNames) {
  EXPECT_EQ(safetensors_dtype_name(DType::kBF16), "BF16");
  EXPECT_EQ(safetensors_dtype_name(DType::kBool), "BOOL");
  EXPECT_EQ(parse_safetensors_dtype("I64"), DType::kI64);
  EXPECT_EQ(parse_safetensors_dtype("f32"), std::nullopt);  // names are upper case
  EXPECT_EQ(parse_safetensors_dtype("I8"), std::nullopt);
}

}  // namespace
}  // namespace kiln::train
