// Reading a checkpoint written by a group of any size into a rank of another (reshard.h).
#include "train/checkpoint/reshard.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "support/error.h"
#include "train/checkpoint/safetensors.h"

namespace kiln::train {
namespace {

std::string meta(const std::map<std::string, std::string>& metadata, const char* key, std::string fallback = "") {
  auto it = metadata.find(key);
  return it == metadata.end() ? fallback : it->second;
}

std::optional<int64_t> parse_int(const std::string& text) {
  int64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

int64_t steps_of(const std::string& path, const std::map<std::string, std::string>& metadata) {
  const std::string steps = meta(metadata, "kiln.steps_done");
  KILN_CHECK(!steps.empty(), "checkpoint '{}' has no kiln.steps_done metadata", path);
  std::optional<int64_t> value = parse_int(steps);
  KILN_CHECK(value.has_value(), "checkpoint '{}': kiln.steps_done is '{}', expected an integer", path, steps);
  return *value;
}

// The group a file's metadata says wrote it: (world size, rank); a single process's or a
// consolidated file is (1, 0).
std::pair<int, int> group_of(const std::string& path, const std::map<std::string, std::string>& metadata) {
  if (meta(metadata, "kiln.consolidated") == "1") return {1, 0};
  std::optional<int64_t> world = parse_int(meta(metadata, "kiln.world_size", "1"));
  std::optional<int64_t> rank = parse_int(meta(metadata, "kiln.rank", "0"));
  KILN_CHECK(world && rank && *world >= 1 && *rank >= 0 && *rank < *world,
             "checkpoint '{}': kiln.world_size '{}' and kiln.rank '{}' are not a rank of a group", path,
             meta(metadata, "kiln.world_size"), meta(metadata, "kiln.rank"));
  return {static_cast<int>(*world), static_cast<int>(*rank)};
}

// Checks the headers are of one checkpoint: files of a group of N (each rank's at most once, all
// at one step), or one file of a group of 1. Returns N and each file's rank.
std::pair<int, std::vector<int>> check_group(const std::vector<std::string>& paths,
                                             const std::vector<SafetensorsHeader>& headers) {
  KILN_CHECK(!paths.empty(), "no checkpoint files given");
  const int world = group_of(paths[0], headers[0].metadata).first;
  const int64_t steps = steps_of(paths[0], headers[0].metadata);
  std::vector<int> ranks;
  for (size_t i = 0; i < paths.size(); ++i) {
    const auto [written_by, rank] = group_of(paths[i], headers[i].metadata);
    KILN_CHECK(written_by == world, "checkpoint files of two groups: '{}' is of {} rank{}, '{}' of {}", paths[0], world,
               world == 1 ? "" : "s", paths[i], written_by);
    KILN_CHECK(std::find(ranks.begin(), ranks.end(), rank) == ranks.end(), "checkpoint files '{}' and '{}' are both rank {}'s",
               paths[std::find(ranks.begin(), ranks.end(), rank) - ranks.begin()], paths[i], rank);
    const int64_t file_steps = steps_of(paths[i], headers[i].metadata);
    KILN_CHECK(file_steps == steps,
               "checkpoint files disagree: '{}' is at step {}, '{}' at step {} (a save was cut short?)", paths[0],
               steps, paths[i], file_steps);
    ranks.push_back(rank);
  }
  return {world, ranks};
}

// The tensors a file's metadata lists as shards (kiln.sharded: {name: whole shape}), by name;
// nullopt for a file without the list (written before kiln wrote it).
std::optional<std::map<std::string, Shape>> sharded_list(const std::string& path,
                                                          const std::map<std::string, std::string>& metadata) {
  auto it = metadata.find("kiln.sharded");
  if (it == metadata.end()) return std::nullopt;
  const nlohmann::json list = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  KILN_CHECK(list.is_object(), "checkpoint '{}': kiln.sharded is not a JSON object of shapes", path);
  std::map<std::string, Shape> shapes;
  for (const auto& [name, shape] : list.items()) {
    KILN_CHECK(shape.is_array(), "checkpoint '{}': kiln.sharded's '{}' is not a shape", path, name);
    shapes[name] = shape.get<Shape>();
  }
  return shapes;
}

// Whether file `path` of a group of `world` holds tensor `name` (of full type `full`) as its shard
// of ceil(n / world) elements rather than whole: as its metadata's kiln.sharded list says, else
// as its stored type says (a 1-element tensor's shard has the whole's shape: the list tells
// them apart). Throws when the stored type is neither.
bool holds_shard(const std::string& path, const std::map<std::string, std::string>& metadata, const std::string& name,
                 const TensorType& stored, const TensorType& full, int world) {
  const int64_t k = (full.numel() + world - 1) / world;
  const TensorType shard{full.dtype, {k}};
  const std::optional<std::map<std::string, Shape>> listed = sharded_list(path, metadata);
  const bool is_shard = listed ? listed->count(name) > 0 : stored != full;
  KILN_CHECK(is_shard ? world > 1 && stored == shard : stored == full, "checkpoint '{}': '{}' is {}, the model needs {}{}",
             path, name, to_string(stored), to_string(full),
             world > 1 ? fmt::format(" (or its shard of {} ranks, {} elements)", world, k) : "");
  return is_shard;
}

}  // namespace

std::string checkpoint_path(const std::string& dir, int rank, int world_size, bool previous) {
  const std::filesystem::path d = dir;
  const char* generation = previous ? "prev" : "last";
  return (world_size == 1 ? d / fmt::format("{}.safetensors", generation)
                          : d / fmt::format("{}.rank{}-of-{}.safetensors", generation, rank, world_size))
      .string();
}

std::string consolidated_path(const std::string& dir) {
  return (std::filesystem::path(dir) / "consolidated.safetensors").string();
}

void keep_previous_checkpoint(const std::string& dir, int rank, int world_size) {
  const std::string last = checkpoint_path(dir, rank, world_size);
  if (world_size > 1 && std::filesystem::exists(last))
    std::filesystem::rename(last, checkpoint_path(dir, rank, world_size, /*previous=*/true));
}

std::optional<CheckpointFiles> find_checkpoint(const std::string& dir, int world_size) {
  if (!std::filesystem::is_directory(dir)) return std::nullopt;
  // Every file a checkpoint can start from, by the group that wrote it (its metadata's world size
  // and rank; a single process's and a consolidated file are rank 0 of 1), with its step.
  struct File {
    std::string path;
    int64_t steps;
    std::string shard;
  };
  std::map<int, std::map<int, std::vector<File>>> groups;  // world size -> rank -> files
  std::vector<std::string> passed_over;
  static const std::regex name_pattern(R"((last|prev)(\.rank\d+-of-\d+)?\.safetensors|consolidated\.safetensors)");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, name_pattern)) continue;
    try {
      const SafetensorsHeader header = load_safetensors_header(entry.path().string());
      const auto [world, rank] = group_of(entry.path().string(), header.metadata);
      groups[world][rank].push_back(
          File{entry.path().string(), steps_of(entry.path().string(), header.metadata), meta(header.metadata, "kiln.shard", "none")});
    } catch (const Error& error) {
      passed_over.push_back(error.what());
    }
  }
  // Per group, the newest step that every rank has a file of (a save cut short on some ranks
  // leaves the previous generation whole).
  std::optional<CheckpointFiles> best;
  for (const auto& [world, ranks] : groups) {
    std::optional<CheckpointFiles> newest;
    for (const File& file : ranks.begin()->second) {
      if (newest && newest->steps_done >= file.steps) continue;
      CheckpointFiles candidate{{}, file.steps, world, file.shard};
      for (int rank = 0; rank < world; ++rank) {
        auto files = ranks.find(rank);
        if (files == ranks.end()) break;
        auto at = std::find_if(files->second.begin(), files->second.end(), [&](const File& f) { return f.steps == file.steps; });
        if (at == files->second.end()) break;
        candidate.paths.push_back(at->path);
      }
      if (static_cast<int>(candidate.paths.size()) == world) newest = candidate;
    }
    if (!newest) {
      passed_over.push_back(fmt::format("the files of {} rank{} have no step that every rank's file is at (a file "
                                        "missing, or a save cut short)", world, world == 1 ? "" : "s"));
      continue;
    }
    const auto order = [&](const CheckpointFiles& c) { return std::pair(c.steps_done, c.world_size == world_size); };
    if (!best || order(*newest) > order(*best)) best = newest;
  }
  KILN_CHECK(best || passed_over.empty(), "no complete checkpoint in '{}': {}", dir, fmt::join(passed_over, "; "));
  return best;
}

std::map<std::string, TensorType> checkpoint_types(const std::vector<std::string>& paths) {
  KILN_CHECK(!paths.empty(), "no checkpoint files given");
  const SafetensorsHeader header = load_safetensors_header(paths[0]);
  std::map<std::string, TensorType> types = header.types;
  if (const std::optional<std::map<std::string, Shape>> listed = sharded_list(paths[0], header.metadata))
    for (const auto& [name, shape] : *listed)
      if (auto it = types.find(name); it != types.end()) it->second.shape = shape;
  return types;
}

CheckpointRead read_checkpoint(const std::vector<std::string>& paths, const std::map<std::string, TensorPart>& want) {
  std::vector<SafetensorsHeader> headers;
  for (const std::string& path : paths) headers.push_back(load_safetensors_header(path));
  const auto [world, ranks] = check_group(paths, headers);
  // Which files each wanted part is read from, checked before any data is: a whole tensor from
  // one file, a sharded one from the files of the old shards that overlap the part.
  std::map<std::string, bool> sharded;  // by name: held as shards by the old group
  std::vector<bool> needed(paths.size(), false);
  for (const auto& [name, part] : want) {
    for (size_t i = 0; i < paths.size(); ++i) {
      auto it = headers[i].types.find(name);
      KILN_CHECK(it != headers[i].types.end(), "checkpoint '{}' has no tensor '{}'", paths[i], name);
      const bool shard = holds_shard(paths[i], headers[i].metadata, name, it->second, part.full, world);
      KILN_CHECK(i == 0 || shard == sharded[name], "checkpoint '{}' holds '{}' {} while '{}' holds it {}", paths[i],
                 name, shard ? "as a shard" : "whole", paths[0], shard ? "whole" : "as a shard");
      sharded[name] = shard;
    }
    const int64_t end = std::min(part.begin + part.stored.numel(), part.full.numel());
    if (!sharded[name] || part.begin >= end) continue;
    const int64_t k = (part.full.numel() + world - 1) / world;
    for (int64_t rank = part.begin / k; rank <= (end - 1) / k; ++rank) {
      auto at = std::find(ranks.begin(), ranks.end(), rank);
      KILN_CHECK(at != ranks.end(),
                 "checkpoint '{}' is of a group of {}: this rank's part of '{}' is in rank {}'s file, not given (read "
                 "every rank's last.rank*-of-{}.safetensors)",
                 paths[0], world, name, rank, world);
      needed[at - ranks.begin()] = true;
    }
  }
  // Whole tensors come from a file read anyway, else the first.
  const size_t whole_source = std::find(needed.begin(), needed.end(), true) - needed.begin();
  const size_t source = whole_source < needed.size() ? whole_source : 0;
  needed[source] = true;

  CheckpointRead out;
  out.metadata = headers[source].metadata;
  for (const auto& [name, part] : want) {
    Tensor t(part.stored);
    std::memset(t.raw(), 0, t.bytes());
    out.tensors.emplace(name, std::move(t));
  }
  // File `i` holds elements [first, first + count) of a tensor's flat whole (all of a whole
  // one); copy what of them falls in each wanted part. One file in memory at a time.
  for (size_t i = 0; i < paths.size(); ++i) {
    if (!needed[i]) continue;
    SafetensorsFile file = load_safetensors(paths[i]);
    for (const auto& [name, part] : want) {
      if (!sharded[name] && i != source) continue;
      const Tensor& from = file.tensors.at(name);
      const int64_t first = sharded[name] ? from.numel() * ranks[i] : 0;
      const int64_t begin = std::max(first, part.begin);
      const int64_t end = std::min({first + from.numel(), part.begin + part.stored.numel(), part.full.numel()});
      if (begin >= end) continue;
      const size_t element = dtype_size(part.full.dtype);
      Tensor& to = out.tensors.at(name);
      std::memcpy(to.raw() + static_cast<size_t>(begin - part.begin) * element,
                  from.raw() + static_cast<size_t>(begin - first) * element, static_cast<size_t>(end - begin) * element);
    }
  }
  return out;
}

}  // namespace kiln::train
