// The on-disk compile cache (compile_cache.h): hashing, the entry file format, atomic writes,
// the size bound, and the process-wide instances.
#include "support/compile_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>

namespace kiln {

namespace {

namespace fs = std::filesystem;

// ---- hashing ----------------------------------------------------------------------------------
// A 64-bit hash over 8-byte words: each word goes through the splitmix64 finalizer (a bijection
// with full avalanche) xor-ed with the seed, and is folded into the state with a rotate and an
// odd multiply (both bijections of the state). Two seeds give the 128-bit file name; further seeds
// the header's key check and the payload checksum. Not cryptographic: it guards against
// accidents (edits, truncation, different keys), not against an adversary who can write the
// cache folder.

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

uint64_t hash64(std::string_view data, uint64_t seed) {
  uint64_t h = mix(seed ^ (static_cast<uint64_t>(data.size()) * kGolden));
  auto fold = [&](uint64_t word) {
    h = std::rotl(h ^ mix(word ^ seed), 29) * kGolden + 0x632be59bd9b4e019ULL;
  };
  size_t k = 0;
  for (; k + 8 <= data.size(); k += 8) {
    uint64_t word = 0;
    std::memcpy(&word, data.data() + k, 8);
    fold(word);
  }
  if (k < data.size()) {
    uint64_t word = 0;
    std::memcpy(&word, data.data() + k, data.size() - k);
    fold(word ^ 0xa5a5a5a5a5a5a5a5ULL);  // the length is in the initial state already
  }
  return mix(h ^ seed);
}

constexpr uint64_t kNameSeedHigh = 0x6b696c6e2d6e6d31ULL;
constexpr uint64_t kNameSeedLow = 0x3ad1f0c24e7b9152ULL;
constexpr uint64_t kKeyCheckSeed = 0x51ed2701c3a9e4b7ULL;
constexpr uint64_t kPayloadSeed = 0xd6e8feb86659fd93ULL;

// ---- the entry file ----------------------------------------------------------------------------
// 40 bytes of header, little-endian, then the payload:
//   magic[8] "kilncc\r\n" | u32 format version | u32 zero | u64 key check | u64 payload size |
//   u64 payload checksum

constexpr char kMagic[8] = {'k', 'i', 'l', 'n', 'c', 'c', '\r', '\n'};
constexpr size_t kHeaderBytes = 40;

void put_u64(unsigned char* at, uint64_t v) {
  for (int b = 0; b < 8; ++b) at[b] = static_cast<unsigned char>(v >> (8 * b));
}
uint64_t get_u64(const unsigned char* at) {
  uint64_t v = 0;
  for (int b = 0; b < 8; ++b) v |= static_cast<uint64_t>(at[b]) << (8 * b);
  return v;
}

struct Header {
  uint32_t version = 0;
  uint64_t key_check = 0, size = 0, checksum = 0;
};

void encode(const Header& h, unsigned char* out) {
  std::memcpy(out, kMagic, 8);
  put_u64(out + 8, h.version);  // u32 version then u32 zero: one little-endian u64
  put_u64(out + 16, h.key_check);
  put_u64(out + 24, h.size);
  put_u64(out + 32, h.checksum);
}

bool decode(const unsigned char* in, Header* h) {
  if (std::memcmp(in, kMagic, 8) != 0) return false;
  const uint64_t version = get_u64(in + 8);
  if (version > UINT32_MAX) return false;
  h->version = static_cast<uint32_t>(version);
  h->key_check = get_u64(in + 16);
  h->size = get_u64(in + 24);
  h->checksum = get_u64(in + 32);
  return true;
}

// Closes on every path out.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Reads exactly `size` bytes; false on error or end of file first.
bool read_all(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

constexpr std::string_view kEntrySuffix = ".bin";
constexpr std::string_view kTempPrefix = ".tmp-";
// A temp file this old belongs to a process that died mid-write: the size bound removes it.
constexpr auto kStaleTemp = std::chrono::hours(1);

bool is_entry_name(const std::string& name) {
  return name.size() == 32 + kEntrySuffix.size() && name.ends_with(kEntrySuffix) &&
         std::all_of(name.begin(), name.begin() + 32,
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

CompileCache::CompileCache(fs::path dir, uint64_t max_bytes)
    : dir_(std::move(dir)), max_bytes_(max_bytes) {}

fs::path CompileCache::default_root() {
  if (const std::string dir = env("KILN_CACHE_DIR"); !dir.empty())
    return dir == "off" ? fs::path() : fs::path(dir);
  if (const std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty() && fs::path(xdg).is_absolute())
    return fs::path(xdg) / "kiln";
  if (const std::string home = env("HOME"); !home.empty())
    return fs::path(home) / ".cache" / "kiln";
  return {};
}

CompileCache& CompileCache::global(std::string_view kind) {
  static std::mutex mutex;
  // Never destroyed: kernels may be compiled from threads still running at exit.
  static auto* caches = new std::map<fs::path, std::unique_ptr<CompileCache>>;
  static auto* disabled = new CompileCache(fs::path());
  const fs::path root = default_root();
  if (root.empty()) return *disabled;
  const fs::path dir = root / fs::path(std::string(kind));
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = (*caches)[dir];
  if (!slot) slot = std::make_unique<CompileCache>(dir);
  return *slot;
}

std::string CompileCache::key_hash(std::string_view key) {
  return fmt::format("{:016x}{:016x}", hash64(key, kNameSeedHigh), hash64(key, kNameSeedLow));
}

fs::path CompileCache::path_for(std::string_view key) const {
  return dir_ / (key_hash(key) + std::string(kEntrySuffix));
}

std::optional<std::string> CompileCache::load(std::string_view key) {
  if (!enabled()) {
    ++misses_;
    return std::nullopt;
  }
  const fs::path path = path_for(key);
  Fd file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) {
    if (errno != ENOENT && errno != ENOTDIR)
      io_error(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
    ++misses_;
    return std::nullopt;
  }
  auto corrupt = [&] {
    ++corrupt_;
    ++misses_;
    return std::nullopt;
  };
  struct stat info {};
  unsigned char raw[kHeaderBytes];
  Header header;
  if (::fstat(file.fd, &info) != 0 || info.st_size < static_cast<off_t>(kHeaderBytes) ||
      !read_all(file.fd, raw, kHeaderBytes) || !decode(raw, &header))
    return corrupt();
  // The size is checked against the file's before anything is allocated for it.
  if (header.version != kFormatVersion || header.key_check != hash64(key, kKeyCheckSeed) ||
      header.size != static_cast<uint64_t>(info.st_size) - kHeaderBytes)
    return corrupt();
  std::string payload(header.size, '\0');
  if (!read_all(file.fd, payload.data(), payload.size()) ||
      hash64(payload, kPayloadSeed) != header.checksum)
    return corrupt();
  // Refresh the mtime: the size bound deletes the least recently used entries first. A
  // read-only cache folder just keeps the old time.
  std::error_code ec;
  fs::last_write_time(path, fs::file_time_type::clock::now(), ec);
  ++hits_;
  return payload;
}

void CompileCache::store(std::string_view key, std::string_view bytes) {
  if (!enabled()) return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    io_error(fmt::format("cannot create {}: {}", dir_.string(), ec.message()));
    return;
  }
  static std::atomic<uint64_t> counter{0};
  const fs::path final_path = path_for(key);
  const fs::path temp = dir_ / fmt::format("{}{}-{}", kTempPrefix, ::getpid(), counter++);
  unsigned char raw[kHeaderBytes];
  encode(Header{kFormatVersion, hash64(key, kKeyCheckSeed), bytes.size(),
                hash64(bytes, kPayloadSeed)},
         raw);
  {
    Fd file{::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
    if (file.fd < 0) {
      io_error(fmt::format("cannot write {}: {}", temp.string(), std::strerror(errno)));
      return;
    }
    bool ok =
        write_all(file.fd, raw, kHeaderBytes) && write_all(file.fd, bytes.data(), bytes.size());
    int error = ok ? 0 : errno;
    const int fd = file.fd;
    file.fd = -1;
    if (::close(fd) != 0 && ok) {  // close reports delayed write errors (NFS, quotas)
      ok = false;
      error = errno;
    }
    if (!ok) {
      io_error(fmt::format("cannot write {}: {}", temp.string(),
                           error != 0 ? std::strerror(error) : "short write"));
      fs::remove(temp, ec);
      return;
    }
  }
  // Atomic replace: readers see the old entry or the new one, never a part.
  fs::rename(temp, final_path, ec);
  if (ec) {
    io_error(fmt::format("cannot rename {} to {}: {}", temp.string(), final_path.string(),
                         ec.message()));
    fs::remove(temp, ec);
    return;
  }
  ++writes_;
  if (max_bytes_ > 0) evict(final_path);
}

void CompileCache::evict(const fs::path& keep) {
  struct Entry {
    fs::path path;
    uint64_t size;
    fs::file_time_type mtime;
  };
  std::vector<Entry> entries;
  uint64_t total = 0;
  const auto now = fs::file_time_type::clock::now();
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code entry_ec;
    const std::string name = it->path().filename().string();
    const fs::file_time_type mtime = it->last_write_time(entry_ec);
    if (entry_ec) continue;  // removed meanwhile by another process
    if (name.starts_with(kTempPrefix)) {
      if (now - mtime > kStaleTemp) fs::remove(it->path(), entry_ec);
      continue;
    }
    if (!is_entry_name(name)) continue;
    const uint64_t size = it->file_size(entry_ec);
    if (entry_ec) continue;
    entries.push_back({it->path(), size, mtime});
    total += size;
  }
  if (total <= max_bytes_) return;
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.mtime < b.mtime; });
  for (const Entry& e : entries) {
    if (total <= max_bytes_) break;
    if (e.path == keep) continue;
    // Another process may have removed it already, or may be reading it (an open file stays
    // readable on POSIX): either way it leaves the total.
    std::error_code remove_ec;
    if (fs::remove(e.path, remove_ec)) ++evictions_;
    total -= e.size;
  }
}

void CompileCache::io_error(const std::string& what) {
  ++errors_;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    fmt::print(stderr, "kiln: warning: compile cache: {} (going on without caching it)\n", what);
}

CompileCacheStats CompileCache::stats() const {
  return CompileCacheStats{hits_.load(), misses_.load(), corrupt_.load(),
                           writes_.load(), evictions_.load(), errors_.load()};
}

}  // namespace kiln
