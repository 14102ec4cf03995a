// DistEnv from torchrun's variables: defaults, and one clear error per bad value.
#include "distributed/env.h"

#include <gtest/gtest.h>

#include <map>

#include "test_util.h"

namespace kiln {
namespace {

std::optional<DistEnv> parse(const std::map<std::string, std::string>& vars) {
  return parse_dist_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

const std::map<std::string, std::string> kFourRanks = {
    {"WORLD_SIZE", "4"}, {"RANK", "3"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
    {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29511"}};

std::map<std::string, std::string> with(std::string name, std::optional<std::string> value) {
  std::map<std::string, std::string> vars = kFourRanks;
  if (value) vars[name] = *value;
  else vars.erase(name);
  return vars;
}

TEST(DistEnv, NoWorldSizeIsASingleProcess) {
  EXPECT_FALSE(parse({}).has_value());
  EXPECT_FALSE(parse({{"RANK", "1"}, {"MASTER_ADDR", "x"}}).has_value());
}

TEST(DistEnv, ReadsTorchrunsVariables) {
  DistEnv env = parse(kFourRanks).value();
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "node7");
  EXPECT_EQ(env.master_port, 29511);
}

TEST(DistEnv, LocalDefaultsAreOneMachine) {
  DistEnv env = parse(with("LOCAL_RANK", std::nullopt)).value();
  EXPECT_EQ(env.local_rank, 1);  // RANK 3 is the second of its machine's 2
  env = parse({{"WORLD_SIZE", "3"}, {"RANK", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}).value();
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 3);
  // One process needs no rendezvous address.
  env = parse({{"WORLD_SIZE", "1"}}).value();
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
}

TEST(DistEnv, BadValuesNameTheVariable) {
  EXPECT_KILN_ERROR(parse(with("RANK", "abc")), "RANK='abc' is not an integer");
  EXPECT_KILN_ERROR(parse(with("RANK", "1x")), "RANK='1x' is not an integer");
  EXPECT_KILN_ERROR(parse(with("WORLD_SIZE", "")), "WORLD_SIZE='' is not an integer");
  EXPECT_KILN_ERROR(parse(with("WORLD_SIZE", "99999999999")), "WORLD_SIZE='99999999999' is not an integer");
  EXPECT_KILN_ERROR(parse(with("WORLD_SIZE", "0")), "WORLD_SIZE=0 must be at least 1");
  EXPECT_KILN_ERROR(parse(with("RANK", "4")), "RANK=4 is not a rank of WORLD_SIZE=4 (expected 0 to 3)");
  EXPECT_KILN_ERROR(parse(with("RANK", "-1")), "RANK=-1 is not a rank of WORLD_SIZE=4");
  EXPECT_KILN_ERROR(parse(with("RANK", std::nullopt)), "WORLD_SIZE=4 but RANK is not set");
  EXPECT_KILN_ERROR(parse(with("LOCAL_RANK", "2")), "LOCAL_RANK=2 is not a rank of LOCAL_WORLD_SIZE=2");
  EXPECT_KILN_ERROR(parse(with("LOCAL_WORLD_SIZE", "5")), "LOCAL_WORLD_SIZE=5 must be between 1 and WORLD_SIZE=4");
  EXPECT_KILN_ERROR(parse(with("MASTER_ADDR", std::nullopt)), "WORLD_SIZE=4 but MASTER_ADDR is not set");
  EXPECT_KILN_ERROR(parse(with("MASTER_ADDR", "")), "MASTER_ADDR is empty");
  EXPECT_KILN_ERROR(parse(with("MASTER_PORT", std::nullopt)), "WORLD_SIZE=4 but MASTER_PORT is not set");
  EXPECT_KILN_ERROR(parse(with("MASTER_PORT", "70000")), "MASTER_PORT=70000 is not a TCP port");
  EXPECT_KILN_ERROR(parse(with("MASTER_PORT", "0")), "MASTER_PORT=0 is not a TCP port");
}

}  // namespace
}  // namespace kiln
