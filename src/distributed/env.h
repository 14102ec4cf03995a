// Where this process stands in a distributed job, from the variables its launcher set:
// torchrun's (and `kiln launch`'s) RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, or, for a task that Slurm's srun started, SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID, SLURM_NTASKS_PER_NODE and the first host of SLURM_JOB_NODELIST.
//
// rank is the global rank (0 .. world_size - 1, one process per device across every machine);
// local_rank is the rank among the processes of this machine (0 .. local_world_size - 1), which
// is also the GPU it uses. Rank 0 serves the rendezvous store at master_addr:master_port; the
// engines (Gloo's TCP pairs, NCCL's own transports) connect across machines themselves.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace kiln {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  // 0 (in code only, never from the environment): rank 0's store takes any free port.
  int master_port = 29500;
  // How many times the launcher has restarted the job after a failure (torchrun's and kiln
  // launch's TORCHELASTIC_RESTART_COUNT, Slurm's SLURM_RESTART_COUNT): a restarted training job
  // resumes from its last checkpoint.
  int restart_count = 0;
  std::string launcher = "torchrun";  // whose variables these are: "torchrun" or "Slurm" (messages)
};

// torchrun's variables when WORLD_SIZE is set; else Slurm's when SLURM_NTASKS and SLURM_PROCID
// are (srun started this process as one of its tasks); else nullopt (a single process).
//
// torchrun's: every variable is checked and a bad one throws kiln::Error naming it and its
// value: not an integer, RANK missing or not in [0, WORLD_SIZE), LOCAL_RANK not in [0,
// LOCAL_WORLD_SIZE), MASTER_ADDR or MASTER_PORT missing while WORLD_SIZE > 1, a port outside
// 1..65535. LOCAL_WORLD_SIZE defaults to WORLD_SIZE (one machine) and LOCAL_RANK to RANK %
// LOCAL_WORLD_SIZE; MASTER_ADDR/PORT default to 127.0.0.1:29500 for WORLD_SIZE=1. Under torchrun
// (TORCHELASTIC_USE_AGENT_STORE=True) its agent's own store holds MASTER_PORT: kiln's rendezvous
// takes MASTER_PORT + 1.
//
// Slurm's: RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID,
// LOCAL_WORLD_SIZE = SLURM_NTASKS_PER_NODE, else this node's count in SLURM_TASKS_PER_NODE
// ("4(x2),3": 4 on nodes 0 and 1, 3 on node 2; SLURM_NODEID says which is this one).
// MASTER_ADDR and MASTER_PORT win where set; else the first host of SLURM_JOB_NODELIST (or
// SLURM_NODELIST) and 29500 + SLURM_JOB_ID % 10000 (two jobs sharing a node meet at
// different ports).
std::optional<DistEnv> dist_env_from_environment();
// The same over any lookup (tests): `lookup(name)` returns the value or nullptr when unset.
std::optional<DistEnv> parse_dist_env(const std::function<const char*(const char*)>& lookup);

// The first host of a Slurm host list: "node[01-04,07],gpu5" -> "node01", "a,b" -> "a",
// "rack[2-3]-n[10-11]" -> "rack2-n10". Throws kiln::Error naming `variable` and the list when it
// is not one (empty, an unclosed bracket, an empty range).
std::string first_slurm_host(std::string_view nodelist, std::string_view variable = "SLURM_JOB_NODELIST");

}  // namespace kiln
