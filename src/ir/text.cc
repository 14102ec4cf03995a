// The IR text printer and parser (see ir/text.h for the format). The parser is a hand-written
// lexer plus recursive descent with one token of lookahead; it builds the graph through
// Graph::add_input / add_node, so attribute normalization and type inference are the same as
// for graphs built in C++, and every error is reported at the token that caused it.
#include "ir/text.h"

#include <charconv>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "ir/op_def.h"
#include "ir/verifier.h"
#include "support/error.h"

namespace kiln {
namespace {

// The largest product of dimensions a type may have; far above any real tensor, far below
// int64 overflow, so that numel, strides and byte sizes computed downstream stay exact.
constexpr int64_t kMaxElements = int64_t{1} << 48;

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_ident_char(char c) { return is_ident_start(c) || is_digit(c); }

bool is_valid_name(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!is_name_char(c)) return false;
  return true;
}
bool is_valid_ident(std::string_view s) {
  if (s.empty() || !is_ident_start(s[0])) return false;
  for (char c : s)
    if (!is_ident_char(c)) return false;
  return true;
}
// Node outputs named like %17 are positional labels, not user names: the parser drops them and
// the printer renumbers.
bool is_numeric_name(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!is_digit(c)) return false;
  return true;
}

// True when the dimensions are non-negative and multiply (zeros counted as one) to at most
// kMaxElements. Counting zeros as one also bounds the strides of empty tensors.
bool within_element_limit(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    int64_t m = d == 0 ? 1 : d;
    if (m > kMaxElements / n) return false;
    n *= m;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Printer

class Printer {
 public:
  explicit Printer(const Graph& graph) : graph_(graph), labels_(graph.values.size()) {
    for (const Value& v : graph.values)
      if (!v.name.empty()) used_names_.insert(v.name);
  }

  std::string run() {
    KILN_CHECK(is_valid_name(graph_.name),
               "print: graph name '{}' cannot be written in IR text (expected [A-Za-z0-9_.-]+)",
               graph_.name);
    std::string out = "graph @" + graph_.name + "(";
    for (size_t i = 0; i < graph_.inputs.size(); ++i) {
      const GraphInput& input = graph_.inputs[i];
      if (i) out += ", ";
      out += label(input.value, "graph input") + ": " + to_string(graph_.type(input.value)) + " " +
             std::string(role_name(input.role));
    }
    out += ") {\n";
    for (size_t n = 0; n < graph_.nodes.size(); ++n) out += node_line(graph_.nodes[n], n);
    for (const Update& update : graph_.updates) {
      out += "  update " + label(update.target, "update") + " = " + label(update.value, "update") +
             "\n";
    }
    out += "  return";
    for (size_t i = 0; i < graph_.outputs.size(); ++i)
      out += (i ? ", " : " ") + label(graph_.outputs[i], "graph output");
    out += "\n}\n";
    return out;
  }

 private:
  // "%name" for a value, numbering unnamed values on first sight (their definition, in a
  // well-formed graph).
  const std::string& label(ValueId id, std::string_view where) {
    KILN_CHECK(graph_.is_valid(id),
               "print: {} refers to value id {}, which does not exist ({} values)", where, id,
               graph_.values.size());
    std::string& label = labels_[static_cast<size_t>(id)];
    if (!label.empty()) return label;
    const std::string& name = graph_.value(id).name;
    if (!name.empty()) {
      KILN_CHECK(is_valid_name(name),
                 "print: value name '{}' cannot be written in IR text (expected [A-Za-z0-9_.-]+)",
                 name);
      label = fmt::format("%{}", name);
    } else {
      while (used_names_.count(std::to_string(next_number_))) ++next_number_;
      label = fmt::format("%{}", next_number_++);
    }
    return label;
  }

  std::string node_line(const Node& node, size_t index) {
    std::string where = fmt::format("node {} ({})", index, op_name(node.op));
    std::string line = "  ";
    for (size_t i = 0; i < node.outputs.size(); ++i)
      line += (i ? ", " : "") + label(node.outputs[i], where);
    if (!node.outputs.empty()) line += " = ";
    line += std::string(op_name(node.op)) + "(";
    for (size_t i = 0; i < node.inputs.size(); ++i)
      line += (i ? ", " : "") + label(node.inputs[i], where);
    line += ")";

    const OpDef* def = has_op_def(node.op) ? &op_def(node.op) : nullptr;
    std::string attrs;
    for (const auto& [name, value] : node.attrs.items()) {
      KILN_CHECK(is_valid_ident(name),
                 "print: {}: attribute name '{}' cannot be written in IR text", where, name);
      // Left out: a value that normalization would restore (the schema's default, or what the
      // op's own normalize fills in: optimizer_update's hyperparameter defaults).
      bool is_default = false;
      if (def) {
        for (const AttrSpec& spec : def->attrs)
          if (spec.name == name && spec.default_value && same_value(*spec.default_value, value))
            is_default = true;
        if (!is_default && def->normalize) {
          Attributes without = node.attrs;
          without.erase(name);
          def->normalize(without);
          is_default = without.has(name) && same_value(without.get(name), value);
        }
      }
      if (is_default) continue;
      attrs += (attrs.empty() ? "" : ", ") + name + "=" + to_string(value);
    }
    if (!attrs.empty()) line += " {" + attrs + "}";

    for (size_t i = 0; i < node.outputs.size(); ++i)
      line += (i ? ", " : " : ") + to_string(graph_.type(node.outputs[i]));
    if (node.body) {
      // The body in the usual syntax, indented under the node, inside { }.
      line += " {\n";
      std::string body = Printer(*node.body).run();
      size_t start = 0;
      while (start < body.size()) {
        size_t end = body.find('\n', start);
        line += "    " + body.substr(start, end - start) + "\n";
        start = end + 1;
      }
      line += "  }";
    }
    return line + "\n";
  }

  const Graph& graph_;
  std::vector<std::string> labels_;
  std::set<std::string> used_names_;
  int64_t next_number_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Lexer

enum class TokenKind { kEnd, kIdent, kValueName, kGraphName, kInt, kFloat, kString, kPunct };

struct Token {
  TokenKind kind = TokenKind::kEnd;
  std::string text;      // identifier, name without its sigil, unescaped string, punctuation
  std::string_view raw;  // the source text of the token, for messages
  int line = 1;
  int column = 1;
  int64_t int_value = 0;
  double float_value = 0.0;

  bool is_punct(char c) const { return kind == TokenKind::kPunct && text[0] == c; }
  bool is_ident(std::string_view word) const { return kind == TokenKind::kIdent && text == word; }
  // How an error message names the token.
  std::string describe() const {
    if (kind == TokenKind::kEnd) return "end of input";
    constexpr size_t kMaxShown = 40;
    if (raw.size() > kMaxShown) return fmt::format("'{}...'", raw.substr(0, kMaxShown));
    return fmt::format("'{}'", raw);
  }
};

std::string describe_char(char c) {
  if (c >= 0x20 && c < 0x7f) return fmt::format("'{}'", c);
  return fmt::format("'\\x{:02x}'", static_cast<unsigned char>(c));
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : source_(source) {}

  Token next() {
    skip_space_and_comments();
    Token token;
    token.line = line_;
    token.column = column();
    size_t start = pos_;
    if (pos_ >= source_.size()) return token;
    char c = source_[pos_];
    if (c == '%' || c == '@') {
      ++pos_;
      while (pos_ < source_.size() && is_name_char(source_[pos_])) ++pos_;
      token.kind = c == '%' ? TokenKind::kValueName : TokenKind::kGraphName;
      token.text = std::string(source_.substr(start + 1, pos_ - start - 1));
      if (token.text.empty()) {
        fail_at(
            token,
            fmt::format("expected a name after '{}' (letters, digits, '_', '.', '-'), found {}", c,
                        pos_ < source_.size() ? describe_char(source_[pos_]) : "end of input"));
      }
    } else if (c == '"') {
      lex_string(token);
    } else if (is_digit(c) ||
               (c == '-' && pos_ + 1 < source_.size() && is_digit(source_[pos_ + 1]))) {
      lex_number(token);
    } else if (c == '-' && source_.substr(pos_ + 1, 3) == "inf" &&
               (pos_ + 4 >= source_.size() || !is_ident_char(source_[pos_ + 4]))) {
      pos_ += 4;
      token.kind = TokenKind::kFloat;
      token.float_value = -std::numeric_limits<double>::infinity();
    } else if (is_ident_start(c)) {
      while (pos_ < source_.size() && is_ident_char(source_[pos_])) ++pos_;
      token.kind = TokenKind::kIdent;
      token.text = std::string(source_.substr(start, pos_ - start));
    } else if (std::strchr("(){}[],:=", c) != nullptr) {
      ++pos_;
      token.kind = TokenKind::kPunct;
      token.text = std::string(1, c);
    } else {
      fail_at(token, fmt::format("unexpected character {}", describe_char(c)));
    }
    token.raw = source_.substr(start, pos_ - start);
    return token;
  }

 private:
  int column() const { return static_cast<int>(pos_ - line_start_) + 1; }

  [[noreturn]] void fail_at(const Token& at, const std::string& message) {
    throw ParseError(at.line, at.column, message);
  }

  void skip_space_and_comments() {
    while (pos_ < source_.size()) {
      char c = source_[pos_];
      if (c == '\n') {
        ++pos_;
        ++line_;
        line_start_ = pos_;
      } else if (c == ' ' || c == '\t' || c == '\r') {
        ++pos_;
      } else if (c == '/' && pos_ + 1 < source_.size() && source_[pos_ + 1] == '/') {
        while (pos_ < source_.size() && source_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  // "..." with escapes \" \\ \n (the ones attribute.cc's printer writes); any other byte but a
  // newline stands for itself.
  void lex_string(Token& token) {
    ++pos_;
    token.kind = TokenKind::kString;
    while (true) {
      if (pos_ >= source_.size() || source_[pos_] == '\n')
        fail_at(token, "string is not closed before the end of the line");
      char c = source_[pos_];
      if (c == '"') break;
      if (c == '\\') {
        char e = pos_ + 1 < source_.size() ? source_[pos_ + 1] : '\0';
        if (e == '"' || e == '\\')
          token.text += e;
        else if (e == 'n')
          token.text += '\n';
        else {
          Token at{TokenKind::kString, "", "", line_, column()};
          fail_at(at,
                  fmt::format(
                      "unknown escape '\\' followed by {} in string (expected \\\", \\\\ or \\n)",
                      pos_ + 1 < source_.size() ? describe_char(e) : "end of input"));
        }
        pos_ += 2;
        continue;
      }
      token.text += c;
      ++pos_;
    }
    ++pos_;  // closing quote
  }

  // -?digits[.digits][e[+-]digits]: an int64 unless it has a '.' or an exponent.
  void lex_number(Token& token) {
    size_t start = pos_;
    auto digits = [&] {
      while (pos_ < source_.size() && is_digit(source_[pos_])) ++pos_;
    };
    if (source_[pos_] == '-') ++pos_;
    digits();
    bool is_float = false;
    if (pos_ < source_.size() && source_[pos_] == '.') {
      is_float = true;
      ++pos_;
      digits();
    }
    if (pos_ < source_.size() && (source_[pos_] == 'e' || source_[pos_] == 'E')) {
      size_t after = pos_ + 1;
      if (after < source_.size() && (source_[after] == '+' || source_[after] == '-')) ++after;
      if (after < source_.size() && is_digit(source_[after])) {
        is_float = true;
        pos_ = after;
        digits();
      }
    }
    std::string_view text = source_.substr(start, pos_ - start);
    const char* first = text.data();
    const char* last = text.data() + text.size();
    if (is_float) {
      token.kind = TokenKind::kFloat;
      auto [ptr, ec] = std::from_chars(first, last, token.float_value);
      if (ec == std::errc::result_out_of_range)
        fail_at(token, fmt::format("float literal {} is out of range for f64", text));
      if (ec != std::errc() || ptr != last)
        fail_at(token, fmt::format("malformed float literal {}", text));
    } else {
      token.kind = TokenKind::kInt;
      auto [ptr, ec] = std::from_chars(first, last, token.int_value);
      if (ec == std::errc::result_out_of_range)
        fail_at(token, fmt::format("integer literal {} is out of range for int64", text));
      if (ec != std::errc() || ptr != last)
        fail_at(token, fmt::format("malformed integer literal {}", text));
    }
  }

  std::string_view source_;
  size_t pos_ = 0;
  int line_ = 1;
  size_t line_start_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Parser

struct TypeAt {
  TensorType type;
  Token token;  // where the type starts
};

struct AttrAt {
  Token name;
  Token value;  // first token of the value
};

class Parser {
 public:
  explicit Parser(Lexer& lexer) : lexer_(lexer) { token_ = lexer_.next(); }
  // A parser for a nested graph (a fused node's body) that starts at `first`, already lexed.
  Parser(Lexer& lexer, Token first) : lexer_(lexer), token_(std::move(first)) {}

  // `nested`: a fused node's body, followed by more text; its verification is left to the
  // node (ops/fused.cc), which reports at the node.
  Graph parse_graph(bool nested = false) {
    Token keyword = take();
    if (!keyword.is_ident("graph"))
      fail_at(keyword, fmt::format("expected 'graph' at the start of the text, found {}",
                                   keyword.describe()));
    Token name = take();
    if (name.kind != TokenKind::kGraphName)
      fail_at(name, fmt::format("expected the graph name '@name' after 'graph', found {}",
                                name.describe()));
    graph_.name = name.text;
    expect('(', "after the graph name");
    if (!token_.is_punct(')')) {
      while (true) {
        parse_input();
        if (!token_.is_punct(',')) break;
        take();
      }
    }
    expect(')', "after inputs");
    expect('{', "to open the graph body");
    while (!token_.is_ident("return")) {
      if (token_.is_ident("update")) {
        parse_update();
      } else if (token_.kind == TokenKind::kValueName) {
        parse_node();
      } else {
        fail_at(token_, fmt::format("expected a node ('%name = op(...)'), 'update' or 'return', "
                                    "found {}",
                                    token_.describe()));
      }
    }
    parse_return();
    expect('}', "after the return values");
    if (nested) return std::move(graph_);
    if (token_.kind != TokenKind::kEnd)
      fail_at(token_, fmt::format("expected end of input after '}}', found {}", token_.describe()));
    verify(graph_);
    return std::move(graph_);
  }

 private:
  [[noreturn]] static void fail_at(const Token& at, const std::string& message) {
    throw ParseError(at.line, at.column, message);
  }

  Token take() {
    Token current = std::move(token_);
    token_ = lexer_.next();
    return current;
  }

  Token expect(char punct, std::string_view context) {
    if (!token_.is_punct(punct))
      fail_at(token_, fmt::format("expected '{}' {}, found {}", punct, context, token_.describe()));
    return take();
  }

  Token expect_value_name(std::string_view what) {
    if (token_.kind != TokenKind::kValueName)
      fail_at(token_, fmt::format("expected {} ('%name'), found {}", what, token_.describe()));
    return take();
  }

  void check_not_defined(const Token& name) {
    if (symbols_.count(name.text))
      fail_at(name, fmt::format("value %{} is defined twice", name.text));
  }

  ValueId use(const Token& name) {
    auto it = symbols_.find(name.text);
    if (it == symbols_.end()) fail_at(name, fmt::format("use of undefined value %{}", name.text));
    return it->second;
  }

  // %name: dtype[dims] role
  void parse_input() {
    Token name = expect_value_name("a graph input");
    check_not_defined(name);
    expect(':', fmt::format("after input %{}", name.text));
    TypeAt type = parse_type();
    Token role_token = take();
    std::optional<Role> role;
    if (role_token.kind == TokenKind::kIdent) role = parse_role(role_token.text);
    if (!role) {
      fail_at(role_token,
              fmt::format("expected the role of input %{} (param, state or data), found {}",
                          name.text, role_token.describe()));
    }
    ValueId id;
    try {
      id = graph_.add_input(name.text, type.type, *role);
    } catch (const ParseError&) {
      throw;
    } catch (const Error& e) {
      fail_at(name, e.what());
    }
    symbols_.emplace(name.text, id);
  }

  // dtype[d0,d1,...]
  TypeAt parse_type() {
    Token start = take();
    if (start.kind != TokenKind::kIdent)
      fail_at(start, fmt::format("expected a type such as f32[2,3], found {}", start.describe()));
    std::optional<DType> dtype = parse_dtype(start.text);
    if (!dtype) {
      fail_at(start, fmt::format("unknown dtype '{}' (expected f32, f64, f16, bf16, i32, i64, bool "
                                 "or u8)",
                                 start.text));
    }
    expect('[', fmt::format("after dtype '{}'", start.text));
    TensorType type{*dtype, {}};
    if (!token_.is_punct(']')) {
      while (true) {
        Token dim = take();
        if (dim.kind != TokenKind::kInt || dim.int_value < 0) {
          fail_at(dim, fmt::format("expected a dimension (a non-negative integer), found {}",
                                   dim.describe()));
        }
        type.shape.push_back(dim.int_value);
        if (!token_.is_punct(',')) break;
        take();
      }
    }
    expect(']', "after the dimensions");
    if (!within_element_limit(type.shape)) {
      fail_at(start, fmt::format("type {} is too large: its dimensions multiply to more than 2^48",
                                 to_string(type)));
    }
    return TypeAt{std::move(type), std::move(start)};
  }

  // %a[, %b...] = op(%x, ...) [{name=value, ...}] [: type, ...]
  void parse_node() {
    std::vector<Token> output_names;
    output_names.push_back(take());
    while (token_.is_punct(',')) {
      take();
      output_names.push_back(expect_value_name("an output name after ','"));
    }
    expect('=', "after the output names");
    Token op_token = take();
    if (op_token.kind != TokenKind::kIdent)
      fail_at(op_token,
              fmt::format("expected an op name after '=', found {}", op_token.describe()));
    std::optional<Op> op = parse_op(op_token.text);
    if (!op) fail_at(op_token, fmt::format("unknown op '{}'", op_token.text));

    expect('(', fmt::format("after op name '{}'", op_token.text));
    std::vector<ValueId> inputs;
    if (!token_.is_punct(')')) {
      while (true) {
        inputs.push_back(use(expect_value_name("an input value")));
        if (!token_.is_punct(',')) break;
        take();
      }
    }
    expect(')', "after inputs");

    Attributes attrs;
    std::vector<AttrAt> attr_tokens;
    if (token_.is_punct('{')) {
      take();
      if (!token_.is_punct('}')) {
        while (true) {
          Token name = take();
          if (name.kind != TokenKind::kIdent)
            fail_at(name, fmt::format("expected an attribute name, found {}", name.describe()));
          if (attrs.has(name.text))
            fail_at(name, fmt::format("attribute '{}' is given twice", name.text));
          expect('=', fmt::format("after attribute name '{}'", name.text));
          Token value_start = token_;
          attrs.set(name.text, parse_attr_value());
          attr_tokens.push_back(AttrAt{std::move(name), std::move(value_start)});
          if (!token_.is_punct(',')) break;
          take();
        }
      }
      expect('}', "after attributes");
    }

    std::optional<Token> colon;
    std::vector<TypeAt> declared;
    if (token_.is_punct(':')) {
      colon = take();
      while (true) {
        declared.push_back(parse_type());
        if (!token_.is_punct(',')) break;
        take();
      }
    }

    // A fused node's body: { graph @name(...) { ... } }. (Its attribute block, with the
    // required `kind`, is the first '{' after the inputs, so the two never mix up.)
    std::shared_ptr<const Graph> body;
    if (*op == Op::kFused) {
      expect('{', "to open the body of the fused node (after its output types)");
      Parser nested(lexer_, std::move(token_));
      Graph parsed = nested.parse_graph(/*nested=*/true);
      token_ = std::move(nested.token_);
      expect('}', "to close the body of the fused node");
      body = std::make_shared<const Graph>(std::move(parsed));
    }

    // Semantics, in the order a reader would check them.
    for (size_t i = 0; i < output_names.size(); ++i) {
      check_not_defined(output_names[i]);
      for (size_t j = 0; j < i; ++j)
        if (output_names[j].text == output_names[i].text)
          fail_at(output_names[i], fmt::format("value %{} is defined twice", output_names[i].text));
    }
    check_attributes(*op, op_token, attrs, attr_tokens);
    std::vector<ValueId> outputs;
    try {
      outputs = graph_.add_node(*op, std::move(inputs), std::move(attrs), std::move(body));
    } catch (const ParseError&) {
      throw;
    } catch (const Error& e) {
      fail_at(op_token, e.what());
    }
    if (outputs.size() != output_names.size()) {
      fail_at(op_token,
              fmt::format("{} produces {} output{}, but {} name{} given", op_token.text,
                          outputs.size(), outputs.size() == 1 ? "" : "s", output_names.size(),
                          output_names.size() == 1 ? " is" : "s are"));
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      const TensorType& inferred = graph_.type(outputs[i]);
      if (!within_element_limit(inferred.shape)) {
        fail_at(op_token, fmt::format("{}: output %{} has type {}, too large: its dimensions "
                                      "multiply to more than 2^48",
                                      op_token.text, output_names[i].text, to_string(inferred)));
      }
    }
    if (colon) {
      if (declared.size() != outputs.size()) {
        fail_at(*colon, fmt::format("{} type{} declared for the {} output{} of {}", declared.size(),
                                    declared.size() == 1 ? "" : "s", outputs.size(),
                                    outputs.size() == 1 ? "" : "s", op_token.text));
      }
      for (size_t i = 0; i < outputs.size(); ++i) {
        const TensorType& inferred = graph_.type(outputs[i]);
        if (declared[i].type != inferred) {
          fail_at(declared[i].token, fmt::format("declared {}, inferred {}",
                                                 to_string(declared[i].type), to_string(inferred)));
        }
      }
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      const std::string& name = output_names[i].text;
      if (!is_numeric_name(name)) graph_.values[static_cast<size_t>(outputs[i])].name = name;
      symbols_.emplace(name, outputs[i]);
    }
  }

  // Normalizes the attributes up front to report a schema error at the attribute it names
  // (normalize_attributes quotes the name) rather than at the op, and bounds any `shape`
  // attribute so that inference never multiplies huge dimensions.
  void check_attributes(Op op, const Token& op_token, const Attributes& attrs,
                        const std::vector<AttrAt>& attr_tokens) {
    if (!has_op_def(op)) return;  // add_node reports the missing definition at the op
    try {
      normalize_attributes(op, attrs);
    } catch (const Error& e) {
      std::string message = e.what();
      for (const AttrAt& at : attr_tokens) {
        if (message.find("attribute '" + at.name.text + "'") != std::string::npos) {
          bool unknown = message.find("unknown attribute") != std::string::npos;
          fail_at(unknown ? at.name : at.value, message);
        }
      }
      fail_at(op_token, message);
    }
    for (const AttrAt& at : attr_tokens) {
      if (at.name.text != "shape") continue;
      const auto* dims = std::get_if<std::vector<int64_t>>(&attrs.get("shape"));
      if (!dims) continue;
      int64_t n = 1;
      for (int64_t d : *dims) {
        // |d| without overflow (a negative entry may mean "infer this dimension").
        uint64_t m = d < 0 ? uint64_t{0} - static_cast<uint64_t>(d) : static_cast<uint64_t>(d);
        if (m == 0) m = 1;
        if (m > static_cast<uint64_t>(kMaxElements / n)) {
          fail_at(at.value, fmt::format("{}: attribute 'shape' {} is too large: its dimensions "
                                        "multiply to more than 2^48",
                                        op_token.text, to_string(attrs.get("shape"))));
        }
        n *= static_cast<int64_t>(m);
      }
    }
  }

  AttrValue parse_attr_value() {
    Token token = take();
    switch (token.kind) {
      case TokenKind::kInt:
        return token.int_value;
      case TokenKind::kFloat:
        return token.float_value;
      case TokenKind::kString:
        return token.text;
      case TokenKind::kIdent: {
        if (token.text == "true") return true;
        if (token.text == "false") return false;
        if (std::optional<double> f = special_float(token)) return *f;
        if (std::optional<DType> dtype = parse_dtype(token.text)) return *dtype;
        break;
      }
      case TokenKind::kPunct:
        if (token.is_punct('[')) return parse_list();
        break;
      default:
        break;
    }
    fail_at(token, fmt::format("expected an attribute value (a number, \"string\", true, false, "
                               "dtype or [list]), found {}",
                               token.describe()));
  }

  static std::optional<double> special_float(const Token& token) {
    if (token.is_ident("inf")) return std::numeric_limits<double>::infinity();
    if (token.is_ident("nan")) return std::numeric_limits<double>::quiet_NaN();
    return std::nullopt;
  }

  // [n, ...]: a list of ints, or of floats when any element is a float. [] is an empty int list
  // (normalize_attributes turns it into an empty float list where the schema wants one).
  AttrValue parse_list() {
    std::vector<Token> elements;
    bool any_float = false;
    if (!token_.is_punct(']')) {
      while (true) {
        Token element = take();
        if (element.kind == TokenKind::kFloat || special_float(element)) {
          any_float = true;
        } else if (element.kind != TokenKind::kInt) {
          fail_at(element,
                  fmt::format("expected a number in the list, found {}", element.describe()));
        }
        elements.push_back(std::move(element));
        if (!token_.is_punct(',')) break;
        take();
      }
    }
    expect(']', "to close the list");
    if (!any_float) {
      std::vector<int64_t> ints;
      for (const Token& e : elements) ints.push_back(e.int_value);
      return ints;
    }
    std::vector<double> floats;
    for (const Token& e : elements) {
      if (e.kind == TokenKind::kInt)
        floats.push_back(static_cast<double>(e.int_value));
      else if (e.kind == TokenKind::kFloat)
        floats.push_back(e.float_value);
      else
        floats.push_back(*special_float(e));
    }
    return floats;
  }

  // update %target = %value: after the step, %value replaces param or state input %target.
  void parse_update() {
    take();  // 'update'
    Token target = expect_value_name("the updated input after 'update'");
    ValueId target_id = use(target);
    int index = graph_.input_index(target_id);
    if (index < 0) {
      fail_at(target, fmt::format("update target %{} is not a graph input (only param and state "
                                  "inputs can be updated)",
                                  target.text));
    }
    if (graph_.inputs[static_cast<size_t>(index)].role == Role::kData)
      fail_at(target, fmt::format("update target %{} is a data input, expected param or state",
                                  target.text));
    for (const Update& u : graph_.updates)
      if (u.target == target_id) fail_at(target, fmt::format("%{} is updated twice", target.text));
    expect('=', fmt::format("after update target %{}", target.text));
    Token value = expect_value_name("the new value");
    ValueId value_id = use(value);
    const TensorType& expected = graph_.type(target_id);
    if (graph_.type(value_id) != expected) {
      fail_at(value,
              fmt::format("update of %{}: %{} has type {}, expected {}", target.text, value.text,
                          to_string(graph_.type(value_id)), to_string(expected)));
    }
    graph_.updates.push_back(Update{target_id, value_id});
  }

  // return [%a, %b...]: the graph outputs (none is allowed, e.g. a step that only updates).
  void parse_return() {
    take();  // 'return'
    if (token_.kind != TokenKind::kValueName) return;
    while (true) {
      graph_.outputs.push_back(use(take()));
      if (!token_.is_punct(',')) break;
      take();
      if (token_.kind != TokenKind::kValueName)
        fail_at(token_, fmt::format("expected a value after ',', found {}", token_.describe()));
    }
  }

  Lexer& lexer_;
  Token token_;
  Graph graph_;
  // Every name defined so far, numeric ones included (they are labels within the text).
  std::map<std::string, ValueId, std::less<>> symbols_;
};

}  // namespace

std::string print(const Graph& graph) { return Printer(graph).run(); }

Graph parse(std::string_view text) {
  Lexer lexer(text);
  return Parser(lexer).parse_graph();
}

}  // namespace kiln
