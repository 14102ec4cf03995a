// Fuzzes the IR parser with ~3,000 deterministic mutations of valid graphs (character edits,
// token swaps, number changes, truncation, duplicated and dropped lines). Every mutant must
// either parse, verify, print and re-parse to the same text, or throw kiln::Error; a crash or
// any other exception fails. Run it under -DKILN_SANITIZE=ON to catch memory errors too.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "ir/text.h"
#include "ir/verifier.h"
#include "support/error.h"

namespace kiln {
namespace {

// Valid graphs covering many ops, attribute kinds and syntax forms.
const std::array<std::string_view, 6> kSeeds = {
    "graph @mlp(%x: f32[8,784] data, %w1: f32[784,128] param, %b1: f32[128] param, %step: i64[] "
    "state) {\n"
    "  %0 = matmul(%x, %w1) : f32[8,128]\n"
    "  %1 = add(%0, %b1) : f32[8,128]\n"
    "  %h = gelu(%1) {approximate=\"tanh\"} : f32[8,128]\n"
    "  %2, %3 = split(%h) {axis=1, sizes=[64, 64]} : f32[8,64], f32[8,64]\n"
    "  %c = full() {dtype=f32, shape=[2, 3], value=0.5} : f32[2,3]\n"
    "  return %2, %3\n"
    "}\n",

    "graph @block.0-test(%x: f32[2,4,8] data, %g: f32[8] param, %b: f32[8] param, %wqkv: "
    "f32[8,24] param, %labels: i64[2,4] data, %seed: i64[] state) {\n"
    "  %0 = layer_norm(%x, %g, %b) {epsilon=0.001} : f32[2,4,8]\n"
    "  %1 = matmul(%0, %wqkv) : f32[2,4,24]\n"
    "  %q, %k, %v = split(%1) {axis=2, sizes=[8, 8, 8]} : f32[2,4,8], f32[2,4,8], f32[2,4,8]\n"
    "  %2, %lse = attention(%q, %k, %v) {causal=true, scale=0.125} : f32[2,4,8], f32[2,4]\n"
    "  %3 = dropout(%2, %seed) {p=0.25, seed=42} : f32[2,4,8]\n"
    "  %res = add(%x, %3) : f32[2,4,8]\n"
    "  %4 = rms_norm(%res, %g) : f32[2,4,8]\n"
    "  %loss = cross_entropy(%4, %labels) {ignore_index=0, reduction=\"sum\"} : f32[]\n"
    "  return %loss, %res\n"
    "}\n",

    "graph @misc(%a: i32[3,1] data, %b: i32[4] data, %t: bf16[10,6] param, %i: i64[5] data) {\n"
    "  %0 = lt(%a, %b) : bool[3,4]\n"
    "  %1 = cast(%a) {dtype=f32} : f32[3,1]\n"
    "  %2 = broadcast_to(%1) {shape=[3, 4]} : f32[3,4]\n"
    "  %3 = neg(%2) : f32[3,4]\n"
    "  %4 = where(%0, %2, %3) : f32[3,4]\n"
    "  %5 = transpose(%4) {perm=[1, 0]} : f32[4,3]\n"
    "  %6 = reshape(%5) {shape=[2, -1]} : f32[2,6]\n"
    "  %7 = gather(%t, %i) : bf16[5,6]\n"
    "  %8 = iota() {dtype=i64, shape=[4]} : i64[4]\n"
    "  %9 = argmax(%7) {keepdims=true} : i64[5,1]\n"
    "  %10 = sum(%6) {axes=[0, 1]} : f32[]\n"
    "  %11 = slice(%6) {ends=[2, 5], starts=[0, 1], steps=[1, 2]} : f32[2,2]\n"
    "  return %10, %9, %8, %11\n"
    "}\n",

    "graph @loss(%logits: f32[4,10] data, %y: i64[4] data, %e: f32[100,16] param) {\n"
    "  %0 = log_softmax(%logits) : f32[4,10]\n"
    "  %1 = one_hot(%y) {depth=10} : f32[4,10]\n"
    "  %2 = mul(%0, %1) : f32[4,10]\n"
    "  %3 = mean(%2) {axes=[1]} : f32[4]\n"
    "  %4 = max(%logits) {axes=[0]} : f32[10]\n"
    "  %5 = concat(%4, %4, %4) : f32[30]\n"
    "  %6 = gather(%e, %y) : f32[4,16]\n"
    "  %7 = scatter_add(%e, %y, %6) : f32[100,16]\n"
    "  %8 = softmax(%logits) : f32[4,10]\n"
    "  %9 = pow(%8, %8) : f32[4,10]\n"
    "  %10 = sub(%9, %8) : f32[4,10]\n"
    "  %11 = maximum(%10, %0) : f32[4,10]\n"
    "  return %3, %5, %7, %11\n"
    "}\n",

    "graph @sources(%s: f64[] state) {\n"
    "  // constants with tricky floats\n"
    "  %0 = constant() {dtype=f64, shape=[2, 3], values=[0.1, -0.0, 1e-30, inf, -inf, nan]} : "
    "f64[2,3]\n"
    "  %1 = full() {dtype=f64, shape=[], value=-2.5} : f64[]\n"
    "  %2 = mul(%1, %s) : f64[]\n"
    "  %3 = sqrt(%0) : f64[2,3]\n"
    "  %4 = exp(%3) : f64[2,3]\n"
    "  %5 = tanh(%4) : f64[2,3]\n"
    "  %6 = sigmoid(%5) : f64[2,3]\n"
    "  %7 = div(%6, %2) : f64[2,3]\n"
    "  %8 = eq(%7, %6) : bool[2,3]\n"
    "  return %7, %8\n"
    "}\n",

    "graph @train(%x: f32[4,3] data, %w: f32[3,2] param, %m: f32[3,2] state, %v: f32[3,2] state, "
    "%lr: f32[] state, %t: f32[] state, %buf: f32[2] state, %bias: f32[2] param) {\n"
    "  %y = matmul(%x, %w) : f32[4,2]\n"
    "  %0 = silu(%y) : f32[4,2]\n"
    "  %1 = matmul(%x, %0) {transpose_a=true} : f32[3,2]\n"
    "  %2, %3, %4 = optimizer_update(%w, %1, %m, %v, %lr, %t) {beta1=0.8, optimizer=\"adamw\"} : f32[3,2], "
    "f32[3,2], f32[3,2]\n"
    "  %5 = sum(%0) {axes=[0]} : f32[2]\n"
    "  %6, %7 = optimizer_update(%bias, %5, %buf, %lr, %t) {momentum=0.9, optimizer=\"sgd\"} : f32[2], f32[2]\n"
    "  update %w = %2\n"
    "  update %m = %3\n"
    "  update %v = %4\n"
    "  update %bias = %6\n"
    "  update %buf = %7\n"
    "  return %y\n"
    "}\n",
};

// splitmix64: deterministic on every platform (std:: distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(next() % n); }

 private:
  uint64_t state_;
};

// Characters that matter to the lexer, plus a few it must reject.
constexpr std::string_view kInteresting =
    "%@()[]{},:=\"\\/-.+0123456789eEafinx_ \n\t;#\x01\x7f\xff";
const std::array<std::string_view, 16> kNumbers = {"0",
                                                   "1",
                                                   "-1",
                                                   "7",
                                                   "65536",
                                                   "2147483648",
                                                   "281474976710657",
                                                   "16777216",
                                                   "9223372036854775807",
                                                   "-9223372036854775808",
                                                   "99999999999999999999",
                                                   "1e308",
                                                   "1e999",
                                                   "-0.0",
                                                   "nan",
                                                   "3.5"};

bool is_token_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-' || c == '%' || c == '@';
}

// [begin, end) of every token-ish run: a run of name characters or one other non-space char.
std::vector<std::pair<size_t, size_t>> token_spans(const std::string& s) {
  std::vector<std::pair<size_t, size_t>> spans;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == ' ' || s[i] == '\n') {
      ++i;
      continue;
    }
    size_t j = i + 1;
    if (is_token_char(s[i]))
      while (j < s.size() && is_token_char(s[j])) ++j;
    spans.emplace_back(i, j);
    i = j;
  }
  return spans;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find('\n', start);
    if (end == std::string::npos) end = s.size();
    lines.push_back(s.substr(start, end - start + 1));
    start = end + 1;
  }
  return lines;
}

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l;
  return out;
}

void mutate(std::string& s, Rng& rng) {
  switch (rng.below(10)) {
    case 0:  // delete a character
      if (!s.empty()) s.erase(rng.below(s.size()), 1);
      break;
    case 1:  // insert a character
      s.insert(rng.below(s.size() + 1), 1, kInteresting[rng.below(kInteresting.size())]);
      break;
    case 2:  // replace a character (sometimes by an arbitrary byte)
      if (!s.empty()) {
        char c = rng.below(4) == 0 ? static_cast<char>(rng.below(256))
                                   : kInteresting[rng.below(kInteresting.size())];
        s[rng.below(s.size())] = c;
      }
      break;
    case 3: {  // swap two tokens
      auto spans = token_spans(s);
      if (spans.size() < 2) break;
      auto a = spans[rng.below(spans.size())];
      auto b = spans[rng.below(spans.size())];
      if (a.first > b.first) std::swap(a, b);
      if (a.second > b.first) break;  // the same token
      std::string ta = s.substr(a.first, a.second - a.first);
      std::string tb = s.substr(b.first, b.second - b.first);
      s.replace(b.first, tb.size(), ta);
      s.replace(a.first, ta.size(), tb);
      break;
    }
    case 4: {  // change a number
      std::vector<std::pair<size_t, size_t>> numbers;
      for (auto [b, e] : token_spans(s))
        if (s[b] >= '0' && s[b] <= '9') numbers.emplace_back(b, e);
      if (numbers.empty()) break;
      auto [b, e] = numbers[rng.below(numbers.size())];
      s.replace(b, e - b, kNumbers[rng.below(kNumbers.size())]);
      break;
    }
    case 5:  // truncate
      s.resize(rng.below(s.size() + 1));
      break;
    case 6: {  // duplicate a line
      auto lines = split_lines(s);
      if (lines.empty()) break;
      size_t i = rng.below(lines.size());
      lines.insert(lines.begin() + static_cast<long>(rng.below(lines.size() + 1)), lines[i]);
      s = join(lines);
      break;
    }
    case 7: {  // drop a line
      auto lines = split_lines(s);
      if (lines.empty()) break;
      lines.erase(lines.begin() + static_cast<long>(rng.below(lines.size())));
      s = join(lines);
      break;
    }
    case 8: {  // copy a token over another (a use of a different value, another op, ...)
      auto spans = token_spans(s);
      if (spans.size() < 2) break;
      auto from = spans[rng.below(spans.size())];
      auto to = spans[rng.below(spans.size())];
      std::string token = s.substr(from.first, from.second - from.first);
      s.replace(to.first, to.second - to.first, token);
      break;
    }
    case 9: {  // layout between tokens: whitespace or a comment (should still parse)
      auto spans = token_spans(s);
      if (spans.empty()) break;
      constexpr std::array<std::string_view, 4> kLayout = {" ", "\n", "\t ", " // note\n"};
      s.insert(spans[rng.below(spans.size())].first, kLayout[rng.below(kLayout.size())]);
      break;
    }
  }
}

TEST(ParserFuzz, SeedsAreValidAndCanonical) {
  for (std::string_view seed : kSeeds) {
    // Canonical apart from comment lines, which the printer does not keep.
    std::vector<std::string> lines = split_lines(std::string(seed));
    std::erase_if(lines, [](const std::string& l) { return l.find("//") != std::string::npos; });
    EXPECT_EQ(print(parse(seed)), join(lines));
  }
}

TEST(ParserFuzz, MutantsParseOrThrowKilnError) {
  constexpr int kMutants = 3000;
  Rng rng(20240611);
  int parsed = 0;
  int rejected = 0;
  for (int n = 0; n < kMutants; ++n) {
    std::string text(kSeeds[rng.below(kSeeds.size())]);
    int edits = 1 + static_cast<int>(rng.below(3));
    for (int e = 0; e < edits; ++e) mutate(text, rng);
    try {
      Graph g = parse(text);
      verify(g);
      std::string printed = print(g);
      Graph again = parse(printed);
      EXPECT_EQ(print(again), printed) << "mutant " << n << ":\n" << text;
      ++parsed;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "mutant " << n << " threw a non-kiln exception: " << e.what() << "\n"
                    << text;
    } catch (...) {
      ADD_FAILURE() << "mutant " << n << " threw a non-std exception\n" << text;
    }
    if (::testing::Test::HasFailure()) break;  // one reproducer is enough
  }
  // Both paths must be exercised, or the fuzzer tests nothing.
  EXPECT_GT(parsed, kMutants / 20);  // about 5% of the mutants parse
  EXPECT_GT(rejected, kMutants / 2);
  std::printf("parser fuzz: %d mutants parsed, %d rejected with kiln::Error\n", parsed, rejected);
}

}  // namespace
}  // namespace kiln
