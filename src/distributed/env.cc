// DistEnv from torchrun's or Slurm's variables (distributed/env.h).
#include "distributed/env.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <vector>

#include "support/error.h"

namespace kiln {
namespace {

using Lookup = std::function<const char*(const char*)>;

const char* const kLaunchHint = "(start the job with torchrun or kiln launch, or set it)";
constexpr int kDefaultPort = 29500;

// `text` as a whole integer, or nullopt.
std::optional<int> parse_integer(std::string_view text) {
  int parsed = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return parsed;
}

// The value of `name` as an integer: nullopt when unset; kiln::Error for an empty or
// non-numeric value or one out of int's range.
std::optional<int> integer_variable(const Lookup& lookup, const char* name) {
  const char* text = lookup(name);
  if (text == nullptr) return std::nullopt;
  std::optional<int> parsed = parse_integer(text);
  KILN_CHECK(parsed.has_value(), "{}='{}' is not an integer", name, text);
  return parsed;
}

void check_port(int port, const char* variable) {
  KILN_CHECK(port >= 1 && port <= 65535, "{}={} is not a TCP port (1 to 65535)", variable, port);
}

// MASTER_ADDR and MASTER_PORT where set (both launchers honour them).
void read_master(const Lookup& lookup, DistEnv& env) {
  if (const char* addr = lookup("MASTER_ADDR")) {
    KILN_CHECK(*addr != '\0', "MASTER_ADDR is empty (expected the host of rank 0)");
    env.master_addr = addr;
  }
  if (std::optional<int> port = integer_variable(lookup, "MASTER_PORT")) {
    check_port(*port, "MASTER_PORT");
    env.master_port = *port;
  }
}

void check_ranks(const DistEnv& env, const char* rank, const char* world, const char* local_rank,
                 const char* local_world) {
  KILN_CHECK(env.world_size >= 1, "{}={} must be at least 1", world, env.world_size);
  KILN_CHECK(env.rank >= 0 && env.rank < env.world_size, "{}={} is not a rank of {}={} (expected 0 to {})", rank,
             env.rank, world, env.world_size, env.world_size - 1);
  KILN_CHECK(env.local_world_size >= 1 && env.local_world_size <= env.world_size,
             "{}={} must be between 1 and {}={}", local_world, env.local_world_size, world, env.world_size);
  KILN_CHECK(env.local_rank >= 0 && env.local_rank < env.local_world_size,
             "{}={} is not a rank of {}={} (expected 0 to {})", local_rank, env.local_rank, local_world,
             env.local_world_size, env.local_world_size - 1);
}

std::optional<DistEnv> torchrun_env(const Lookup& lookup, int world_size) {
  DistEnv env;
  env.world_size = world_size;
  std::optional<int> rank = integer_variable(lookup, "RANK");
  KILN_CHECK(rank || env.world_size <= 1, "WORLD_SIZE={} but RANK is not set {}", env.world_size, kLaunchHint);
  env.rank = rank.value_or(0);
  env.local_world_size = integer_variable(lookup, "LOCAL_WORLD_SIZE").value_or(env.world_size);
  // Launchers number ranks machine by machine.
  env.local_rank = integer_variable(lookup, "LOCAL_RANK").value_or(env.rank % std::max(env.local_world_size, 1));
  check_ranks(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  KILN_CHECK(env.world_size == 1 || lookup("MASTER_ADDR") != nullptr,
             "WORLD_SIZE={} but MASTER_ADDR is not set (the host of rank 0) {}", env.world_size, kLaunchHint);
  KILN_CHECK(env.world_size == 1 || lookup("MASTER_PORT") != nullptr,
             "WORLD_SIZE={} but MASTER_PORT is not set (rank 0's rendezvous port) {}", env.world_size, kLaunchHint);
  read_master(lookup, env);
  // torchrun's agent serves its own store (torch's TCPStore) at MASTER_PORT: kiln's listens at
  // the next port.
  if (const char* agent_store = lookup("TORCHELASTIC_USE_AGENT_STORE"); agent_store && std::string_view(agent_store) == "True") {
    KILN_CHECK(env.master_port < 65535, "MASTER_PORT={} leaves no next port for kiln's store beside torchrun's",
               env.master_port);
    ++env.master_port;
  }
  env.restart_count = integer_variable(lookup, "TORCHELASTIC_RESTART_COUNT").value_or(0);
  KILN_CHECK(env.restart_count >= 0, "TORCHELASTIC_RESTART_COUNT={} is negative", env.restart_count);
  return env;
}

// This node's task count from SLURM_TASKS_PER_NODE ("4(x2),3": 4, 4, 3 on nodes 0, 1, 2).
int tasks_on_node(const std::string_view whole, int node) {
  const auto bad = [&] {
    fail("SLURM_TASKS_PER_NODE='{}' is not a task count list (expected e.g. 4(x2),3)", whole);
  };
  std::string_view list = whole;
  int first_node = 0;
  while (!list.empty()) {
    const size_t comma = list.find(',');
    std::string_view item = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    int repeat = 1;
    if (const size_t open = item.find("(x"); open != std::string_view::npos) {
      if (item.back() != ')') bad();
      std::optional<int> times = parse_integer(item.substr(open + 2, item.size() - open - 3));
      if (!times || *times < 1) bad();
      repeat = *times;
      item = item.substr(0, open);
    }
    std::optional<int> count = parse_integer(item);
    if (!count || *count < 1) bad();
    if (node < first_node + repeat) return *count;
    first_node += repeat;
  }
  fail("SLURM_TASKS_PER_NODE names {} nodes, but SLURM_NODEID is {}", first_node, node);
}

std::optional<DistEnv> slurm_env(const Lookup& lookup, int tasks) {
  DistEnv env;
  env.launcher = "Slurm";
  env.world_size = tasks;
  env.rank = integer_variable(lookup, "SLURM_PROCID").value();
  if (std::optional<int> per_node = integer_variable(lookup, "SLURM_NTASKS_PER_NODE")) {
    env.local_world_size = *per_node;
  } else if (const char* list = lookup("SLURM_TASKS_PER_NODE")) {
    env.local_world_size = tasks_on_node(list, integer_variable(lookup, "SLURM_NODEID").value_or(0));
  } else {
    env.local_world_size = env.world_size;
  }
  env.local_rank = integer_variable(lookup, "SLURM_LOCALID").value_or(env.rank % std::max(env.local_world_size, 1));
  check_ranks(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
  const char* nodelist_variable = lookup("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
  if (const char* nodelist = lookup(nodelist_variable)) env.master_addr = first_slurm_host(nodelist, nodelist_variable);
  if (std::optional<int> job = integer_variable(lookup, "SLURM_JOB_ID")) env.master_port = kDefaultPort + *job % 10000;
  read_master(lookup, env);
  KILN_CHECK(env.world_size == 1 || lookup("MASTER_ADDR") != nullptr || lookup(nodelist_variable) != nullptr,
             "SLURM_NTASKS={} but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set (the host of rank 0)",
             env.world_size);
  env.restart_count = integer_variable(lookup, "SLURM_RESTART_COUNT").value_or(0);
  return env;
}

}  // namespace

std::string first_slurm_host(std::string_view nodelist, std::string_view variable) {
  const auto bad = [&](std::string_view why) {
    fail("{}='{}' is not a Slurm host list ({}; expected e.g. node[01-04,07])", variable, nodelist, why);
  };
  std::string host;
  for (size_t i = 0; i < nodelist.size(); ++i) {
    const char c = nodelist[i];
    if (c == ',') break;  // the first host's expression ends at a comma outside brackets
    if (c == ']') bad("a ']' without its '['");
    if (c != '[') {
      host += c;
      continue;
    }
    const size_t close = nodelist.find(']', i);
    if (close == std::string_view::npos) bad("an unclosed '['");
    // The first number of the bracket's first range, as written (with its leading zeros).
    std::string_view ranges = nodelist.substr(i + 1, close - i - 1);
    std::string_view first = ranges.substr(0, ranges.find_first_of(",-"));
    if (first.empty() || first.find_first_not_of("0123456789") != std::string_view::npos)
      bad(fmt::format("'[{}]' does not start with a number", ranges));
    host += first;
    i = close;
  }
  if (host.empty()) bad("no host");
  return host;
}

std::optional<DistEnv> parse_dist_env(const Lookup& lookup) {
  if (std::optional<int> world_size = integer_variable(lookup, "WORLD_SIZE")) return torchrun_env(lookup, *world_size);
  if (lookup("SLURM_PROCID") != nullptr)
    if (std::optional<int> tasks = integer_variable(lookup, "SLURM_NTASKS")) return slurm_env(lookup, *tasks);
  return std::nullopt;
}

std::optional<DistEnv> dist_env_from_environment() {
  return parse_dist_env([](const char* name) { return std::getenv(name); });
}

}  // namespace kiln
