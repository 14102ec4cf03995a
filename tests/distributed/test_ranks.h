// Helpers for the distributed tests: ranks as threads of this process, a rank in a child
// process that a test can kill as a crash would, and free ports.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "distributed/process_group.h"
#include "distributed/store.h"
#include "support/error.h"

namespace kiln::testing {

#ifdef KILN_HAVE_GLOO
inline constexpr bool kHaveGloo = true;
#else
inline constexpr bool kHaveGloo = false;
#endif

// Rank `rank` of `world_size` on this machine, its store at 127.0.0.1:port.
inline DistEnv env_of(int rank, int world_size, int port) {
  DistEnv env;
  env.rank = rank;
  env.world_size = world_size;
  env.local_rank = rank;
  env.local_world_size = world_size;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  return env;
}

// Ranks as threads share one StoreServer that the test starts (so its port is known first); a
// lost rank fails the test unless `on_lost` says otherwise.
inline ProcessGroupOptions thread_options(LostRankHandler on_lost = {}) {
  ProcessGroupOptions options;
  options.serve_store = false;
  options.timeout = 10s;
  options.watchdog_period = 50ms;
  options.on_lost = on_lost ? on_lost : [](int rank, const std::string& reason) {
    ADD_FAILURE() << "rank " << rank << " lost: " << reason;
  };
  return options;
}

inline StoreOptions client_options(int port, int rank, int world_size) {
  StoreOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.rank = rank;
  options.world_size = world_size;
  options.timeout = 10s;
  return options;
}

// A port of 127.0.0.1 that nothing listens on (it was free a moment ago).
inline int unused_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// Runs body(rank) for every rank on a thread of its own; rethrows the first exception once all
// have ended.
inline void run_ranks(int world_size, const std::function<void(int rank)>& body) {
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// A rank in a child process. Construct it before the test starts any thread (the fork then
// copies no thread's locks); start(port) hands the child the store's port, wait_ready() waits
// until its body calls ready(); kill() ends it with SIGKILL, as a crash would: no destructor
// runs, its connections just drop.
class ChildRank {
 public:
  using Body = std::function<void(int port, const std::function<void()>& ready)>;

  explicit ChildRank(const Body& body) {
    KILN_CHECK(::pipe(to_child_) == 0 && ::pipe(to_parent_) == 0, "pipe failed");
    pid_ = ::fork();
    KILN_CHECK(pid_ >= 0, "fork failed");
    if (pid_ == 0) {
      int port = 0;
      if (::read(to_child_[0], &port, sizeof(port)) != sizeof(port)) ::_exit(3);
      try {
        body(port, [this] {
          char ok = 'R';
          [[maybe_unused]] ssize_t n = ::write(to_parent_[1], &ok, 1);
        });
      } catch (...) {
        ::_exit(2);
      }
      ::_exit(0);
    }
  }
  ~ChildRank() { kill(); }
  ChildRank(const ChildRank&) = delete;
  ChildRank& operator=(const ChildRank&) = delete;

  void start(int port) {
    KILN_CHECK(::write(to_child_[1], &port, sizeof(port)) == sizeof(port), "write failed");
  }

  void wait_ready() {
    pollfd p{to_parent_[0], POLLIN, 0};
    char ok = 0;
    KILN_CHECK(::poll(&p, 1, 20000) == 1 && ::read(to_parent_[0], &ok, 1) == 1 && ok == 'R',
               "the child rank did not get ready");
  }

  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    for (int fd : {to_child_[0], to_child_[1], to_parent_[0], to_parent_[1]}) ::close(fd);
  }

 private:
  pid_t pid_ = -1;
  int to_child_[2] = {-1, -1};
  int to_parent_[2] = {-1, -1};
};

}  // namespace kiln::testing
