// kiln::Error and the check helpers every layer uses to report bad input.
// Messages name what the user gave and what was expected; library code never exits.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A syntax or semantic error in IR text, with the 1-based position it was found at.
class ParseError : public Error {
 public:
  ParseError(int line, int column, const std::string& message)
      : Error(fmt::format("{}:{}: {}", line, column, message)), line_(line), column_(column) {}
  int line() const { return line_; }
  int column() const { return column_; }

 private:
  int line_;
  int column_;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kiln

// Throws kiln::Error with the formatted message when `cond` is false.
#define KILN_CHECK(cond, ...)               \
  do {                                      \
    if (!(cond)) ::kiln::fail(__VA_ARGS__); \
  } while (0)
