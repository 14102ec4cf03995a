// Checkpoint files across world sizes (train/checkpoint/reshard.h): which checkpoint a directory's
// files make (the newest complete one; sets cut short passed over), and a rank's part of each
// tensor assembled from another group's shards (or read from its own file alone where that holds
// it), on files written here with known values.
// (tests/distributed/sharded_training_test.cc trains across world sizes and modes with them.)
#include "train/checkpoint/reshard.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "train/checkpoint/safetensors.h"
#include "train/temp_dir.h"

namespace kiln::train {
namespace {

// A tensor of 7 elements, held by a group of `world` ranks as shards of ceil(7 / world)
// (zero-padded), and a 2x2 one held whole by every rank; random values.
const Tensor kFull = random_tensor(TensorType{DType::kF32, {7}}, 11, -1.0, 1.0);
const Tensor kWhole = random_tensor(TensorType{DType::kF32, {2, 2}}, 12, -1.0, 1.0);

void write_group(const testing::TempDir& dir, int world, int64_t steps, int only_rank = -1) {
  const int64_t k = (kFull.numel() + world - 1) / world;
  for (int rank = 0; rank < world; ++rank) {
    if (only_rank >= 0 && rank != only_rank) continue;
    Tensor shard(TensorType{DType::kF32, {world == 1 ? kFull.numel() : k}});
    for (int64_t i = 0; i < shard.numel(); ++i) {
      const int64_t at = world == 1 ? i : rank * k + i;
      shard.set(i, at < kFull.numel() ? kFull.get(at) : 0.0);
    }
    std::map<std::string, std::string> metadata = {{"kiln.steps_done", std::to_string(steps)}};
    if (world > 1) {
      metadata["kiln.world_size"] = std::to_string(world);
      metadata["kiln.rank"] = std::to_string(rank);
      metadata["kiln.shard"] = "zero3";
    }
    save_safetensors(checkpoint_path(dir.path().string(), rank, world),
                     {{"a", world == 1 ? kFull : shard}, {"b", kWhole}}, metadata);
  }
}

TEST(FindCheckpoint, TakesTheNewestCompleteSet) {
  testing::TempDir dir;
  const std::string d = dir.path().string();
  EXPECT_FALSE(find_checkpoint(d, 2).has_value());
  EXPECT_FALSE(find_checkpoint(d + "/absent", 2).has_value());
  write_group(dir, 1, 1);
  write_group(dir, 2, 3);
  std::optional<CheckpointFiles> found = find_checkpoint(d, 4);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->world_size, 2);
  EXPECT_EQ(found->steps_done, 3);
  EXPECT_EQ(found->shard, "zero3");
  EXPECT_EQ(found->paths, (std::vector<std::string>{checkpoint_path(d, 0, 2), checkpoint_path(d, 1, 2)}));
  // A newer set with a file missing, then with a file a step behind, is passed over.
  write_group(dir, 3, 5, 0);
  write_group(dir, 3, 5, 1);
  EXPECT_EQ(find_checkpoint(d, 3)->world_size, 2);
  write_group(dir, 3, 4, 2);
  EXPECT_EQ(find_checkpoint(d, 3)->world_size, 2);
  write_group(dir, 3, 5, 2);
  EXPECT_EQ(find_checkpoint(d, 3)->world_size, 3);
  // At a tie, the set of the run's own size.
  write_group(dir, 2, 5);
  EXPECT_EQ(find_checkpoint(d, 3)->world_size, 3);
  EXPECT_EQ(find_checkpoint(d, 2)->world_size, 2);
  // Nothing complete: an error that says why.
  testing::TempDir broken;
  write_group(broken, 2, 3, 1);
  EXPECT_KILN_ERROR(find_checkpoint(broken.path().string(), 2), "no complete checkpoint in");
  EXPECT_KILN_ERROR(find_checkpoint(broken.path().string(), 2), "the files of 2 ranks have no step that every rank's");
}

TEST(FindCheckpoint, ASaveCutShortLeavesThePreviousGenerationWhole) {
  testing::TempDir dir;
  const std::string d = dir.path().string();
  write_group(dir, 2, 3);
  // Rank 0 has written step 5, rank 1 died before it did.
  keep_previous_checkpoint(d, 0, 2);
  write_group(dir, 2, 5, 0);
  std::optional<CheckpointFiles> found = find_checkpoint(d, 2);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->steps_done, 3);
  EXPECT_EQ(found->paths, (std::vector<std::string>{checkpoint_path(d, 0, 2, true), checkpoint_path(d, 1, 2)}));
  // Rank 1 catches up: step 5, from the last files.
  keep_previous_checkpoint(d, 1, 2);
  write_group(dir, 2, 5, 1);
  found = find_checkpoint(d, 2);
  EXPECT_EQ(found->steps_done, 5);
  EXPECT_EQ(found->paths, (std::vector<std::string>{checkpoint_path(d, 0, 2), checkpoint_path(d, 1, 2)}));
}

TEST(ReadCheckpoint, AssemblesEachRanksPartFromAnotherGroupsShards) {
  testing::TempDir dir;
  const std::string d = dir.path().string();
  write_group(dir, 3, 2);  // shards of 3: [0, 3) [3, 6) [6, 7) + 2 zeros
  const std::vector<std::string> paths = find_checkpoint(d, 2)->paths;
  const TensorType full = kFull.type(), whole = kWhole.type();
  // As a group of 2 holds them: shards of 4 elements, [4, 8) of the 7 for rank 1.
  for (int rank = 0; rank < 2; ++rank) {
    CheckpointRead read = read_checkpoint(
        paths, {{"a", TensorPart{full, 4 * rank, TensorType{DType::kF32, {4}}}}, {"b", TensorPart{whole, 0, whole}}});
    EXPECT_EQ(read.metadata.at("kiln.steps_done"), "2");
    const Tensor& a = read.tensors.at("a");
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t at = 4 * rank + i;
      EXPECT_EQ(a.get(i), at < 7 ? kFull.get(at) : 0.0) << rank << " " << i;
    }
    EXPECT_EQ(max_scaled_error(read.tensors.at("b"), kWhole, 0, 0), 0.0);
  }
  // Whole again, as one process holds it.
  CheckpointRead read = read_checkpoint(paths, {{"a", TensorPart{full, 0, full}}});
  EXPECT_EQ(max_scaled_error(read.tensors.at("a"), kFull, 0, 0), 0.0);
  // One process's file, sharded over 4.
  testing::TempDir one;
  write_group(one, 1, 2);
  read = read_checkpoint({checkpoint_path(one.path().string(), 0, 1)},
                         {{"a", TensorPart{full, 2, TensorType{DType::kF32, {2}}}}});
  EXPECT_EQ(read.tensors.at("a").get(0), kFull.get(2));
  EXPECT_EQ(read.tensors.at("a").get(1), kFull.get(3));
}

// A 1-element tensor's shard has the tensor's own shape: the kiln.sharded list (names and whole
// shapes) says which it is, and the value is rank 0's (rank 1's file holds padding).
TEST(ReadCheckpoint, AOneElementShardIsReadFromRankZero) {
  testing::TempDir dir;
  const std::string d = dir.path().string();
  const Tensor value = random_tensor(TensorType{DType::kF32, {1}}, 13, 0.5, 1.5);
  for (int rank = 0; rank < 2; ++rank) {
    Tensor held(value.type());
    held.set(0, rank == 0 ? value.get(0) : 0.0);
    save_safetensors(checkpoint_path(d, rank, 2), {{"c", held}, {"b", kWhole}},
                     {{"kiln.steps_done", "1"}, {"kiln.world_size", "2"}, {"kiln.rank", std::to_string(rank)},
                      {"kiln.sharded", R"({"c": [1]})"}});
  }
  EXPECT_EQ(checkpoint_types({checkpoint_path(d, 0, 2)}),
            (std::map<std::string, TensorType>{{"b", kWhole.type()}, {"c", value.type()}}));
  const TensorType whole = kWhole.type();
  // Rank 1's file first: the whole 'b' may come from it, 'c' must not.
  const CheckpointRead read = read_checkpoint({checkpoint_path(d, 1, 2), checkpoint_path(d, 0, 2)},
                                              {{"c", TensorPart{value.type(), 0, value.type()}}, {"b", TensorPart{whole, 0, whole}}});
  EXPECT_EQ(read.tensors.at("c").get(0), value.get(0));
  EXPECT_EQ(max_scaled_error(read.tensors.at("b"), kWhole, 0, 0), 0.0);
}

TEST(ReadCheckpoint, RefusesWhatIsNotOneCheckpointOfTheModel) {
  testing::TempDir dir;
  const std::string d = dir.path().string();
  write_group(dir, 3, 2);
  const TensorType full = kFull.type();
  const std::map<std::string, TensorPart> want = {{"a", TensorPart{full, 0, full}}};
  // The whole tensor needs every rank's file; rank 0's alone holds only its first 3 elements.
  EXPECT_KILN_ERROR(read_checkpoint({checkpoint_path(d, 0, 3)}, want),
                    "is of a group of 3: this rank's part of 'a' is in rank 1's file, not given");
  const TensorType shard{DType::kF32, {3}};
  const CheckpointRead own = read_checkpoint({checkpoint_path(d, 1, 3)}, {{"a", TensorPart{full, 3, shard}}});
  EXPECT_EQ(own.tensors.at("a").get(0), kFull.get(3));
  EXPECT_KILN_ERROR(read_checkpoint({checkpoint_path(d, 1, 3), checkpoint_path(d, 1, 3)}, want), "are both rank 1's");
  const std::vector<std::string> paths = find_checkpoint(d, 3)->paths;
  EXPECT_KILN_ERROR(read_checkpoint(paths, {{"c", TensorPart{full, 0, full}}}), "has no tensor 'c'");
  const TensorType other{DType::kF32, {10}};
  EXPECT_KILN_ERROR(read_checkpoint(paths, {{"a", TensorPart{other, 0, other}}}),
                    "'a' is f32[3], the model needs f32[10] (or its shard of 3 ranks, 4 elements)");
  write_group(dir, 3, 3, 1);
  EXPECT_KILN_ERROR(read_checkpoint(paths, want), "is at step 2");
}

}  // namespace
}  // namespace kiln::train
