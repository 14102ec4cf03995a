// Wall time on the steady clock, in seconds: the timings kiln prints (pass times, build phases,
// step times, progress). One place instead of a chrono expression at every measurement.
#pragma once

#include <chrono>

namespace kiln {

class Stopwatch {
 public:
  Stopwatch() : start_(Clock::now()) {}
  // Seconds since construction (or the last lap()).
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  // seconds(), and the next measurement starts now: consecutive phases timed one after another.
  double lap() {
    const Clock::time_point now = Clock::now();
    const double s = std::chrono::duration<double>(now - start_).count();
    start_ = now;
    return s;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point start_;
};

}  // namespace kiln
