// The checker the .kir tests rely on: each directive passes where it should and fails where it
// should, with a message naming the check line and the output line. A checker that accepted
// everything would make every .kir test pass, so the failing cases matter most.
#include "filecheck/filecheck.h"

#include <gtest/gtest.h>

#include "support/error.h"

namespace kiln::filecheck {
namespace {

const char* kOutput =
    "graph @g(%x: f32[3] data) {\n"
    "  %0 = exp(%x) : f32[3]\n"
    "  %1 = mul(%0, %0) : f32[3]\n"
    "\n"
    "  return %1\n"
    "}\n";

::testing::AssertionResult passes(const std::string& checks, const std::string& output = kOutput) {
  Result r = check(checks, output, "CHECK", "t.kir");
  if (r.ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << r.message;
}

// The failure message, or "" when the check passed.
std::string failure(const std::string& checks, const std::string& output = kOutput) {
  Result r = check(checks, output, "CHECK", "t.kir");
  EXPECT_EQ(r.ok, r.message.empty());
  return r.message;
}

TEST(FileCheck, CheckFindsTextInOrder) {
  EXPECT_TRUE(passes("// CHECK: exp(%x)\n// CHECK: return %1\n"));
  EXPECT_TRUE(passes("CHECK: graph\nCHECK: }"));
}

TEST(FileCheck, CheckFailsWhenTextIsMissingOrOutOfOrder) {
  std::string m = failure("// CHECK: exp\n// CHECK: log(%x)\n");
  EXPECT_NE(m.find("t.kir:2: error: CHECK: expected text not found"), std::string::npos) << m;
  EXPECT_NE(m.find("log(%x)"), std::string::npos) << m;
  EXPECT_NE(m.find("output line 2"), std::string::npos) << m;  // where the search started
  // mul comes after exp, so exp is not found after mul.
  EXPECT_NE(failure("// CHECK: mul\n// CHECK: exp\n").find("t.kir:2:"), std::string::npos);
}

TEST(FileCheck, CheckContinuesOnTheSameLineAfterAMatch) {
  EXPECT_TRUE(passes("CHECK: mul(\nCHECK: %0, %0"));
  EXPECT_FALSE(passes("CHECK: %0, %0\nCHECK: mul("));  // mul( is before the first match
}

TEST(FileCheck, NextMustBeOnTheFollowingLine) {
  EXPECT_TRUE(passes("CHECK: exp(%x)\nCHECK-NEXT: mul(%0, %0)"));
  std::string m = failure("CHECK: graph\nCHECK-NEXT: mul(%0, %0)");
  EXPECT_NE(m.find("t.kir:2: error: CHECK-NEXT: not found on the line after the previous match"), std::string::npos)
      << m;
  EXPECT_NE(m.find("it occurs on output line 3"), std::string::npos) << m;
  EXPECT_NE(m.find("output line 2: '  %0 = exp(%x) : f32[3]'"), std::string::npos) << m;
}

TEST(FileCheck, SameMustBeOnTheMatchedLineAfterTheMatch) {
  EXPECT_TRUE(passes("CHECK: %1 = mul\nCHECK-SAME: : f32[3]"));
  std::string m = failure("CHECK: %1 = mul\nCHECK-SAME: return");
  EXPECT_NE(m.find("t.kir:2: error: CHECK-SAME: not found on the previous match's line"), std::string::npos) << m;
  EXPECT_FALSE(passes("CHECK: f32[3]\nCHECK-SAME: %0 = exp"));  // before the match, not after
}

TEST(FileCheck, NotExcludesTextBetweenMatches) {
  EXPECT_TRUE(passes("CHECK: exp\nCHECK-NOT: add\nCHECK: return"));
  EXPECT_TRUE(passes("CHECK-NOT: log\nCHECK: graph"));  // first, and the text is absent
  std::string m = failure("CHECK: graph\nCHECK-NOT: mul\nCHECK: return");
  EXPECT_NE(m.find("t.kir:2: error: CHECK-NOT: excluded text found before the match of line 3"), std::string::npos)
      << m;
  EXPECT_NE(m.find("output line 3"), std::string::npos) << m;
  // mul occurs, but only after the next match: outside the NOT's range.
  EXPECT_TRUE(passes("CHECK: graph\nCHECK-NOT: mul\nCHECK: exp"));
}

TEST(FileCheck, NotAtTheEndCoversTheRestOfTheOutput) {
  EXPECT_TRUE(passes("CHECK: mul\nCHECK-NOT: exp"));  // exp is before the match
  std::string m = failure("CHECK: exp\nCHECK-NOT: return");
  EXPECT_NE(m.find("excluded text found after the last match: output line 5"), std::string::npos) << m;
  EXPECT_FALSE(passes("CHECK-NOT: exp"));  // alone: the whole output
}

TEST(FileCheck, EmptyMatchesAnEmptyNextLine) {
  EXPECT_TRUE(passes("CHECK: mul\nCHECK-EMPTY:\nCHECK-NEXT: return"));
  EXPECT_NE(failure("CHECK: exp\nCHECK-EMPTY:").find("is not empty: output line 3"), std::string::npos);
}

TEST(FileCheck, BlanksMatchAnyRunOfBlanks) {
  EXPECT_TRUE(passes("CHECK: node 3 fused", "  node   3\t fused\n"));
  EXPECT_FALSE(passes("CHECK: node 3 fused", "node 3fused\n"));
}

TEST(FileCheck, RegularExpressionsInDoubleBraces) {
  EXPECT_TRUE(passes("CHECK: %{{[0-9]+}} = mul(%{{[0-9]+}}, %0)"));
  EXPECT_FALSE(passes("CHECK: %{{[a-z]+}} = mul"));
  // Outside braces, regex characters are literal: '.' is not any character.
  EXPECT_TRUE(passes("CHECK: f32[3]"));
  EXPECT_FALSE(passes("CHECK: f32.3"));
  EXPECT_NE(failure("CHECK: %{{[0-9+}}").find("bad regular expression"), std::string::npos);
  EXPECT_NE(failure("CHECK: %{{0").find("unterminated"), std::string::npos);
}

TEST(FileCheck, MalformedDirectivesAreErrorsNamingTheLine) {
  EXPECT_THROW(parse_directives("no directives here", "CHECK", "t.kir"), Error);
  EXPECT_NE(failure("x\n// CHECK-NEXT: exp").find("t.kir:2: CHECK-NEXT needs a match before it"), std::string::npos);
  EXPECT_NE(failure("CHECK: graph\nCHECK-SAME:").find("t.kir:2: CHECK-SAME has an empty pattern"), std::string::npos);
  EXPECT_NE(failure("CHECK: graph\nCHECK-LABEL: g").find("unknown directive 'CHECK-LABEL'"), std::string::npos);
  EXPECT_NE(failure("CHECK: graph\nCHECK-EMPTY: x").find("takes no pattern"), std::string::npos);
}

TEST(FileCheck, PrefixesAreWholeWords) {
  const std::string checks = "// ERR: unknown pass\n// ERRORS: not a directive\n// CHECK: not ours\n";
  std::vector<Directive> d = parse_directives(checks, "ERR", "t.kir");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].pattern, "unknown pass");
  EXPECT_EQ(d[0].line, 1);
  EXPECT_TRUE(check(checks, "kiln: error: unknown pass 'x'\n", "ERR", "t.kir").ok);
  // The RUN line's "--check-prefix ERR" and the word MYCHECK are no directives.
  d = parse_directives("// RUN: x | filecheck %s --check-prefix ERR\n// MYCHECK: a\n// CHECK: b\n", "CHECK", "t");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].pattern, "b");
}

TEST(FileCheck, RunLinesSubstituteThePathAndJoinContinuations) {
  std::vector<std::string> runs = run_lines(
      "// RUN: kiln opt %s --passes cse | filecheck %s\n"
      "graph @g() {}\n"
      "// RUN: not kiln opt %s \\\n"
      "// RUN:   --passes nope\n",
      "/t/it's.kir");
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], "kiln opt '/t/it'\\''s.kir' --passes cse | filecheck '/t/it'\\''s.kir'");
  EXPECT_EQ(runs[1], "not kiln opt '/t/it'\\''s.kir'  --passes nope");
}

}  // namespace
}  // namespace kiln::filecheck
