// Text datasets: the byte tokenizer, the default corpus, token files and LM batches.
#include "train/data/text.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "test_util.h"
#include "train/temp_dir.h"

namespace kiln::train {
namespace {

using kiln::testing::read_bytes;
using kiln::testing::error_of;
using kiln::testing::TempDir;
using kiln::testing::write_bytes;


TEST(TrainText, ByteTokenizerIsTheBytes) {
  ByteTokenizer tokenizer;
  EXPECT_EQ(tokenizer.encode("A\n\xff\x80"), (std::vector<int32_t>{65, 10, 255, 128}));
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(all)), all);
  std::string message = error_of([&] { tokenizer.decode({1, 256}); });
  EXPECT_NE(message.find("token 256 at position 1"), std::string::npos) << message;
}

TEST(TrainText, DefaultCorpusIsPresentAndReadable) {
  // /usr/share/common-licenses/GPL-3 comes with Debian's base-files (always installed).
  ASSERT_TRUE(std::filesystem::exists(kDefaultTextPath)) << kDefaultTextPath;
  std::string text = read_text_file(kDefaultTextPath);
  EXPECT_EQ(text.size(), std::filesystem::file_size(kDefaultTextPath));
  EXPECT_NE(text.find("GNU GENERAL PUBLIC LICENSE"), std::string::npos);
  std::vector<int32_t> tokens = ByteTokenizer().encode(text);
  TokenBatcher batcher(tokens, 4, 64);
  Batch b = batcher.random_batch(1, 0);
  EXPECT_EQ(b.inputs.shape(), (Shape{4, 64}));
  std::string message = error_of([] { read_text_file("/nonexistent/corpus.txt"); });
  EXPECT_NE(message.find("/nonexistent/corpus.txt"), std::string::npos) << message;
}

TEST(TrainText, TokenFileLayoutIsAsDocumented) {
  TempDir dir;
  write_token_file(dir.file("a.tok"), {1, 258, 65535});
  // 24-byte header: "KILNTOK1", width 2 (LE uint32), reserved 0, count 3 (LE uint64); then
  // 01 00, 02 01 (258 = 0x0102), ff ff.
  std::string expected("KILNTOK1\x02\0\0\0\0\0\0\0\x03\0\0\0\0\0\0\0\x01\0\x02\x01\xff\xff", 30);
  EXPECT_EQ(read_bytes(dir.file("a.tok")), expected);
  EXPECT_EQ(read_token_file(dir.file("a.tok")), (std::vector<int32_t>{1, 258, 65535}));

  // A token of 65536 needs 4 bytes: picked automatically.
  std::vector<int32_t> big = {65536, 7, 2147483647};
  write_token_file(dir.file("b.tok"), big);
  EXPECT_EQ(std::filesystem::file_size(dir.file("b.tok")), 24u + 12u);
  EXPECT_EQ(read_bytes(dir.file("b.tok")).substr(8, 4), std::string("\x04\0\0\0", 4));
  EXPECT_EQ(read_token_file(dir.file("b.tok")), big);

  write_token_file(dir.file("c.tok"), {3, 4}, /*bytes_per_token=*/4);
  EXPECT_EQ(std::filesystem::file_size(dir.file("c.tok")), 24u + 8u);
  EXPECT_EQ(read_token_file(dir.file("c.tok")), (std::vector<int32_t>{3, 4}));
  write_token_file(dir.file("empty.tok"), {});
  EXPECT_TRUE(read_token_file(dir.file("empty.tok")).empty());
}

TEST(TrainText, TokenFileErrors) {
  TempDir dir;
  std::string message = error_of([&] { write_token_file(dir.file("x"), {70000}, 2); });
  EXPECT_NE(message.find("70000"), std::string::npos) << message;
  message = error_of([&] { write_token_file(dir.file("x"), {1, -5}); });
  EXPECT_NE(message.find("-5"), std::string::npos) << message;

  write_token_file(dir.file("good.tok"), {1, 2, 3});
  std::string good = read_bytes(dir.file("good.tok"));
  auto expect_read_error = [&](const std::string& bytes, const std::string& expected) {
    std::string path = dir.file("bad.tok");
    write_bytes(path, bytes);
    std::string message = error_of([&] { read_token_file(path); });
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  };
  expect_read_error("KILNTOK2" + good.substr(8), "magic");
  expect_read_error(good.substr(0, 8) + std::string("\x03", 1) + good.substr(9),
                    "3 bytes per token");
  expect_read_error(good.substr(0, good.size() - 1), "says 3 tokens");  // cut
  expect_read_error(good + "x", "says 3 tokens");                       // trailing byte
  expect_read_error(good.substr(0, 10), "shorter than the 24-byte header");
  std::string huge_count = good;
  huge_count[23] = '\x7f';  // count ~ 2^63
  expect_read_error(huge_count, "holds 6 bytes of tokens");
}

TEST(TrainText, SequentialBatchesCoverTheStreamInOrder) {
  std::vector<int32_t> tokens(21);
  for (int i = 0; i < 21; ++i) tokens[i] = 1000 + i;
  TokenBatcher batcher(tokens, /*B=*/2, /*T=*/3);
  // (21 - 1) / (2 * 3) = 3 batches; batch i's rows start at (2i + b) * 3.
  ASSERT_EQ(batcher.num_sequential_batches(), 3);
  Batch first = batcher.sequential_batch(0);
  EXPECT_EQ(first.inputs.dtype(), DType::kI64);
  EXPECT_EQ(first.inputs.shape(), (Shape{2, 3}));
  EXPECT_EQ(first.inputs.to_f64(), (std::vector<double>{1000, 1001, 1002, 1003, 1004, 1005}));
  EXPECT_EQ(first.targets.to_f64(), (std::vector<double>{1001, 1002, 1003, 1004, 1005, 1006}));
  Batch last = batcher.sequential_batch(2);
  EXPECT_EQ(last.inputs.to_f64(), (std::vector<double>{1012, 1013, 1014, 1015, 1016, 1017}));
  EXPECT_EQ(last.targets.to_f64(), (std::vector<double>{1013, 1014, 1015, 1016, 1017, 1018}));
  std::string message = error_of([&] { batcher.sequential_batch(3); });
  EXPECT_NE(message.find("sequential batch 3"), std::string::npos) << message;
}

TEST(TrainText, RandomBatchesAreSeededWindows) {
  std::vector<int32_t> tokens(21);
  for (int i = 0; i < 21; ++i) tokens[i] = 1000 + i;
  TokenBatcher batcher(tokens, 2, 3);
  std::set<int64_t> offsets;
  for (int64_t step = 0; step < 300; ++step) {
    Batch b = batcher.random_batch(/*seed=*/9, step);
    for (int64_t row = 0; row < 2; ++row) {
      int64_t offset = static_cast<int64_t>(b.inputs.get(row * 3)) - 1000;
      ASSERT_GE(offset, 0);
      ASSERT_LE(offset, 21 - 3 - 1);
      offsets.insert(offset);
      for (int64_t t = 0; t < 3; ++t) {
        EXPECT_EQ(b.inputs.get(row * 3 + t), 1000 + offset + t);
        EXPECT_EQ(b.targets.get(row * 3 + t), 1000 + offset + t + 1);
      }
    }
  }
  EXPECT_EQ(offsets.size(), 18u);  // every offset 0..17 is drawn, the extremes included
  EXPECT_EQ(batcher.random_batch(9, 5).inputs.to_f64(), batcher.random_batch(9, 5).inputs.to_f64());
  // Different steps (or seeds) give different batches; compare a few to avoid a chance tie.
  int differ = 0;
  for (int64_t step = 0; step < 5; ++step)
    differ += batcher.random_batch(9, step).inputs.to_f64() !=
              batcher.random_batch(9, step + 1).inputs.to_f64();
  EXPECT_GE(differ, 4);
}

TEST(TrainText, TokenBatcherRejectsBadSizes) {
  std::string message = error_of([] { TokenBatcher(std::vector<int32_t>(4), 1, 4); });
  EXPECT_NE(message.find("4 tokens are too few"), std::string::npos) << message;
  message = error_of([] { TokenBatcher(std::vector<int32_t>(10), 0, 4); });
  EXPECT_NE(message.find("B=0"), std::string::npos) << message;
  TokenBatcher exact(std::vector<int32_t>(5), 1, 4);  // one window: offset 0 only
  EXPECT_EQ(exact.num_sequential_batches(), 1);
  EXPECT_EQ(exact.random_batch(3, 3).inputs.shape(), (Shape{1, 4}));
}

}  // namespace
}  // namespace kiln::train
