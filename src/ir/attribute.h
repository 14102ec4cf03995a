// Typed node attributes: a small variant per attribute, kept in a map sorted by name so the
// text form is canonical.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "ir/dtype.h"

namespace kiln {

enum class AttrKind { kInt, kFloat, kBool, kString, kInts, kFloats, kDType };
// Alternatives are in AttrKind order: value.index() == static_cast<int>(kind).
using AttrValue = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>,
                               std::vector<double>, DType>;

std::string_view attr_kind_name(AttrKind kind);  // "int", "float", ...
inline AttrKind attr_kind(const AttrValue& v) { return static_cast<AttrKind>(v.index()); }
std::string to_string(const AttrValue& value);   // the IR text form of the value
// Exact equality: floats compare by bits, so NaN equals NaN and -0.0 differs from 0.0 (operator==
// would say the opposite, which breaks "is this attribute unchanged / its default" checks).
bool same_value(const AttrValue& a, const AttrValue& b);

class Attributes {
 public:
  Attributes() = default;
  Attributes(std::initializer_list<std::pair<const std::string, AttrValue>> items)
      : items_(items) {}

  bool has(const std::string& name) const { return items_.count(name) != 0; }
  void set(const std::string& name, AttrValue value) { items_[name] = std::move(value); }
  void erase(const std::string& name) { items_.erase(name); }
  const AttrValue& get(const std::string& name) const;

  // Typed getters; throw kiln::Error when the attribute is missing or of another kind.
  int64_t i(const std::string& name) const;
  double f(const std::string& name) const;
  bool b(const std::string& name) const;
  const std::string& s(const std::string& name) const;
  const std::vector<int64_t>& ints(const std::string& name) const;
  const std::vector<double>& floats(const std::string& name) const;
  DType dtype(const std::string& name) const;

  const std::map<std::string, AttrValue>& items() const { return items_; }
  bool operator==(const Attributes&) const = default;

 private:
  std::map<std::string, AttrValue> items_;
};

// Same names, and same_value for each.
bool same_values(const Attributes& a, const Attributes& b);

}  // namespace kiln
