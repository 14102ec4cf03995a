// Where this process stands in a distributed job, from the variables torchrun (and `kiln
// launch`) set: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
//
// rank is the global rank (0 .. world_size - 1, one process per device across every machine);
// local_rank is the rank among the processes of this machine (0 .. local_world_size - 1), which
// is also the GPU it uses. Rank 0 serves the rendezvous store at master_addr:master_port.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace kiln {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  // 0 (in code only, never from the environment): rank 0's store takes any free port.
  int master_port = 29500;
};

// nullopt when WORLD_SIZE is unset (a single process, not launched by torchrun). Otherwise every
// variable is checked and a bad one throws kiln::Error naming it and its value: not an integer,
// RANK missing or not in [0, WORLD_SIZE), LOCAL_RANK not in [0, LOCAL_WORLD_SIZE), MASTER_ADDR or
// MASTER_PORT missing while WORLD_SIZE > 1, a port outside 1..65535. LOCAL_WORLD_SIZE defaults
// to WORLD_SIZE (one machine) and LOCAL_RANK to RANK % LOCAL_WORLD_SIZE; MASTER_ADDR/PORT
// default to 127.0.0.1:29500 for WORLD_SIZE=1.
std::optional<DistEnv> dist_env_from_environment();
// The same over any lookup (tests): `lookup(name)` returns the value or nullptr when unset.
std::optional<DistEnv> parse_dist_env(const std::function<const char*(const char*)>& lookup);

}  // namespace kiln
