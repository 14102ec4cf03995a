// A persistent on-disk cache of compiled artifacts (key -> bytes), shared across runs and
// processes: the nvrtc dialect stores the CUBIN of each generated kernel here, so a second run of
// the same model loads its kernels from disk instead of compiling them (nvrtc.h).
//
// Where: $KILN_CACHE_DIR if set, else $XDG_CACHE_HOME/kiln, else $HOME/.cache/kiln; one
// subfolder per kind of artifact ("nvrtc"). KILN_CACHE_DIR=off disables it, and so does having
// none of the three set. Plain C++: no CUDA.
//
// An entry is one file named by a 128-bit hash of the key text (32 hex digits + ".bin"), holding
// a header (magic, format version, a second hash of the key, payload size, payload checksum) and
// the payload. A file that fails any check (truncated, corrupt, a hash collision on the name) is
// a miss, and the next store overwrites it. Writes go to a temp file in the same folder and are
// renamed into place, so concurrent processes and threads only ever see whole entries. When a
// write takes the folder over its size bound, the least recently used entries (by mtime; a hit
// refreshes it) are deleted. Any I/O failure makes that entry a miss or a no-op, with one
// warning line on stderr per process: the cache never stops a run.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace kiln {

struct CompileCacheStats {
  uint64_t hits = 0;       // loads that returned an entry
  uint64_t misses = 0;     // loads that did not (corrupt entries included)
  uint64_t corrupt = 0;    // of the misses: a file was there but failed a check
  uint64_t writes = 0;     // entries stored
  uint64_t evictions = 0;  // entries deleted by the size bound
  uint64_t errors = 0;     // I/O failures (each made an entry a miss or a no-op)
};

class CompileCache {
 public:
  static constexpr uint64_t kDefaultMaxBytes = uint64_t{256} << 20;
  // Bump when the file layout changes: older files then fail the header check (a miss).
  static constexpr uint32_t kFormatVersion = 1;

  // A cache in `dir` (created on the first store, parents included). An empty path: disabled.
  // max_bytes bounds the folder's entries (0: unbounded).
  explicit CompileCache(std::filesystem::path dir, uint64_t max_bytes = kDefaultMaxBytes);
  CompileCache(const CompileCache&) = delete;
  CompileCache& operator=(const CompileCache&) = delete;

  // The process-wide cache for `kind` ("nvrtc") under default_root(). The environment is read
  // on every call (one instance per resolved folder, never destroyed), so a test may point
  // KILN_CACHE_DIR elsewhere; a disabled instance when default_root() is empty.
  static CompileCache& global(std::string_view kind);
  // $KILN_CACHE_DIR, $XDG_CACHE_HOME/kiln (an absolute XDG_CACHE_HOME only) or $HOME/.cache/kiln;
  // empty (disabled) for KILN_CACHE_DIR=off or when none is set. Empty values count as unset.
  static std::filesystem::path default_root();
  // The 128-bit hash of `key` as 32 lowercase hex digits (the entry's file name, less ".bin").
  static std::string key_hash(std::string_view key);

  bool enabled() const { return !dir_.empty(); }
  const std::filesystem::path& dir() const { return dir_; }
  // The file an entry for `key` lives in.
  std::filesystem::path path_for(std::string_view key) const;

  // The stored bytes for `key`, or nullopt (a miss: absent, unreadable, or failing a check).
  std::optional<std::string> load(std::string_view key);
  // Stores `bytes` under `key` (replacing any entry); then applies the size bound. Never throws
  // on I/O failure.
  void store(std::string_view key, std::string_view bytes);

  CompileCacheStats stats() const;

 private:
  void evict(const std::filesystem::path& keep);
  void io_error(const std::string& what);

  std::filesystem::path dir_;
  uint64_t max_bytes_;
  std::atomic<uint64_t> hits_{0}, misses_{0}, corrupt_{0}, writes_{0}, evictions_{0}, errors_{0};
};

}  // namespace kiln
