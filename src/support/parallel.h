// A tiny parallel-for over OpenMP, so that kernels share one policy (how finely to split work,
// when not to start threads at all) instead of repeating pragmas and thresholds.
//
// Work is split into at most one contiguous chunk per thread. A range smaller than `grain`
// runs on the calling thread: entering a parallel region costs microseconds, more than a tiny
// tensor takes. Exceptions thrown by a chunk (e.g. a label out of range) are carried out of the
// parallel region and rethrown on the calling thread, since they must not cross it.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>

namespace kiln {

// Threads a parallel loop started here may use (1 inside another parallel region: no nesting).
inline int max_threads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// How many chunks [0, n) is split into for this grain: about n / grain, at least 1, at most
// max_threads(). 0 for an empty range.
inline int64_t num_chunks(int64_t n, int64_t grain) {
  if (n <= 0) return 0;
  return std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, max_threads());
}

// Calls fn(chunk, chunk_begin, chunk_end) for `chunks` contiguous, near-equal pieces of
// [begin, end), one per thread. Chunk c always covers the same range for the same arguments,
// so per-chunk partial results can be combined in a fixed order.
template <typename Fn>
void parallel_chunks(int64_t begin, int64_t end, int64_t chunks, Fn&& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (chunks <= 1) {
    fn(int64_t{0}, begin, end);
    return;
  }
  std::exception_ptr error;
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    try {
      fn(c, begin + n * c / chunks, begin + n * (c + 1) / chunks);
    } catch (...) {
#pragma omp critical(kiln_parallel_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Calls fn(chunk_begin, chunk_end) over [begin, end), in parallel when the range holds at least
// two grains. `grain` is the least work worth a thread, in units of the range.
template <typename Fn>
void parallel_for(int64_t begin, int64_t end, int64_t grain, Fn&& fn) {
  parallel_chunks(begin, end, num_chunks(end - begin, grain),
                  [&](int64_t, int64_t b, int64_t e) { fn(b, e); });
}

}  // namespace kiln
