// Byte counts for people (reports, notes, errors): one format everywhere.
#pragma once

#include <fmt/format.h>

#include <string>

namespace kiln {

// B below a KiB, else KiB, MiB or GiB (the largest that stays >= 1) with two decimals.
inline std::string format_bytes(double bytes) {
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB"};
  if (bytes < 1024) return fmt::format("{:.0f} B", bytes);
  int unit = 0;
  double scaled = bytes / 1024;
  while (unit < 2 && scaled >= 1024) {
    scaled /= 1024;
    ++unit;
  }
  return fmt::format("{:.2f} {}", scaled, kUnits[unit]);
}

}  // namespace kiln
