// A small FileCheck (after LLVM's): the lines of a test file that start with a check prefix
// describe, in order, what a command's output must contain. Pass tests are IR text in and
// CHECK lines out (tests/passes/kir/), and the examples check what `kiln` prints about them.
//
// Directives (PREFIX is CHECK unless a test names another, e.g. ERR):
//   PREFIX: text        text occurs at or after the previous match (this line or a later one)
//   PREFIX-NEXT: text   text occurs on the line right after the previous match's
//   PREFIX-SAME: text   text occurs on the previous match's line, after it
//   PREFIX-NOT: text    text does not occur between the previous match and the next one (or
//                       the end of the output)
//   PREFIX-EMPTY:       the line after the previous match's is empty
// A directive sits anywhere on its line (after `//`, say). Its text is matched literally, its
// ends trimmed; a run of spaces matches any run of spaces or tabs; `{{re}}` is an ECMAScript
// regular expression (`%{{[0-9]+}}` matches any numbered value). A match never spans lines.
//
// RUN lines (`RUN: command`) say how a test runs (run_lines below; `filecheck --run FILE`).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kiln::filecheck {

struct Directive {
  enum class Kind { kCheck, kNext, kSame, kNot, kEmpty };
  Kind kind = Kind::kCheck;
  std::string pattern;
  int line = 0;  // 1-based line in the check file
};

// The directives for `prefix` in `check_text`, in order. Throws kiln::Error (naming
// `check_name`:line) on a malformed one: an empty pattern, NEXT/SAME/EMPTY first, or none at all.
std::vector<Directive> parse_directives(std::string_view check_text, std::string_view prefix,
                                        std::string_view check_name);

struct Result {
  bool ok = true;
  // On failure: "<check_name>:<line>: error: <PREFIX-KIND>: ..." naming the pattern, where the
  // search looked in the output (its 1-based line) and that line's text.
  std::string message;
};

// Checks `output` against the directives of `check_text`. Malformed directives are a failed
// Result too (the message says which line), never an exception.
Result check(std::string_view check_text, std::string_view output, std::string_view prefix = "CHECK",
             std::string_view check_name = "<check file>");

// The commands of the file's `RUN:` lines, in order, with %s replaced by `path` (shell-quoted).
// A line ending in `\` continues on the next RUN line.
std::vector<std::string> run_lines(std::string_view file_text, const std::string& path);

}  // namespace kiln::filecheck
