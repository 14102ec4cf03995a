// Unicode letter (\p{L}) and number (\p{N}) code point tables for GPT-2's pre-tokenizer, plus
// the White_Space set (\s). The tables live in unicode_tables.cc, written by
// make_unicode_tables.py, so they are exact rather than a hand-picked list of scripts.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kiln::train::unicode {

struct CodePointRange {
  uint32_t first;
  uint32_t last;  // inclusive
};

extern const CodePointRange kLetterRanges[];
extern const size_t kLetterRangesSize;
extern const CodePointRange kNumberRanges[];
extern const size_t kNumberRangesSize;

bool is_letter(uint32_t code_point);      // general category L*
bool is_number(uint32_t code_point);      // general category N*
bool is_whitespace(uint32_t code_point);  // the White_Space property

}  // namespace kiln::train::unicode
