// The on-disk compile cache (support/compile_cache.h): round trips, distinct keys, corrupt and
// truncated entries (a miss, then rewritten), unwritable folders (no throw), the disabled mode
// and where the folder comes from, concurrent writers, and the least-recently-used size bound.
// Every test works in a fresh folder under the system temp folder and removes it.
#include "support/compile_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

// A fresh folder, removed (with everything in it) at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    std::random_device rd;
    path = fs::temp_directory_path() /
           ("kiln_compile_cache_test_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter++) + "_" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
};

// Sets (or unsets, for nullptr) an environment variable for one scope.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    if (value) {
      ::setenv(n, value, 1);
    } else {
      ::unsetenv(n);
    }
  }
  ~ScopedEnv() {
    if (old) {
      ::setenv(name.c_str(), old->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
};

// Random bytes over the whole 0..255 range, never all zero.
std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(byte(rng));
  if (n > 0) s[0] = '\x01';
  return s;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  return names;
}

TEST(CompileCacheTest, RoundTripsRandomBytesOfManySizes) {
  TempDir tmp;
  CompileCache cache(tmp.path / "nvrtc");
  const std::vector<size_t> sizes = {0, 1, 7, 8, 9, 1000, 1 << 20};
  for (size_t k = 0; k < sizes.size(); ++k) {
    const std::string key = "key " + std::to_string(k);
    const std::string bytes = random_bytes(sizes[k], static_cast<uint32_t>(k + 1));
    EXPECT_FALSE(cache.load(key).has_value());
    cache.store(key, bytes);
    std::optional<std::string> back = cache.load(key);
    ASSERT_TRUE(back.has_value()) << "size " << sizes[k];
    EXPECT_EQ(*back, bytes) << "size " << sizes[k];
  }
  const CompileCacheStats s = cache.stats();
  EXPECT_EQ(s.hits, sizes.size());
  EXPECT_EQ(s.misses, sizes.size());
  EXPECT_EQ(s.writes, sizes.size());
  EXPECT_EQ(s.corrupt, 0u);
  EXPECT_EQ(s.errors, 0u);
  // A second instance on the same folder (another process, in effect) sees the entries.
  CompileCache again(tmp.path / "nvrtc");
  EXPECT_EQ(again.load("key 5"), random_bytes(1000, 6));
  // One file per entry, named by 32 hex digits, no temp files left behind.
  const std::vector<std::string> names = names_in(tmp.path / "nvrtc");
  EXPECT_EQ(names.size(), sizes.size());
  for (const std::string& n : names) {
    EXPECT_EQ(n.size(), 36u) << n;
    EXPECT_TRUE(n.ends_with(".bin")) << n;
  }
  // Header (40 bytes) + payload.
  EXPECT_EQ(fs::file_size(cache.path_for("key 6")), 40u + (1u << 20));
}

TEST(CompileCacheTest, StoreReplacesAnEntry) {
  TempDir tmp;
  CompileCache cache(tmp.path);
  cache.store("k", "first value");
  cache.store("k", "second");
  EXPECT_EQ(cache.load("k"), "second");
}

TEST(CompileCacheTest, DistinctKeysDoNotCollide) {
  // Keys that differ in one character, in length only, or only past the first 8-byte word.
  const std::vector<std::string> near = {"", "a", "b", "ab", "ba", "a\0"s, "aaaaaaaa", "aaaaaaab",
                                         "aaaaaaaaa", "aaaaaaaa\0"s, "baaaaaaa", "source x = 1;",
                                         "source x = 2;"};
  std::set<std::string> names;
  for (const std::string& k : near) names.insert(CompileCache::key_hash(k));
  EXPECT_EQ(names.size(), near.size());
  // 20000 distinct random keys (1 to 64 bytes): as many names, each 32 lowercase hex digits.
  std::mt19937 rng(7);
  std::set<std::string> keys(near.begin(), near.end());
  while (keys.size() < near.size() + 20000) {
    std::string key(1 + rng() % 64, '\0');
    for (char& c : key) c = static_cast<char>(rng());
    if (!keys.insert(key).second) continue;
    const std::string h = CompileCache::key_hash(key);
    ASSERT_EQ(h.size(), 32u);
    ASSERT_EQ(h.find_first_not_of("0123456789abcdef"), std::string::npos) << h;
    names.insert(h);
  }
  EXPECT_EQ(names.size(), keys.size());
  EXPECT_EQ(CompileCache::key_hash("same"), CompileCache::key_hash("same"));

  // And entries under different keys keep their own bytes.
  TempDir tmp;
  CompileCache cache(tmp.path);
  for (size_t k = 0; k < near.size(); ++k) cache.store(near[k], "value " + std::to_string(k));
  for (size_t k = 0; k < near.size(); ++k)
    EXPECT_EQ(cache.load(near[k]), "value " + std::to_string(k));
}

// Every kind of damage is a miss (counted as corrupt), and a store afterwards makes it whole.
TEST(CompileCacheTest, CorruptOrTruncatedEntriesAreMissesAndGetRewritten) {
  TempDir tmp;
  CompileCache cache(tmp.path);
  const std::string bytes = random_bytes(5000, 3);
  cache.store("kernel", bytes);
  const fs::path file = cache.path_for("kernel");
  const std::string good = read_file(file);
  ASSERT_EQ(good.size(), 5040u);

  struct Damage {
    const char* what;
    std::string contents;
  };
  std::vector<Damage> damages;
  for (size_t at : {size_t{0}, size_t{9}, size_t{20}, size_t{30}, size_t{39}, size_t{40},
                    size_t{2500}, good.size() - 1}) {
    std::string flipped = good;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
    damages.push_back({"a flipped byte", flipped});
  }
  damages.push_back({"truncated payload", good.substr(0, good.size() - 10)});
  damages.push_back({"truncated header", good.substr(0, 20)});
  damages.push_back({"empty file", ""});
  damages.push_back({"trailing bytes", good + "xx"});
  uint64_t corrupt = 0;
  for (const Damage& d : damages) {
    write_file(file, d.contents);
    EXPECT_FALSE(cache.load("kernel").has_value()) << d.what;
    EXPECT_EQ(cache.stats().corrupt, ++corrupt) << d.what;
    cache.store("kernel", bytes);
    EXPECT_EQ(cache.load("kernel"), bytes) << d.what;
    EXPECT_EQ(read_file(file), good) << d.what;
  }
}

// An entry whose file name matches but was stored under another key (as a hash collision on the
// name would look) is a miss: the header holds an independent hash of the key.
TEST(CompileCacheTest, EntryOfAnotherKeyUnderTheNameIsAMiss) {
  TempDir tmp;
  CompileCache cache(tmp.path);
  cache.store("other key", "other bytes");
  fs::copy_file(cache.path_for("other key"), cache.path_for("this key"));
  EXPECT_FALSE(cache.load("this key").has_value());
  EXPECT_EQ(cache.stats().corrupt, 1u);
}

TEST(CompileCacheTest, MissingParentsAreCreated) {
  TempDir tmp;
  CompileCache cache(tmp.path / "a" / "b" / "nvrtc");
  EXPECT_FALSE(cache.load("k").has_value());  // nothing there yet: a miss, not an error
  cache.store("k", "v");
  EXPECT_EQ(cache.load("k"), "v");
  EXPECT_EQ(cache.stats().errors, 0u);
}

TEST(CompileCacheTest, UnwritableFolderIsANoOpNotAnError) {
  TempDir tmp;
  // A folder below a regular file cannot exist (even for root).
  write_file(tmp.path / "file", "x");
  CompileCache below_file(tmp.path / "file" / "nvrtc");
  EXPECT_TRUE(below_file.enabled());
  EXPECT_NO_THROW(below_file.store("k", "v"));
  EXPECT_FALSE(below_file.load("k").has_value());
  EXPECT_EQ(below_file.stats().writes, 0u);
  EXPECT_GE(below_file.stats().errors, 1u);

  // A read-only folder (root writes there anyway: then the store simply works).
  const fs::path ro = tmp.path / "ro";
  fs::create_directories(ro);
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
  CompileCache read_only(ro);
  EXPECT_NO_THROW(read_only.store("k", "v"));
  if (::geteuid() != 0) {
    EXPECT_FALSE(read_only.load("k").has_value());
    EXPECT_EQ(read_only.stats().writes, 0u);
  }
}

TEST(CompileCacheTest, DisabledCacheStoresNothing) {
  CompileCache off{fs::path()};
  EXPECT_FALSE(off.enabled());
  off.store("k", "v");
  EXPECT_FALSE(off.load("k").has_value());
  EXPECT_EQ(off.stats().writes, 0u);
  EXPECT_EQ(off.stats().misses, 1u);

  ScopedEnv dir("KILN_CACHE_DIR", "off");
  EXPECT_TRUE(CompileCache::default_root().empty());
  EXPECT_FALSE(CompileCache::global("nvrtc").enabled());
}

TEST(CompileCacheTest, DefaultRootFollowsTheEnvironment) {
  {
    ScopedEnv dir("KILN_CACHE_DIR", "/somewhere/kc");
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(CompileCache::default_root(), fs::path("/somewhere/kc"));
  }
  {
    ScopedEnv dir("KILN_CACHE_DIR", "");  // empty counts as unset
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    ScopedEnv home("HOME", "/home/u");
    EXPECT_EQ(CompileCache::default_root(), fs::path("/xdg/kiln"));
  }
  {
    ScopedEnv dir("KILN_CACHE_DIR", nullptr);
    ScopedEnv xdg("XDG_CACHE_HOME", "relative/ignored");  // the XDG spec ignores relative paths
    ScopedEnv home("HOME", "/home/u");
    EXPECT_EQ(CompileCache::default_root(), fs::path("/home/u/.cache/kiln"));
  }
  {
    ScopedEnv dir("KILN_CACHE_DIR", nullptr);
    ScopedEnv xdg("XDG_CACHE_HOME", nullptr);
    ScopedEnv home("HOME", "");
    EXPECT_TRUE(CompileCache::default_root().empty());
    EXPECT_FALSE(CompileCache::global("nvrtc").enabled());
  }
  TempDir tmp;
  ScopedEnv dir("KILN_CACHE_DIR", tmp.path.c_str());
  CompileCache& g = CompileCache::global("nvrtc");
  EXPECT_EQ(g.dir(), tmp.path / "nvrtc");
  EXPECT_EQ(&g, &CompileCache::global("nvrtc"));  // one instance per folder
  EXPECT_NE(&g, &CompileCache::global("other"));
  g.store("k", "v");
  EXPECT_TRUE(fs::exists(tmp.path / "nvrtc" / (CompileCache::key_hash("k") + ".bin")));
}

// Threads storing and loading one key at once (as processes sharing the folder would): every
// load is a miss or exactly one writer's bytes, and the entry that is left is whole.
TEST(CompileCacheTest, ConcurrentWritersOfOneKeyLeaveAValidEntry) {
  TempDir tmp;
  CompileCache cache(tmp.path);
  constexpr int kThreads = 8, kRounds = 25;
  std::vector<std::string> values;
  for (int t = 0; t < kThreads; ++t)
    values.push_back(random_bytes(20000 + static_cast<size_t>(t) * 1000, 100 + t));
  std::atomic<int> bad{0}, hits{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      CompileCache own(tmp.path);  // a second instance too, like another process
      for (int r = 0; r < kRounds; ++r) {
        (r % 2 ? own : cache).store("shared", values[t]);
        std::optional<std::string> got = (r % 3 ? cache : own).load("shared");
        if (!got) continue;
        ++hits;
        if (std::find(values.begin(), values.end(), *got) == values.end()) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(hits.load(), kThreads * kRounds);  // renames replace whole files: never absent
  std::optional<std::string> last = cache.load("shared");
  ASSERT_TRUE(last.has_value());
  EXPECT_NE(std::find(values.begin(), values.end(), *last), values.end());
  EXPECT_EQ(names_in(tmp.path).size(), 1u);  // no temp files left
  EXPECT_EQ(cache.stats().corrupt, 0u);
}

// The size bound deletes the least recently used entries: by mtime, which a hit refreshes.
TEST(CompileCacheTest, SizeBoundEvictsLeastRecentlyUsed) {
  TempDir tmp;
  // Each entry is 40 + 1000 bytes on disk; the bound holds two (2080), not three (3120).
  CompileCache cache(tmp.path, 3000);
  const auto now = fs::file_time_type::clock::now();
  auto age = [&](const std::string& key, int seconds) {
    fs::last_write_time(cache.path_for(key), now - std::chrono::seconds(seconds));
  };
  cache.store("a", random_bytes(1000, 1));
  age("a", 300);
  cache.store("b", random_bytes(1000, 2));
  age("b", 200);
  cache.store("c", random_bytes(1000, 3));  // over the bound: a, the oldest, goes
  EXPECT_EQ(cache.stats().evictions, 1u);
  EXPECT_FALSE(fs::exists(cache.path_for("a")));
  EXPECT_EQ(cache.load("b"), random_bytes(1000, 2));  // a hit: b is now the newest
  age("c", 100);
  cache.store("d", random_bytes(1000, 4));  // c is the least recently used now
  EXPECT_EQ(cache.stats().evictions, 2u);
  EXPECT_FALSE(fs::exists(cache.path_for("c")));
  EXPECT_EQ(cache.load("b"), random_bytes(1000, 2));
  EXPECT_EQ(cache.load("d"), random_bytes(1000, 4));

  // An entry larger than the bound on its own is kept (it was just written); the rest go.
  cache.store("big", random_bytes(5000, 5));
  EXPECT_EQ(cache.load("big"), random_bytes(5000, 5));
  EXPECT_EQ(names_in(tmp.path).size(), 1u);

  // A stale temp file of a process that died mid-write is removed; a fresh one is not (its
  // writer may still be running); other files are left alone.
  write_file(tmp.path / ".tmp-1-1", "stale");
  fs::last_write_time(tmp.path / ".tmp-1-1", now - std::chrono::hours(2));
  write_file(tmp.path / ".tmp-1-2", "fresh");
  write_file(tmp.path / "README", "not an entry");
  cache.store("e", "small");
  EXPECT_FALSE(fs::exists(tmp.path / ".tmp-1-1"));
  EXPECT_TRUE(fs::exists(tmp.path / ".tmp-1-2"));
  EXPECT_TRUE(fs::exists(tmp.path / "README"));
}

TEST(CompileCacheTest, UnboundedWhenMaxBytesIsZero) {
  TempDir tmp;
  CompileCache cache(tmp.path, 0);
  for (int k = 0; k < 10; ++k) cache.store("key " + std::to_string(k), random_bytes(1000, k + 1));
  EXPECT_EQ(cache.stats().evictions, 0u);
  EXPECT_EQ(names_in(tmp.path).size(), 10u);
}

}  // namespace
}  // namespace kiln
