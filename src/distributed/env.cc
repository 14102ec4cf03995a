// DistEnv from torchrun's variables (distributed/env.h).
#include "distributed/env.h"

#include <charconv>
#include <cstdlib>
#include <string_view>

#include "support/error.h"

namespace kiln {
namespace {

const char* const kLaunchHint = "(start the job with torchrun or kiln launch, or set it)";

// The value of `name` as an integer: nullopt when unset; kiln::Error for an empty or
// non-numeric value or one out of int's range.
std::optional<int> integer_variable(const std::function<const char*(const char*)>& lookup,
                                    const char* name) {
  const char* text = lookup(name);
  if (text == nullptr) return std::nullopt;
  std::string_view value(text);
  int parsed = 0;
  auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  KILN_CHECK(!value.empty() && error == std::errc() && end == value.data() + value.size(),
             "{}='{}' is not an integer", name, value);
  return parsed;
}

}  // namespace

std::optional<DistEnv> parse_dist_env(const std::function<const char*(const char*)>& lookup) {
  std::optional<int> world_size = integer_variable(lookup, "WORLD_SIZE");
  if (!world_size) return std::nullopt;
  DistEnv env;
  KILN_CHECK(*world_size >= 1, "WORLD_SIZE={} must be at least 1", *world_size);
  env.world_size = *world_size;

  std::optional<int> rank = integer_variable(lookup, "RANK");
  KILN_CHECK(rank || env.world_size == 1, "WORLD_SIZE={} but RANK is not set {}", env.world_size,
             kLaunchHint);
  env.rank = rank.value_or(0);
  KILN_CHECK(env.rank >= 0 && env.rank < env.world_size,
             "RANK={} is not a rank of WORLD_SIZE={} (expected 0 to {})", env.rank,
             env.world_size, env.world_size - 1);

  env.local_world_size = integer_variable(lookup, "LOCAL_WORLD_SIZE").value_or(env.world_size);
  KILN_CHECK(env.local_world_size >= 1 && env.local_world_size <= env.world_size,
             "LOCAL_WORLD_SIZE={} must be between 1 and WORLD_SIZE={}", env.local_world_size,
             env.world_size);
  // Launchers number ranks machine by machine.
  env.local_rank = integer_variable(lookup, "LOCAL_RANK").value_or(env.rank % env.local_world_size);
  KILN_CHECK(env.local_rank >= 0 && env.local_rank < env.local_world_size,
             "LOCAL_RANK={} is not a rank of LOCAL_WORLD_SIZE={} (expected 0 to {})",
             env.local_rank, env.local_world_size, env.local_world_size - 1);

  const char* addr = lookup("MASTER_ADDR");
  KILN_CHECK(env.world_size == 1 || addr != nullptr,
             "WORLD_SIZE={} but MASTER_ADDR is not set (the host of rank 0) {}", env.world_size,
             kLaunchHint);
  if (addr != nullptr) {
    KILN_CHECK(*addr != '\0', "MASTER_ADDR is empty (expected the host of rank 0)");
    env.master_addr = addr;
  }
  std::optional<int> port = integer_variable(lookup, "MASTER_PORT");
  KILN_CHECK(env.world_size == 1 || port,
             "WORLD_SIZE={} but MASTER_PORT is not set (rank 0's rendezvous port) {}",
             env.world_size, kLaunchHint);
  if (port) {
    KILN_CHECK(*port >= 1 && *port <= 65535, "MASTER_PORT={} is not a TCP port (1 to 65535)",
               *port);
    env.master_port = *port;
  }
  return env;
}

std::optional<DistEnv> dist_env_from_environment() {
  return parse_dist_env([](const char* name) { return std::getenv(name); });
}

}  // namespace kiln
