#include "filecheck/filecheck.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <regex>

#include "support/error.h"

namespace kiln::filecheck {
namespace {

using Kind = Directive::Kind;

std::vector<std::string_view> split_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (true) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) {
      lines.push_back(text.substr(start));
      return lines;
    }
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool is_word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }

// The position just after `word` where it occurs in `line` as a whole word (not inside a longer
// one: ERR does not match in ERROR), or npos.
size_t find_word(std::string_view line, std::string_view word, size_t from = 0) {
  for (size_t at = line.find(word, from); at != std::string_view::npos; at = line.find(word, at + 1)) {
    if (at > 0 && is_word_char(line[at - 1])) continue;
    return at + word.size();
  }
  return std::string_view::npos;
}

std::string kind_name(std::string_view prefix, Kind kind) {
  switch (kind) {
    case Kind::kCheck: return std::string(prefix);
    case Kind::kNext: return std::string(prefix) + "-NEXT";
    case Kind::kSame: return std::string(prefix) + "-SAME";
    case Kind::kNot: return std::string(prefix) + "-NOT";
    case Kind::kEmpty: return std::string(prefix) + "-EMPTY";
  }
  return std::string(prefix);
}

// A pattern as a regular expression: literal text escaped, runs of blanks as [ \t]+, {{re}} as is.
std::regex compile_pattern(std::string_view pattern) {
  std::string re;
  for (size_t i = 0; i < pattern.size();) {
    if (pattern.compare(i, 2, "{{") == 0) {
      size_t close = pattern.find("}}", i + 2);
      KILN_CHECK(close != std::string_view::npos, "unterminated '{{{{' in pattern '{}'", pattern);
      re += "(?:" + std::string(pattern.substr(i + 2, close - i - 2)) + ")";
      i = close + 2;
    } else if (pattern[i] == ' ' || pattern[i] == '\t') {
      while (i < pattern.size() && (pattern[i] == ' ' || pattern[i] == '\t')) ++i;
      re += "[ \\t]+";
    } else {
      if (std::string_view("\\^$.|?*+()[]{}").find(pattern[i]) != std::string_view::npos) re += '\\';
      re += pattern[i++];
    }
  }
  try {
    return std::regex(re, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    fail("bad regular expression in pattern '{}': {}", pattern, e.what());
  }
}

struct Match {
  size_t line = 0, begin = 0, end = 0;
};

// The first match of `re` in `line` at or after column `from`.
std::optional<Match> search_line(const std::regex& re, std::string_view line, size_t line_index, size_t from) {
  if (from > line.size()) return std::nullopt;
  std::match_results<std::string_view::const_iterator> m;
  if (!std::regex_search(line.begin() + static_cast<std::ptrdiff_t>(from), line.end(), m, re)) return std::nullopt;
  const size_t begin = from + static_cast<size_t>(m.position(0));
  return Match{line_index, begin, begin + static_cast<size_t>(m.length(0))};
}

std::string show_line(const std::vector<std::string_view>& lines, size_t line) {
  if (line >= lines.size()) return "output line " + std::to_string(line + 1) + " (past the end of the output)";
  return fmt::format("output line {}: '{}'", line + 1, lines[line]);
}

}  // namespace

std::vector<Directive> parse_directives(std::string_view check_text, std::string_view prefix,
                                        std::string_view check_name) {
  std::vector<Directive> out;
  std::vector<std::string_view> lines = split_lines(check_text);
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    const int number = static_cast<int>(i) + 1;
    for (size_t after = find_word(line, prefix); after != std::string_view::npos;
         after = find_word(line, prefix, after)) {
      Kind kind = Kind::kCheck;
      size_t colon = after;
      if (after < line.size() && line[after] == '-') {
        size_t end = after + 1;
        while (end < line.size() && std::isalpha(static_cast<unsigned char>(line[end]))) ++end;
        if (end >= line.size() || line[end] != ':') continue;  // e.g. CHECK-prefix in prose
        const std::string_view suffix = line.substr(after + 1, end - after - 1);
        if (suffix == "NEXT") kind = Kind::kNext;
        else if (suffix == "SAME") kind = Kind::kSame;
        else if (suffix == "NOT") kind = Kind::kNot;
        else if (suffix == "EMPTY") kind = Kind::kEmpty;
        else fail("{}:{}: unknown directive '{}-{}' (known: {} and its -NEXT, -SAME, -NOT, -EMPTY)", check_name,
                  number, prefix, suffix, prefix);
        colon = end;
      } else if (after >= line.size() || line[after] != ':') {
        continue;
      }
      Directive d{kind, std::string(trim(line.substr(colon + 1))), number};
      KILN_CHECK(kind == Kind::kEmpty || !d.pattern.empty(), "{}:{}: {} has an empty pattern", check_name, number,
                 kind_name(prefix, kind));
      KILN_CHECK(kind != Kind::kEmpty || d.pattern.empty(), "{}:{}: {} takes no pattern, got '{}'", check_name,
                 number, kind_name(prefix, kind), d.pattern);
      const bool needs_previous = kind == Kind::kNext || kind == Kind::kSame || kind == Kind::kEmpty;
      const bool has_previous =
          std::any_of(out.begin(), out.end(), [](const Directive& p) { return p.kind != Kind::kNot; });
      KILN_CHECK(!needs_previous || has_previous, "{}:{}: {} needs a match before it (it is the first directive)",
                 check_name, number, kind_name(prefix, kind));
      out.push_back(std::move(d));
      break;  // one directive per line
    }
  }
  KILN_CHECK(!out.empty(), "{}: no {} directives found", check_name, prefix);
  return out;
}

Result check(std::string_view check_text, std::string_view output, std::string_view prefix,
             std::string_view check_name) {
  Result result;
  try {
    const std::vector<Directive> directives = parse_directives(check_text, prefix, check_name);
    const std::vector<std::string_view> lines = split_lines(output);
    auto failure = [&](const Directive& d, const std::string& what) {
      result.ok = false;
      result.message = fmt::format("{}:{}: error: {}: {}\n  {}: {}", check_name, d.line, kind_name(prefix, d.kind),
                                   what, kind_name(prefix, d.kind), d.pattern);
      return result;
    };
    // Where the search continues: the end of the previous match (line 0, column 0 at first).
    Match previous;
    bool any_match = false;
    std::vector<const Directive*> nots;  // NOTs waiting for the next match to bound their range
    // The first NOT pattern found between `previous` and (line, column), or nullptr.
    auto violated_not = [&](size_t line, size_t column, Match* where) -> const Directive* {
      for (const Directive* d : nots) {
        const std::regex re = compile_pattern(d->pattern);
        for (size_t l = previous.line; l <= line && l < lines.size(); ++l) {
          std::string_view text = lines[l];
          if (l == line) text = text.substr(0, column);
          std::optional<Match> m = search_line(re, text, l, l == previous.line ? previous.end : 0);
          if (m) {
            *where = *m;
            return d;
          }
        }
      }
      return nullptr;
    };
    for (const Directive& d : directives) {
      if (d.kind == Kind::kNot) {
        nots.push_back(&d);
        continue;
      }
      std::optional<Match> found;
      if (d.kind == Kind::kEmpty) {
        const size_t next = previous.line + 1;
        if (next >= lines.size() || !lines[next].empty())
          return failure(d, fmt::format("the line after the previous match is not empty: {}", show_line(lines, next)));
        found = Match{next, 0, 0};
      } else {
        const std::regex re = compile_pattern(d.pattern);
        if (d.kind == Kind::kSame) {
          found = search_line(re, lines[previous.line], previous.line, previous.end);
          if (!found)
            return failure(d, fmt::format("not found on the previous match's line, after it: {}",
                                          show_line(lines, previous.line)));
        } else if (d.kind == Kind::kNext) {
          const size_t next = previous.line + 1;
          if (next < lines.size()) found = search_line(re, lines[next], next, 0);
          if (!found) {
            std::string later;
            for (size_t l = next + 1; l < lines.size() && later.empty(); ++l)
              if (search_line(re, lines[l], l, 0)) later = fmt::format(" (it occurs on output line {})", l + 1);
            return failure(d, fmt::format("not found on the line after the previous match{}: {}", later,
                                          show_line(lines, next)));
          }
        } else {
          for (size_t l = previous.line; l < lines.size() && !found; ++l)
            found = search_line(re, lines[l], l, l == previous.line ? previous.end : 0);
          if (!found)
            return failure(d, fmt::format("expected text not found in the output after {}",
                                          !any_match ? std::string("its start")
                                              : fmt::format("the previous match (from {})",
                                                            show_line(lines, previous.line))));
        }
      }
      Match where;
      if (const Directive* bad = violated_not(found->line, found->begin, &where))
        return failure(*bad, fmt::format("excluded text found before the match of line {}: {}", d.line,
                                         show_line(lines, where.line)));
      nots.clear();
      previous = *found;
      any_match = true;
    }
    Match where;
    if (const Directive* bad = violated_not(lines.size() - 1, lines.back().size(), &where))
      return failure(*bad, fmt::format("excluded text found after the last match: {}", show_line(lines, where.line)));
  } catch (const Error& e) {
    result.ok = false;
    result.message = fmt::format("error: {}", e.what());
  }
  return result;
}

std::vector<std::string> run_lines(std::string_view file_text, const std::string& path) {
  std::string quoted = "'";
  for (char c : path) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  std::vector<std::string> commands;
  bool continued = false;
  for (std::string_view line : split_lines(file_text)) {
    size_t after = find_word(line, "RUN");
    if (after == std::string_view::npos || after >= line.size() || line[after] != ':') continue;
    std::string command(trim(line.substr(after + 1)));
    for (size_t at = command.find("%s"); at != std::string::npos; at = command.find("%s", at + quoted.size())) {
      command.replace(at, 2, quoted);
    }
    const bool continues = !command.empty() && command.back() == '\\';
    if (continues) command.pop_back();
    if (continued) commands.back() += " " + command;
    else commands.push_back(command);
    continued = continues;
  }
  return commands;
}

}  // namespace kiln::filecheck
