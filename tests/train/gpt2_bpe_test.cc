// GPT-2 byte-level BPE: the byte -> unicode table, the hand-written pre-tokenizer, the merge
// loop on a tiny hand-made vocabulary (expected ids worked out by hand below), decoding, and
// round trips of arbitrary UTF-8 and of bytes that are not UTF-8.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "train/data/text.h"
#include "test_util.h"
#include "train/temp_dir.h"

namespace kiln::train {
namespace {

using kiln::testing::error_of;
using kiln::testing::TempDir;
using kiln::testing::write_bytes;


TEST(TrainGpt2, ByteToUnicodeTable) {
  const std::vector<std::string>& table = gpt2_byte_to_unicode();
  ASSERT_EQ(table.size(), 256u);
  // Printable bytes map to themselves (as UTF-8 of the same code point).
  EXPECT_EQ(table['!'], "!");
  EXPECT_EQ(table['~'], "~");
  EXPECT_EQ(table[0xA1], "\xC2\xA1");  // U+00A1
  EXPECT_EQ(table[0xFF], "\xC3\xBF");  // U+00FF
  // The 68 others in order from U+0100: bytes 0..32 are U+0100..U+0120, so 0x00 -> U+0100 'Ā',
  // '\n' -> U+010A 'Ċ', ' ' -> U+0120 'Ġ' (GPT-2's familiar markers); then 127..160 are
  // U+0121..U+0142, and 173 (the soft hyphen) is U+0143.
  EXPECT_EQ(table[0x00], "\xC4\x80");
  EXPECT_EQ(table['\n'], "\xC4\x8A");
  EXPECT_EQ(table[' '], "\xC4\xA0");
  EXPECT_EQ(table[0x7F], "\xC4\xA1");
  EXPECT_EQ(table[0xA0], "\xC5\x82");
  EXPECT_EQ(table[0xAD], "\xC5\x83");
  EXPECT_EQ(std::set<std::string>(table.begin(), table.end()).size(), 256u);
}

using Pieces = std::vector<std::string>;

TEST(TrainGpt2, PretokenizeAscii) {
  // Two spaces before "test": the run less its last space is one piece (\s+(?!\S)), the last
  // space leads " test". The final "\n\n" ends the text, so it stays whole.
  EXPECT_EQ(gpt2_pretokenize("Hello world's  test 123!!\n\n"),
            (Pieces{"Hello", " world", "'s", " ", " test", " 123", "!!", "\n\n"}));
  // Contractions are case-sensitive: "'LL" is an apostrophe then letters.
  EXPECT_EQ(gpt2_pretokenize("I'm, you'LL don't we've they'd it're"),
            (Pieces{"I", "'m", ",", " you", "'", "LL", " don", "'t", " we", "'ve", " they", "'d",
                    " it", "'re"}));
  // A tab alone before a letter is taken by \s+; "  \n" then " c" (the space joins the letter).
  EXPECT_EQ(gpt2_pretokenize("a\tb  \n c"), (Pieces{"a", "\t", "b", "  \n", " c"}));
  EXPECT_EQ(gpt2_pretokenize(" 42.5%"), (Pieces{" 42", ".", "5", "%"}));
  EXPECT_EQ(gpt2_pretokenize("abc123def"), (Pieces{"abc", "123", "def"}));
  EXPECT_EQ(gpt2_pretokenize("x!'s"), (Pieces{"x", "!'", "s"}));
  EXPECT_EQ(gpt2_pretokenize("hi   "), (Pieces{"hi", "   "}));
  EXPECT_EQ(gpt2_pretokenize("  hi"), (Pieces{" ", " hi"}));
  EXPECT_EQ(gpt2_pretokenize(""), Pieces{});
  EXPECT_EQ(gpt2_pretokenize(" "), Pieces{" "});
}

TEST(TrainGpt2, PretokenizeUnicode) {
  // é, ö are letters (Ll); CJK ideographs are letters (Lo); ① and ② are numbers (No) and join
  // the digit 3 (Nd) in one \p{N} run.
  EXPECT_EQ(gpt2_pretokenize("héllo wörld 日本語 ①②3"),
            (Pieces{"héllo", " wörld", " 日本語", " ①②3"}));
  // U+00A0 (no-break space) is whitespace but not ' ', so it never leads a word.
  EXPECT_EQ(gpt2_pretokenize("a\u00a0b"), (Pieces{"a", "\u00a0", "b"}));
  // An em dash (Pd) and a euro sign (Sc) are "other".
  EXPECT_EQ(gpt2_pretokenize("x\u2014\u20ac5"), (Pieces{"x", "\u2014\u20ac", "5"}));
  // Bytes that are not UTF-8 count as "other" characters, one each.
  EXPECT_EQ(gpt2_pretokenize("ab\xff\xfe cd"), (Pieces{"ab", "\xff\xfe", " cd"}));
  // A 4-byte character (U+1F600, a symbol) and a truncated 3-byte sequence.
  EXPECT_EQ(gpt2_pretokenize("\xF0\x9F\x98\x80!\xE6\x97"), (Pieces{"\xF0\x9F\x98\x80!\xE6\x97"}));
}

// The test vocabulary: the 256 byte symbols with id = byte value, then one id per merge in
// vocab.bpe order (256, 257, ...), then "<|endoftext|>" = 266.
//   rank 0 "h e"      -> "he"       256
//   rank 1 "l l"      -> "ll"       257
//   rank 2 "he ll"    -> "hell"     258
//   rank 3 "Ġ w"      -> "Ġw"       259
//   rank 4 "o r"      -> "or"       260
//   rank 5 "Ġw or"    -> "Ġwor"     261
//   rank 6 "l d"      -> "ld"       262
//   rank 7 "hell o"   -> "hello"    263
//   rank 8 "Ġwor ld"  -> "Ġworld"   264
//   rank 9 "a a"      -> "aa"       265
const char* kMerges =
    "#version: 0.2\n"
    "h e\nl l\nhe ll\n\xC4\xA0 w\no r\n\xC4\xA0w or\nl d\nhell o\n\xC4\xA0wor ld\na a\n";

std::string test_encoder_json() {
  nlohmann::json json = nlohmann::json::object();
  const std::vector<std::string>& table = gpt2_byte_to_unicode();
  for (int b = 0; b < 256; ++b) json[table[b]] = b;
  const char* merged[] = {"he",          "ll", "hell",  "\xC4\xA0w",     "or",
                          "\xC4\xA0wor", "ld", "hello", "\xC4\xA0world", "aa"};
  for (int i = 0; i < 10; ++i) json[merged[i]] = 256 + i;
  json["<|endoftext|>"] = 266;
  return json.dump();
}

Gpt2Tokenizer test_tokenizer() { return Gpt2Tokenizer::from_strings(test_encoder_json(), kMerges); }

TEST(TrainGpt2, MergesByRank) {
  Gpt2Tokenizer tokenizer = test_tokenizer();
  EXPECT_EQ(tokenizer.vocab_size(), 267);
  // "hello": h e l l o -> "h e" (rank 0) -> he l l o -> "l l" (1) -> he ll o -> "he ll" (2)
  //   -> hell o -> "hell o" (7) -> hello = 263.
  // " world": Ġ w o r l d -> "Ġ w" (3) -> Ġw o r l d -> "o r" (4) -> Ġw or l d -> "Ġw or" (5)
  //   -> Ġwor l d -> "l d" (6) -> Ġwor ld -> "Ġwor ld" (8) -> Ġworld = 264.
  EXPECT_EQ(tokenizer.encode("hello world"), (std::vector<int32_t>{263, 264}));
  EXPECT_EQ(tokenizer.bpe(" world"), (Pieces{"\xC4\xA0world"}));
  // "helo": h e l o -> he l o, then no pair has a rank: he=256, l=108, o=111.
  EXPECT_EQ(tokenizer.encode("helo"), (std::vector<int32_t>{256, 108, 111}));
  // " Hello": Ġ H e l l o; "h e" does not apply to "H e"; only "l l" does:
  //   Ġ=32 H=72 e=101 ll=257 o=111.
  EXPECT_EQ(tokenizer.encode(" Hello"), (std::vector<int32_t>{32, 72, 101, 257, 111}));
  // "aaaaa": every "a a" pair merges left to right without overlap: aa aa a = 265 265 97.
  EXPECT_EQ(tokenizer.encode("aaaaa"), (std::vector<int32_t>{265, 265, 97}));
  // "world" (no space): w o r l d -> w or l d -> w or ld; "w or" is no merge: 119 260 262.
  EXPECT_EQ(tokenizer.encode("world"), (std::vector<int32_t>{119, 260, 262}));
  // Pre-tokens "hello", " world", "\n", "helo", " aaaaa" (Ġ aa aa a = 32 265 265 97).
  EXPECT_EQ(tokenizer.encode("hello world\nhelo aaaaa"),
            (std::vector<int32_t>{263, 264, 10, 256, 108, 111, 32, 265, 265, 97}));
  // "é" is UTF-8 C3 A9: two byte symbols, ids 195 and 169.
  EXPECT_EQ(tokenizer.encode("\xC3\xA9"), (std::vector<int32_t>{195, 169}));
}

TEST(TrainGpt2, Decodes) {
  Gpt2Tokenizer tokenizer = test_tokenizer();
  EXPECT_EQ(tokenizer.decode({263, 264}), "hello world");
  EXPECT_EQ(tokenizer.decode({256, 257, 10, 32, 265}), "hell\n aa");
  EXPECT_EQ(tokenizer.decode({195, 169}), "\xC3\xA9");
  EXPECT_EQ(tokenizer.token_id("<|endoftext|>"), 266);
  EXPECT_EQ(tokenizer.decode({263, 266}), "hello<|endoftext|>");
  std::string message = error_of([&] { tokenizer.decode({263, 999}); });
  EXPECT_NE(message.find("token 999 at position 1"), std::string::npos) << message;
  message = error_of([&] { tokenizer.token_id("<|pad|>"); });
  EXPECT_NE(message.find("<|pad|>"), std::string::npos) << message;
}

TEST(TrainGpt2, RoundTripsArbitraryText) {
  Gpt2Tokenizer tokenizer = test_tokenizer();
  std::mt19937_64 rng(17);
  // Code points from several ranges: ASCII, Latin-1, Greek, CJK, emoji, whitespace kinds.
  const uint32_t starts[] = {0x20, 0x09, 0xA0, 0x391, 0x4E00, 0x1F600, 0x2000, 0x660};
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    int length = static_cast<int>(rng() % 40);
    for (int i = 0; i < length; ++i) {
      uint32_t cp = starts[rng() % 8] + static_cast<uint32_t>(rng() % 96);
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
      if (cp < 0x80) {
        text += char(cp);
      } else if (cp < 0x800) {
        text += char(0xC0 | (cp >> 6));
        text += char(0x80 | (cp & 0x3F));
      } else if (cp < 0x10000) {
        text += char(0xE0 | (cp >> 12));
        text += char(0x80 | ((cp >> 6) & 0x3F));
        text += char(0x80 | (cp & 0x3F));
      } else {
        text += char(0xF0 | (cp >> 18));
        text += char(0x80 | ((cp >> 12) & 0x3F));
        text += char(0x80 | ((cp >> 6) & 0x3F));
        text += char(0x80 | (cp & 0x3F));
      }
      if (rng() % 10 == 0) text += "hello world's aa ";
    }
    std::string joined;
    for (const std::string& piece : gpt2_pretokenize(text)) joined += piece;
    ASSERT_EQ(joined, text);
    ASSERT_EQ(tokenizer.decode(tokenizer.encode(text)), text) << "trial " << trial;
  }
  // Any bytes at all, including invalid UTF-8.
  for (int trial = 0; trial < 200; ++trial) {
    std::string bytes(rng() % 50, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() % 256);
    ASSERT_EQ(tokenizer.decode(tokenizer.encode(bytes)), bytes) << "trial " << trial;
  }
  std::string corpus = read_text_file(kDefaultTextPath);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(corpus)), corpus);
}

TEST(TrainGpt2, LoadsFromFilesAndReportsBadInput) {
  TempDir dir;
  write_bytes(dir.file("encoder.json"), test_encoder_json());
  write_bytes(dir.file("vocab.bpe"), kMerges);
  Gpt2Tokenizer tokenizer =
      Gpt2Tokenizer::from_files(dir.file("encoder.json"), dir.file("vocab.bpe"));
  EXPECT_EQ(tokenizer.encode("hello world"), (std::vector<int32_t>{263, 264}));

  write_bytes(dir.file("bad.bpe"), "#version: 0.2\nh e\nabc\n");
  std::string message =
      error_of([&] { Gpt2Tokenizer::from_files(dir.file("encoder.json"), dir.file("bad.bpe")); });
  EXPECT_NE(message.find(dir.file("bad.bpe")), std::string::npos) << message;
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;

  write_bytes(dir.file("bad.json"), "{\"a\": 1,");
  message =
      error_of([&] { Gpt2Tokenizer::from_files(dir.file("bad.json"), dir.file("vocab.bpe")); });
  EXPECT_NE(message.find(dir.file("bad.json")), std::string::npos) << message;
  EXPECT_NE(message.find("not valid JSON"), std::string::npos) << message;

  message = error_of([] { Gpt2Tokenizer::from_strings(R"({"a": 1, "b": 1})", ""); });
  EXPECT_NE(message.find("id 1"), std::string::npos) << message;
  message = error_of([] { Gpt2Tokenizer::from_strings(R"({"a": -1})", ""); });
  EXPECT_NE(message.find("\"a\""), std::string::npos) << message;
  message =
      error_of([&] { Gpt2Tokenizer::from_files(dir.file("missing.json"), dir.file("vocab.bpe")); });
  EXPECT_NE(message.find("missing.json"), std::string::npos) << message;

  // A vocabulary without the byte symbols cannot encode what it lacks.
  Gpt2Tokenizer tiny = Gpt2Tokenizer::from_strings(R"({"h": 0, "i": 1, "hi": 2})", "h i\n");
  EXPECT_EQ(tiny.encode("hi"), (std::vector<int32_t>{2}));
  message = error_of([&] { tiny.encode("hi!"); });
  EXPECT_NE(message.find("\"!\""), std::string::npos) << message;
}

}  // namespace
}  // namespace kiln::train
