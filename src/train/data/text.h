// Text datasets for language models: tokenizers that turn text into a token stream
// (std::vector<int32_t>), a binary token file format for pre-tokenized corpora, and the
// TokenBatcher that cuts a stream into (B, T) inputs and next-token targets.
//
// Tokenizers:
//   ByteTokenizer   vocab 256, token = byte. Needs no files; any byte string round-trips.
//   Gpt2Tokenizer   GPT-2's byte-level BPE from its encoder.json + vocab.bpe: bytes map to
//                   printable code points (bytes_to_unicode), text splits into pre-tokens by
//                   GPT-2's regex (written here by hand), and each pre-token is merged by rank.
//
// Token files (.tok), little-endian, a 24-byte header then the tokens:
//   bytes 0..7    magic "KILNTOK1"
//   bytes 8..11   uint32 bytes per token: 2 (uint16 tokens, vocabularies up to 65,536 such as
//                 GPT-2's 50,257) or 4 (uint32 tokens)
//   bytes 12..15  uint32 reserved, 0
//   bytes 16..23  uint64 number of tokens
//   bytes 24..    the tokens
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "train/data/dataset.h"

namespace kiln::train {

// A plain-text corpus present on every Debian 12 system (package base-files): the default
// text dataset for examples and tests.
inline constexpr const char* kDefaultTextPath = "/usr/share/common-licenses/GPL-3";

// The whole file as bytes; throws kiln::Error naming the file when it cannot be read.
std::string read_text_file(const std::string& path);

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;
  std::vector<int32_t> encode(std::string_view text) const;
  // Throws kiln::Error for a token outside [0, 256).
  std::string decode(const std::vector<int32_t>& tokens) const;
};

// GPT-2's byte -> code point table: printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') map
// to themselves, the other 68 bytes in order to U+0100, U+0101, ... (so ' ' is U+0120 'Ġ').
// Returned as the UTF-8 text of each code point.
const std::vector<std::string>& gpt2_byte_to_unicode();

// GPT-2's pre-tokenization, the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// as a hand-written scanner over UTF-8 (bytes that are not valid UTF-8 count as "other"
// characters). Concatenating the pieces gives back `text`.
std::vector<std::string> gpt2_pretokenize(std::string_view text);

class Gpt2Tokenizer {
 public:
  // encoder.json: {"token text": id, ...}; vocab.bpe: an optional "#version" line, then one
  // merge "left right" per line, highest priority first. Throws kiln::Error naming the file
  // and line for malformed input.
  static Gpt2Tokenizer from_files(const std::string& encoder_json_path,
                                  const std::string& vocab_bpe_path);
  static Gpt2Tokenizer from_strings(std::string_view encoder_json, std::string_view vocab_bpe);

  std::vector<int32_t> encode(std::string_view text) const;
  // Throws kiln::Error for an id not in the vocabulary.
  std::string decode(const std::vector<int32_t>& tokens) const;
  // BPE of one pre-token (its symbols after merging, as byte-unicode text).
  std::vector<std::string> bpe(std::string_view pretoken) const;

  int64_t vocab_size() const { return static_cast<int64_t>(decoder_.size()); }
  // The id of a vocabulary entry, e.g. "<|endoftext|>"; throws kiln::Error when absent.
  int32_t token_id(const std::string& token) const;

 private:
  // Error messages name the sources: the files' paths, or "the given encoder.json" and so on.
  static Gpt2Tokenizer parse(std::string_view encoder_json, const std::string& encoder_source,
                             std::string_view vocab_bpe, const std::string& vocab_source);

  std::unordered_map<std::string, int32_t> encoder_;
  std::unordered_map<int32_t, std::string> decoder_;
  std::unordered_map<std::string, int> ranks_;  // "left right" -> merge rank
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
};

// Token files (format in the header comment above). `bytes_per_token` 0 picks 2 when every
// token is below 65,536, else 4. Writes are plain (not atomic). Reading throws kiln::Error
// naming the file for a bad magic, a bad width, or a length that disagrees with the count.
void write_token_file(const std::string& path, const std::vector<int32_t>& tokens,
                      int bytes_per_token = 0);
std::vector<int32_t> read_token_file(const std::string& path);

// Cuts a token stream into language-model batches: inputs (B, T) i64 and targets (B, T) i64,
// targets[b][t] = the token after inputs[b][t].
class TokenBatcher {
 public:
  TokenBatcher(std::shared_ptr<const std::vector<int32_t>> tokens, int64_t batch_size,
               int64_t sequence_length);
  TokenBatcher(std::vector<int32_t> tokens, int64_t batch_size, int64_t sequence_length);

  int64_t batch_size() const { return batch_size_; }
  int64_t sequence_length() const { return sequence_length_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_->size()); }

  // B windows at random offsets in [0, num_tokens - T - 1], drawn by std::mt19937_64 seeded
  // from (seed, step): deterministic, and any step can be made out of order.
  Batch random_batch(uint64_t seed, int64_t step) const;
  // Sequential batches cover the stream in order, like llm.c's loader: batch i holds rows
  // starting at tokens (i*B + b) * T. There are (num_tokens - 1) / (B*T) of them.
  int64_t num_sequential_batches() const;
  Batch sequential_batch(int64_t index) const;
  // The batch of window offsets given (each in [0, num_tokens - T - 1]).
  Batch batch_at(const std::vector<int64_t>& offsets) const;

 private:
  std::shared_ptr<const std::vector<int32_t>> tokens_;
  int64_t batch_size_;
  int64_t sequence_length_;
};

}  // namespace kiln::train
