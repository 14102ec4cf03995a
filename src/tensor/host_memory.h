// Host memory for tensors: Tensor's own storage, and storage a caller fills itself (a zero3
// rank's drawn param shards, models::init_param_shards), so that both get the same alignment
// and page policy.
#pragma once

#include <cstddef>
#include <memory>

namespace kiln {

// `bytes` (at least 1) of host memory, 64-byte aligned; freed when the last reference goes.
// Throws kiln::Error when the allocator has none. Zero-filled when `zero`, else untouched (the
// caller's first write faults the pages in: writing them in a parallel loop spreads that cost
// over the threads). Large blocks start on a 2 MiB boundary, so that transparent huge pages
// can back them where the system gives them unasked.
std::shared_ptr<std::byte[]> allocate_host(size_t bytes, bool zero = true);

}  // namespace kiln
