// DistEnv from torchrun's and Slurm's variables: defaults, Slurm's host and task lists, and one
// clear error per bad value.
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

TEST(DistEnv, UnderTorchrunsAgentStoreKilnsStoreTakesTheNextPort) {
  EXPECT_EQ(parse(with("TORCHELASTIC_USE_AGENT_STORE", "True"))->master_port, 29512);
  EXPECT_EQ(parse(with("TORCHELASTIC_USE_AGENT_STORE", "False"))->master_port, 29511);
  std::map<std::string, std::string> vars = with("TORCHELASTIC_USE_AGENT_STORE", "True");
  vars["MASTER_PORT"] = "65535";
  EXPECT_KILN_ERROR(parse(vars), "MASTER_PORT=65535 leaves no next port for kiln's store beside torchrun's");
}

TEST(DistEnv, RestartCountIsTorchElastics) {
  EXPECT_EQ(parse(kFourRanks)->restart_count, 0);
  EXPECT_EQ(parse(with("TORCHELASTIC_RESTART_COUNT", "2"))->restart_count, 2);
  EXPECT_KILN_ERROR(parse(with("TORCHELASTIC_RESTART_COUNT", "x")), "TORCHELASTIC_RESTART_COUNT='x' is not an integer");
}

// What srun gives task 5 of 8 on the second of two nodes (4 tasks a node).
const std::map<std::string, std::string> kSlurmTask = {
    {"SLURM_PROCID", "5"},        {"SLURM_NTASKS", "8"},         {"SLURM_LOCALID", "1"},
    {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_NODEID", "1"},       {"SLURM_JOB_ID", "123456"},
    {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_TASKS_PER_NODE", "4(x2)"}};

std::map<std::string, std::string> slurm_with(std::string name, std::optional<std::string> value) {
  std::map<std::string, std::string> vars = kSlurmTask;
  if (value) vars[name] = *value;
  else vars.erase(name);
  return vars;
}

TEST(DistEnv, ReadsSlurmsVariablesWhenTorchrunsAreAbsent) {
  DistEnv env = parse(kSlurmTask).value();
  EXPECT_EQ(env.launcher, "Slurm");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "gpu07");
  EXPECT_EQ(env.master_port, 29500 + 123456 % 10000);
  // MASTER_ADDR and MASTER_PORT win where a job script sets them.
  std::map<std::string, std::string> vars = kSlurmTask;
  vars["MASTER_ADDR"] = "head";
  vars["MASTER_PORT"] = "31000";
  env = parse(vars).value();
  EXPECT_EQ(env.master_addr, "head");
  EXPECT_EQ(env.master_port, 31000);
  // torchrun's variables win over Slurm's (torchrun started under srun).
  vars = kSlurmTask;
  vars.insert(kFourRanks.begin(), kFourRanks.end());
  env = parse(vars).value();
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.world_size, 4);
  // Without SLURM_NTASKS_PER_NODE: this node's count in SLURM_TASKS_PER_NODE.
  vars = slurm_with("SLURM_NTASKS_PER_NODE", std::nullopt);
  vars["SLURM_TASKS_PER_NODE"] = "2,3(x2)";
  vars["SLURM_NODEID"] = "2";
  EXPECT_EQ(parse(vars)->local_world_size, 3);
  vars["SLURM_NODEID"] = "0";
  vars["SLURM_LOCALID"] = "0";
  EXPECT_EQ(parse(vars)->local_world_size, 2);
  EXPECT_EQ(parse(slurm_with("SLURM_RESTART_COUNT", "1"))->restart_count, 1);
}

TEST(DistEnv, BadSlurmValuesNameTheVariable) {
  EXPECT_KILN_ERROR(parse(slurm_with("SLURM_PROCID", "8")), "SLURM_PROCID=8 is not a rank of SLURM_NTASKS=8");
  EXPECT_KILN_ERROR(parse(slurm_with("SLURM_LOCALID", "4")), "SLURM_LOCALID=4 is not a rank of SLURM_NTASKS_PER_NODE=4");
  EXPECT_KILN_ERROR(parse(slurm_with("SLURM_JOB_NODELIST", "gpu[07-08")), "SLURM_JOB_NODELIST='gpu[07-08' is not a Slurm host list (an unclosed '['");
  std::map<std::string, std::string> vars = slurm_with("SLURM_NTASKS_PER_NODE", std::nullopt);
  vars["SLURM_TASKS_PER_NODE"] = "4(x";
  EXPECT_KILN_ERROR(parse(vars), "SLURM_TASKS_PER_NODE='4(x' is not a task count list");
  vars["SLURM_TASKS_PER_NODE"] = "4";
  EXPECT_KILN_ERROR(parse(vars), "SLURM_TASKS_PER_NODE names 1 nodes, but SLURM_NODEID is 1");
  vars = slurm_with("SLURM_JOB_NODELIST", std::nullopt);
  EXPECT_KILN_ERROR(parse(vars), "SLURM_NTASKS=8 but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set");
}

TEST(FirstSlurmHost, TakesTheFirstHostOfEveryForm) {
  EXPECT_EQ(first_slurm_host("node07"), "node07");
  EXPECT_EQ(first_slurm_host("a,b,c"), "a");
  EXPECT_EQ(first_slurm_host("node[01-04,07]"), "node01");
  EXPECT_EQ(first_slurm_host("node[7,1-3]"), "node7");
  EXPECT_EQ(first_slurm_host("node[001-004],gpu[1-2]"), "node001");
  EXPECT_EQ(first_slurm_host("rack[2-3]-n[10-11]"), "rack2-n10");
  EXPECT_EQ(first_slurm_host("host-1.cluster"), "host-1.cluster");
  EXPECT_KILN_ERROR(first_slurm_host(""), "SLURM_JOB_NODELIST='' is not a Slurm host list (no host");
  EXPECT_KILN_ERROR(first_slurm_host("node[]"), "'[]' does not start with a number");
  EXPECT_KILN_ERROR(first_slurm_host("node]1"), "a ']' without its '['");
}

}  // namespace
}  // namespace kiln
