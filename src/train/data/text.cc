// Tokenizers (byte-level and GPT-2 BPE), token files and LM batches (see text.h). The GPT-2
// pre-tokenizer is a hand-written scanner equivalent to GPT-2's regex, using the Unicode tables
// of unicode_tables.cc; it was checked against the Python `regex` module on all code points
// assigned in Unicode 14.
#include "train/data/text.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "train/data/unicode_tables.h"

namespace kiln::train {

namespace unicode {
namespace {
bool in_ranges(const CodePointRange* ranges, size_t size, uint32_t cp) {
  const CodePointRange* end = ranges + size;
  // The first range whose last >= cp; cp is inside iff that range starts at or before it.
  const CodePointRange* it = std::lower_bound(
      ranges, end, cp, [](const CodePointRange& r, uint32_t c) { return r.last < c; });
  return it != end && it->first <= cp;
}
}  // namespace

bool is_letter(uint32_t cp) { return in_ranges(kLetterRanges, kLetterRangesSize, cp); }
bool is_number(uint32_t cp) { return in_ranges(kNumberRanges, kNumberRangesSize, cp); }
bool is_whitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}
}  // namespace unicode

namespace {

constexpr uint32_t kInvalidCodePoint = 0xFFFFFFFFu;

// Decodes one UTF-8 character at text[pos]: {code point, length}. A byte that does not start
// a valid, shortest-form sequence decodes as {kInvalidCodePoint, 1}, so any byte string scans.
std::pair<uint32_t, size_t> decode_utf8(std::string_view text, size_t pos) {
  auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  uint8_t b0 = byte(pos);
  if (b0 < 0x80) return {b0, 1};
  size_t length;
  uint32_t cp, min;
  if ((b0 & 0xE0) == 0xC0)
    length = 2, cp = b0 & 0x1F, min = 0x80;
  else if ((b0 & 0xF0) == 0xE0)
    length = 3, cp = b0 & 0x0F, min = 0x800;
  else if ((b0 & 0xF8) == 0xF0)
    length = 4, cp = b0 & 0x07, min = 0x10000;
  else
    return {kInvalidCodePoint, 1};
  if (pos + length > text.size()) return {kInvalidCodePoint, 1};
  for (size_t i = 1; i < length; ++i) {
    uint8_t b = byte(pos + i);
    if ((b & 0xC0) != 0x80) return {kInvalidCodePoint, 1};
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {kInvalidCodePoint, 1};
  return {cp, length};
}

std::string encode_utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
  return out;
}

enum class CharClass { kLetter, kNumber, kSpace, kOther };

CharClass classify(uint32_t cp) {
  if (cp == kInvalidCodePoint) return CharClass::kOther;
  if (unicode::is_whitespace(cp)) return CharClass::kSpace;
  if (unicode::is_letter(cp)) return CharClass::kLetter;
  if (unicode::is_number(cp)) return CharClass::kNumber;
  return CharClass::kOther;
}

struct Char {
  uint32_t code_point;
  size_t offset;  // byte offset in the text
  CharClass cls;
};

std::string read_file_or_fail(const std::string& path, const char* what) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) fail("{}: cannot open '{}': {}", what, path, std::strerror(errno));
  std::string out;
  char buffer[1 << 16];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, file)) > 0) out.append(buffer, n);
  bool failed = std::ferror(file);
  std::fclose(file);
  KILN_CHECK(!failed, "{}: error reading '{}'", what, path);
  return out;
}

void put_le(std::string& out, uint64_t value, int size) {
  for (int i = 0; i < size; ++i) out += char(uint8_t(value >> (8 * i)));
}

uint64_t get_le(const char* p, int size) {
  uint64_t v = 0;
  for (int i = size - 1; i >= 0; --i) v = (v << 8) | uint8_t(p[i]);
  return v;
}

constexpr char kTokenMagic[8] = {'K', 'I', 'L', 'N', 'T', 'O', 'K', '1'};
constexpr size_t kTokenHeaderBytes = 24;

}  // namespace

std::string read_text_file(const std::string& path) { return read_file_or_fail(path, "text"); }

// ---- Byte tokenizer ---------------------------------------------------------------------------

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<uint8_t>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& tokens) const {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    KILN_CHECK(tokens[i] >= 0 && tokens[i] < kVocabSize,
               "byte tokenizer: token {} at position {} is outside the vocabulary [0, 256)",
               tokens[i], i);
    out[i] = static_cast<char>(tokens[i]);
  }
  return out;
}

// ---- GPT-2 BPE --------------------------------------------------------------------------------

const std::vector<std::string>& gpt2_byte_to_unicode() {
  static const std::vector<std::string> kTable = [] {
    std::vector<std::string> table(256);
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) table[b] = encode_utf8(printable(b) ? uint32_t(b) : next++);
    return table;
  }();
  return kTable;
}

std::vector<std::string> gpt2_pretokenize(std::string_view text) {
  std::vector<Char> chars;
  for (size_t pos = 0; pos < text.size();) {
    auto [cp, length] = decode_utf8(text, pos);
    chars.push_back({cp, pos, classify(cp)});
    pos += length;
  }
  size_t n = chars.size();
  auto offset = [&](size_t i) { return i < n ? chars[i].offset : text.size(); };
  auto ascii_at = [&](size_t i, char c) { return i < n && chars[i].code_point == uint32_t(c); };

  std::vector<std::string> pieces;
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, as in GPT-2)
    if (ascii_at(i, '\'')) {
      if (ascii_at(i + 1, 's') || ascii_at(i + 1, 't') || ascii_at(i + 1, 'm') ||
          ascii_at(i + 1, 'd'))
        end = i + 2;
      else if ((ascii_at(i + 1, 'r') && ascii_at(i + 2, 'e')) ||
               (ascii_at(i + 1, 'v') && ascii_at(i + 2, 'e')) ||
               (ascii_at(i + 1, 'l') && ascii_at(i + 2, 'l')))
        end = i + 3;
    }
    if (end == i) {
      // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional space, then a run of one
      // class. A space followed by a space falls through to the whitespace rules.
      size_t start = ascii_at(i, ' ') && i + 1 < n ? i + 1 : i;
      CharClass cls = chars[start].cls;
      if (cls != CharClass::kSpace) {
        end = start;
        while (end < n && chars[end].cls == cls) ++end;
      }
    }
    if (end == i) {
      // '\s+(?!\S)' then '\s+': a whitespace run, less its last character when a non-space
      // follows (that character then leads the next piece, e.g. " world"); a lone space
      // character before a non-space is taken by '\s+' on its own.
      end = i;
      while (end < n && chars[end].cls == CharClass::kSpace) ++end;
      if (end < n && end - i >= 2) --end;
    }
    pieces.emplace_back(text.substr(offset(i), offset(end) - offset(i)));
    i = end;
  }
  return pieces;
}

Gpt2Tokenizer Gpt2Tokenizer::from_files(const std::string& encoder_json_path,
                                        const std::string& vocab_bpe_path) {
  std::string encoder = read_file_or_fail(encoder_json_path, "gpt2 tokenizer");
  std::string merges = read_file_or_fail(vocab_bpe_path, "gpt2 tokenizer");
  return parse(encoder, "'" + encoder_json_path + "'", merges, "'" + vocab_bpe_path + "'");
}

Gpt2Tokenizer Gpt2Tokenizer::from_strings(std::string_view encoder_json,
                                          std::string_view vocab_bpe) {
  return parse(encoder_json, "the given encoder.json", vocab_bpe, "the given vocab.bpe");
}

Gpt2Tokenizer Gpt2Tokenizer::parse(std::string_view encoder_json, const std::string& encoder_source,
                                   std::string_view vocab_bpe, const std::string& vocab_source) {
  const std::string& source = encoder_source;
  Gpt2Tokenizer t;
  const std::vector<std::string>& byte_to_unicode = gpt2_byte_to_unicode();
  for (int b = 0; b < 256; ++b) t.unicode_to_byte_[byte_to_unicode[b]] = uint8_t(b);

  nlohmann::json json = nlohmann::json::parse(encoder_json, nullptr, /*allow_exceptions=*/false);
  KILN_CHECK(!json.is_discarded(), "gpt2 tokenizer: {} is not valid JSON", source);
  KILN_CHECK(json.is_object(), "gpt2 tokenizer: {} must be an object {{\"token\": id}}, got {}",
             source, json.type_name());
  for (auto& [token, id] : json.items()) {
    KILN_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                   id.get<int64_t>() <= std::numeric_limits<int32_t>::max(),
               "gpt2 tokenizer: {}: the id of \"{}\" must be an integer in "
               "[0, 2^31), got {}",
               source, token, id.dump());
    int32_t value = static_cast<int32_t>(id.get<int64_t>());
    auto [it, inserted] = t.decoder_.emplace(value, token);
    KILN_CHECK(inserted,
               "gpt2 tokenizer: {}: id {} is given to both \"{}\" "
               "and \"{}\"",
               source, value, it->second, token);
    t.encoder_[token] = value;
  }

  int rank = 0, line_number = 0;
  size_t pos = 0;
  while (pos < vocab_bpe.size()) {
    size_t newline = vocab_bpe.find('\n', pos);
    if (newline == std::string_view::npos) newline = vocab_bpe.size();
    std::string_view line = vocab_bpe.substr(pos, newline - pos);
    pos = newline + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_number == 1 && line.starts_with("#version"))) continue;
    size_t space = line.find(' ');
    KILN_CHECK(space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                   line.find(' ', space + 1) == std::string_view::npos,
               "gpt2 tokenizer: {} line {}: expected a merge \"left right\", got \"{}\"",
               vocab_source, line_number, line);
    t.ranks_.emplace(std::string(line), rank++);  // the first listing of a pair wins
  }
  return t;
}

std::vector<std::string> Gpt2Tokenizer::bpe(std::string_view pretoken) const {
  const std::vector<std::string>& byte_to_unicode = gpt2_byte_to_unicode();
  std::vector<std::string> word;
  for (char c : pretoken) word.push_back(byte_to_unicode[static_cast<uint8_t>(c)]);
  while (word.size() > 1) {
    // The adjacent pair with the lowest merge rank (the earliest line of vocab.bpe).
    int best_rank = std::numeric_limits<int>::max();
    size_t best = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto it = ranks_.find(word[i] + " " + word[i + 1]);
      if (it != ranks_.end() && it->second < best_rank) best_rank = it->second, best = i;
    }
    if (best_rank == std::numeric_limits<int>::max()) break;
    // Merge every occurrence of that pair, left to right, without overlap.
    std::string first = word[best], second = word[best + 1];
    std::vector<std::string> merged;
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(word[i++]);
      }
    }
    word = std::move(merged);
  }
  return word;
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> tokens;
  // Text repeats words; remembering each pre-token's ids within this call saves most merges.
  std::unordered_map<std::string, std::vector<int32_t>> cache;
  for (const std::string& piece : gpt2_pretokenize(text)) {
    auto cached = cache.find(piece);
    if (cached == cache.end()) {
      std::vector<int32_t> ids;
      for (const std::string& symbol : bpe(piece)) {
        auto it = encoder_.find(symbol);
        KILN_CHECK(it != encoder_.end(),
                   "gpt2 tokenizer: \"{}\" (from the text \"{}\") is not in encoder.json; a "
                   "byte-level vocabulary must hold all 256 byte symbols and every merge result",
                   symbol, piece);
        ids.push_back(it->second);
      }
      cached = cache.emplace(piece, std::move(ids)).first;
    }
    tokens.insert(tokens.end(), cached->second.begin(), cached->second.end());
  }
  return tokens;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& tokens) const {
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    auto it = decoder_.find(tokens[i]);
    KILN_CHECK(it != decoder_.end(),
               "gpt2 tokenizer: token {} at position {} is not in the vocabulary", tokens[i], i);
    const std::string& text = it->second;
    for (size_t pos = 0; pos < text.size();) {
      auto [cp, length] = decode_utf8(text, pos);
      auto byte = unicode_to_byte_.find(text.substr(pos, length));
      KILN_CHECK(cp != kInvalidCodePoint && byte != unicode_to_byte_.end(),
                 "gpt2 tokenizer: token {} (\"{}\") holds a character that is not one of the "
                 "256 byte symbols",
                 tokens[i], text);
      out += static_cast<char>(byte->second);
      pos += length;
    }
  }
  return out;
}

int32_t Gpt2Tokenizer::token_id(const std::string& token) const {
  auto it = encoder_.find(token);
  KILN_CHECK(it != encoder_.end(), "gpt2 tokenizer: \"{}\" is not in the vocabulary", token);
  return it->second;
}

// ---- Token files ------------------------------------------------------------------------------

void write_token_file(const std::string& path, const std::vector<int32_t>& tokens,
                      int bytes_per_token) {
  int32_t max_token = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    KILN_CHECK(tokens[i] >= 0, "token file: token {} at position {} is negative", tokens[i], i);
    max_token = std::max(max_token, tokens[i]);
  }
  if (bytes_per_token == 0) bytes_per_token = max_token < 65536 ? 2 : 4;
  KILN_CHECK(bytes_per_token == 2 || bytes_per_token == 4,
             "token file: bytes per token must be 2 or 4, got {}", bytes_per_token);
  KILN_CHECK(bytes_per_token == 4 || max_token < 65536,
             "token file: token {} does not fit 2 bytes per token; use 4", max_token);
  std::string out(kTokenMagic, sizeof kTokenMagic);
  put_le(out, uint64_t(bytes_per_token), 4);
  put_le(out, 0, 4);
  put_le(out, tokens.size(), 8);
  out.reserve(out.size() + tokens.size() * bytes_per_token);
  for (int32_t token : tokens) put_le(out, uint64_t(token), bytes_per_token);

  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (!file) fail("token file: cannot create '{}': {}", path, std::strerror(errno));
  size_t written = std::fwrite(out.data(), 1, out.size(), file);
  bool closed = std::fclose(file) == 0;
  KILN_CHECK(written == out.size() && closed, "token file: cannot write '{}': {}", path,
             std::strerror(errno));
}

std::vector<int32_t> read_token_file(const std::string& path) {
  std::string bytes = read_file_or_fail(path, "token file");
  KILN_CHECK(bytes.size() >= kTokenHeaderBytes,
             "token file: '{}' is {} bytes, shorter than the {}-byte header", path, bytes.size(),
             kTokenHeaderBytes);
  KILN_CHECK(std::memcmp(bytes.data(), kTokenMagic, sizeof kTokenMagic) == 0,
             "token file: '{}' does not start with the magic \"KILNTOK1\"", path);
  uint64_t width = get_le(bytes.data() + 8, 4);
  uint64_t count = get_le(bytes.data() + 16, 8);
  KILN_CHECK(width == 2 || width == 4, "token file: '{}' says {} bytes per token, expected 2 or 4",
             path, width);
  uint64_t payload = bytes.size() - kTokenHeaderBytes;
  KILN_CHECK(count <= payload / width && count * width == payload,
             "token file: '{}' says {} tokens of {} bytes ({} bytes) but holds {} bytes of tokens",
             path, count, width, count <= payload ? std::to_string(count * width) : "too many",
             payload);
  std::vector<int32_t> tokens(count);
  const char* data = bytes.data() + kTokenHeaderBytes;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t v = get_le(data + i * width, int(width));
    KILN_CHECK(v <= uint64_t(std::numeric_limits<int32_t>::max()),
               "token file: '{}' token {} is {}, beyond int32", path, i, v);
    tokens[i] = static_cast<int32_t>(v);
  }
  return tokens;
}

// ---- LM batches -------------------------------------------------------------------------------

TokenBatcher::TokenBatcher(std::shared_ptr<const std::vector<int32_t>> tokens, int64_t batch_size,
                           int64_t sequence_length)
    : tokens_(std::move(tokens)), batch_size_(batch_size), sequence_length_(sequence_length) {
  KILN_CHECK(tokens_ != nullptr, "token batcher: no token stream given");
  KILN_CHECK(batch_size_ > 0 && sequence_length_ > 0,
             "token batcher: B and T must be positive, got B={} T={}", batch_size_,
             sequence_length_);
  KILN_CHECK(num_tokens() >= sequence_length_ + 1,
             "token batcher: {} tokens are too few for one window of T={} inputs plus the next "
             "token",
             num_tokens(), sequence_length_);
}

TokenBatcher::TokenBatcher(std::vector<int32_t> tokens, int64_t batch_size, int64_t sequence_length)
    : TokenBatcher(std::make_shared<const std::vector<int32_t>>(std::move(tokens)), batch_size,
                   sequence_length) {}

Batch TokenBatcher::batch_at(const std::vector<int64_t>& offsets) const {
  KILN_CHECK(static_cast<int64_t>(offsets.size()) == batch_size_,
             "token batcher: {} offsets given for B={}", offsets.size(), batch_size_);
  int64_t b_count = batch_size_, t_count = sequence_length_;
  Batch batch{Tensor(TensorType{DType::kI64, {b_count, t_count}}),
              Tensor(TensorType{DType::kI64, {b_count, t_count}})};
  int64_t* inputs = batch.inputs.data<int64_t>();
  int64_t* targets = batch.targets.data<int64_t>();
  const int32_t* tokens = tokens_->data();
  for (int64_t b = 0; b < b_count; ++b) {
    int64_t start = offsets[b];
    KILN_CHECK(start >= 0 && start + t_count + 1 <= num_tokens(),
               "token batcher: window offset {} is outside [0, {}] for T={} and {} tokens", start,
               num_tokens() - t_count - 1, t_count, num_tokens());
    for (int64_t t = 0; t < t_count; ++t) {
      inputs[b * t_count + t] = tokens[start + t];
      targets[b * t_count + t] = tokens[start + t + 1];
    }
  }
  return batch;
}

Batch TokenBatcher::random_batch(uint64_t seed, int64_t step) const {
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), uint32_t(uint64_t(step)),
                    uint32_t(uint64_t(step) >> 32)};
  std::mt19937_64 rng(seq);
  uint64_t windows = uint64_t(num_tokens() - sequence_length_);  // offsets 0 .. N-T-1
  std::vector<int64_t> offsets(batch_size_);
  for (int64_t& offset : offsets) offset = static_cast<int64_t>(uniform_below(rng, windows));
  return batch_at(offsets);
}

int64_t TokenBatcher::num_sequential_batches() const {
  return (num_tokens() - 1) / (batch_size_ * sequence_length_);
}

Batch TokenBatcher::sequential_batch(int64_t index) const {
  KILN_CHECK(index >= 0 && index < num_sequential_batches(),
             "token batcher: sequential batch {} is outside the {} batches of B={} T={} in {} "
             "tokens",
             index, num_sequential_batches(), batch_size_, sequence_length_, num_tokens());
  std::vector<int64_t> offsets(batch_size_);
  for (int64_t b = 0; b < batch_size_; ++b)
    offsets[b] = (index * batch_size_ + b) * sequence_length_;
  return batch_at(offsets);
}

}  // namespace kiln::train
