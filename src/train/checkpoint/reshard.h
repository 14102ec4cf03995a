// Checkpoints that reshard: what a run at one world size and shard mode wrote, read by a run at
// any other.
//
// A checkpoint is one file (a single process's last.safetensors, or a group's
// consolidated.safetensors: every tensor whole) or the N files of a group of N ranks,
// last.rank{r}-of-{N}.safetensors (and the generation before, prev.*), each holding rank r's
// tensors: whole where the rank held them
// whole, else its shard, the flat slice [r*k, (r+1)*k) of the tensor zero-padded to N*k elements
// (k = ceil(n/N): passes/sharding.h). A rank of a new group reads from them the part it keeps:
// a tensor whole, or its own shard of it, assembled from whichever old shards overlap it. Each
// file is read in turn and dropped, so a rank holds one old file at a time.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::train {

// A checkpoint's files, in rank order, and what their metadata says.
struct CheckpointFiles {
  std::vector<std::string> paths;
  int64_t steps_done = 0;
  int world_size = 1;          // the group that wrote it (1: one file)
  std::string shard = "none";  // its --shard mode
};

// The file rank `rank` of a group of `world_size` writes in `dir` (last.safetensors alone), or
// with `previous` the one it wrote before (prev.rankR-of-N.safetensors).
std::string checkpoint_path(const std::string& dir, int rank, int world_size, bool previous = false);
// consolidated.safetensors in `dir`.
std::string consolidated_path(const std::string& dir);
// Before a rank of a group writes its file: the one it wrote last becomes the previous one. A
// group's N files cannot be replaced at once; until every rank has written its new file, the
// previous ones are still a complete checkpoint. (A single process's file is replaced
// atomically: it keeps none.)
void keep_previous_checkpoint(const std::string& dir, int rank, int world_size);

// The newest complete checkpoint in `dir` (the most steps done): last.safetensors, a set of one
// group's rank files at one step (each rank's last file or its previous one), or
// consolidated.safetensors; at a tie, the set of `world_size` ranks (the cheapest to read).
// nullopt when `dir` holds none. When no group's files make a complete set (a file missing),
// kiln::Error says why.
std::optional<CheckpointFiles> find_checkpoint(const std::string& dir, int world_size);

// What a rank keeps of one tensor: `stored` == `full` for the whole tensor, else a 1-D shard of
// `stored.numel()` elements: the flat full tensor's elements from `begin` on (zero past its end).
struct TensorPart {
  TensorType full;
  int64_t begin = 0;
  TensorType stored;
};

// Every tensor's whole type in the checkpoint `paths` (a sharded one's from the metadata's
// kiln.sharded list, which kiln writes): what read_checkpoint reads whole, as an export does.
std::map<std::string, TensorType> checkpoint_types(const std::vector<std::string>& paths);

struct CheckpointRead {
  std::map<std::string, Tensor> tensors;        // by name, each of its TensorPart::stored type
  std::map<std::string, std::string> metadata;  // the first file's
};

// Reads the parts `want` names from the checkpoint `paths`: one file of a single process (or a
// consolidated one), or rank files of one group of N (every rank's, as find_checkpoint gives
// them, or those that hold the wanted parts: a rank of a group of the same size and mode needs
// only its own). Reads only the files it needs. Checks everything it can before reading data:
// the files are of one group and one step, every wanted tensor is in each file whole or as a
// shard of N, of the wanted dtype and size, and the files given hold every wanted part. Throws
// kiln::Error naming the file and tensor.
CheckpointRead read_checkpoint(const std::vector<std::string>& paths, const std::map<std::string, TensorPart>& want);

}  // namespace kiln::train
