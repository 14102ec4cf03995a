#include "ir/attribute.h"

#include <array>
#include <charconv>
#include <cmath>
#include <cstring>

#include "support/error.h"

namespace kiln {
namespace {
constexpr std::array<std::string_view, 7> kKindNames = {"int",  "float",  "bool", "string",
                                                        "ints", "floats", "dtype"};

// Shortest text that parses back to the same double; always has a '.', 'e', "inf" or "nan" so
// the parser can tell a float from an int.
std::string float_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof(buffer), v);
  std::string text(buffer, result.ptr);
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}
}  // namespace

std::string_view attr_kind_name(AttrKind kind) { return kKindNames[static_cast<int>(kind)]; }

std::string to_string(const AttrValue& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) return std::to_string(v);
        else if constexpr (std::is_same_v<T, double>) return float_text(v);
        else if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::string>) return quoted(v);
        else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
          return fmt::format("[{}]", fmt::join(v, ", "));
        else if constexpr (std::is_same_v<T, std::vector<double>>) {
          std::string out = "[";
          for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + float_text(v[i]);
          return out + "]";
        } else
          return std::string(dtype_name(v));
      },
      value);
}

namespace {
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }
}  // namespace

bool same_value(const AttrValue& a, const AttrValue& b) {
  if (a.index() != b.index()) return false;
  if (const double* x = std::get_if<double>(&a)) return same_bits(*x, std::get<double>(b));
  if (const auto* x = std::get_if<std::vector<double>>(&a)) {
    const auto& y = std::get<std::vector<double>>(b);
    if (x->size() != y.size()) return false;
    for (size_t i = 0; i < x->size(); ++i)
      if (!same_bits((*x)[i], y[i])) return false;
    return true;
  }
  return a == b;
}

bool same_values(const Attributes& a, const Attributes& b) {
  if (a.items().size() != b.items().size()) return false;
  for (auto ia = a.items().begin(), ib = b.items().begin(); ia != a.items().end(); ++ia, ++ib)
    if (ia->first != ib->first || !same_value(ia->second, ib->second)) return false;
  return true;
}

const AttrValue& Attributes::get(const std::string& name) const {
  auto it = items_.find(name);
  if (it == items_.end()) fail("missing attribute '{}'", name);
  return it->second;
}

namespace {
template <typename T>
const T& typed(const Attributes& attrs, const std::string& name, AttrKind kind) {
  const AttrValue& v = attrs.get(name);
  if (const T* p = std::get_if<T>(&v)) return *p;
  fail("attribute '{}' is {}, expected {}", name, attr_kind_name(attr_kind(v)),
       attr_kind_name(kind));
}
}  // namespace

int64_t Attributes::i(const std::string& n) const { return typed<int64_t>(*this, n, AttrKind::kInt); }
double Attributes::f(const std::string& n) const { return typed<double>(*this, n, AttrKind::kFloat); }
bool Attributes::b(const std::string& n) const { return typed<bool>(*this, n, AttrKind::kBool); }
const std::string& Attributes::s(const std::string& n) const {
  return typed<std::string>(*this, n, AttrKind::kString);
}
const std::vector<int64_t>& Attributes::ints(const std::string& n) const {
  return typed<std::vector<int64_t>>(*this, n, AttrKind::kInts);
}
const std::vector<double>& Attributes::floats(const std::string& n) const {
  return typed<std::vector<double>>(*this, n, AttrKind::kFloats);
}
DType Attributes::dtype(const std::string& n) const { return typed<DType>(*this, n, AttrKind::kDType); }

}  // namespace kiln
