// The process group: one per process of a distributed job. It owns the rendezvous store (and,
// on rank 0, its server), the communicator of the job's device (NCCL or Gloo, through
// make_communicator) and a watchdog thread, and offers what the trainer needs besides the
// collectives themselves: a barrier, and a check that every rank compiled the same step.
//
// Failures never hang:
//   - a rank that does not join: init_process_group throws after the timeout, naming how many
//     joined;
//   - a rank that dies (or is killed): the store sees its connection drop, answers every
//     waiting get with "rank N was lost", and each rank's watchdog calls its handler within a
//     watchdog period (the default handler ends the process: see exit_on_lost_rank);
//   - a rank that stops with an error (its ProcessGroup is destroyed while an exception
//     unwinds): it tells the store before leaving, and the others see it lost the same way;
//   - a rank that leaves early without an error: its destructor waits at a last barrier for the
//     others to finish too, up to the timeout, and then leaves as lost;
//   - disagreement (a different model, batch, flags or build on one rank): check_agreement
//     throws on every rank with the same message;
//   - NCCL's own asynchronous errors: the watchdog polls them too.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "device/communicator.h"
#include "distributed/env.h"
#include "distributed/store.h"

namespace kiln {

// Called once, on the watchdog's thread, when a rank is lost: `rank` is the lost rank, or -1
// when the engine reported an error without naming one (NCCL's asynchronous error). The CLI
// owns the exit policy; the handler must end the process, or make the main thread stop, since
// that thread may be blocked in a collective that only ProcessGroup::abort() can end.
using LostRankHandler = std::function<void(int rank, const std::string& reason)>;

struct ProcessGroupOptions {
  // Joining the rendezvous, every wait on the store, and each Gloo collective.
  std::chrono::milliseconds timeout = 60s;
  // Rank 0 serves the store at MASTER_ADDR:MASTER_PORT. Tests that run ranks as threads turn
  // this off and start a StoreServer on port 0 themselves (its port() is then MASTER_PORT).
  bool serve_store = true;
  bool watchdog = true;
  // How often the watchdog asks the store and the engine whether something failed.
  std::chrono::milliseconds watchdog_period = 200ms;
  // Empty: exit_on_lost_rank.
  LostRankHandler on_lost;
};

class ProcessGroup {
 public:
  // Stops the watchdog and leaves: cleanly after a last barrier with every rank, or, while an
  // exception unwinds (or when that barrier fails), telling the store this rank is lost and
  // aborting the communicator.
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  const DistEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  Device device() const { return device_; }
  // What the collective ops call (shared: the executor may keep it).
  const std::shared_ptr<Communicator>& communicator() const { return communicator_; }
  Store& store() { return *store_; }

  // Returns once every rank has called it (the n-th call of each rank meets the others' n-th).
  // Throws kiln::Error after the timeout, or at once when a rank is lost.
  void barrier();
  // Every rank gives a fingerprint of `what` (the lead passes a hash of the compiled step, the
  // flags and the build version); throws kiln::Error on every rank when one differs from rank
  // 0's: "rank 1 disagrees with rank 0 on <what>: <fp1> vs <fp0> (different model, batch, flags
  // or build?)". Like barrier(), the n-th calls of the ranks are compared with each other.
  void check_agreement(const std::string& what, const std::string& fingerprint);

  // Ends the communicator's work in flight (NCCL: ncclCommAbort), so that a thread blocked in a
  // collective returns; the communicator is unusable afterwards. For lost-rank handlers.
  void abort() noexcept;
  // The default lost-rank handler: prints "kiln: rank N was lost (<reason>); exiting" to stderr,
  // aborts the communicator (given at most a few seconds), and ends the process with _exit(1).
  // Ending the process is the only prompt way out: the main thread may be blocked in a
  // collective (a GPU kernel waiting for a dead peer never returns by itself), and a launcher
  // (torchrun, kiln launch) then ends the job's other processes. On rank 0, whose process
  // serves the store, it first waits a moment so that the others read which rank was lost
  // rather than seeing rank 0 go.
  void exit_on_lost_rank(int rank, const std::string& reason) noexcept;

 private:
  friend std::unique_ptr<ProcessGroup> init_process_group(const DistEnv&, Device,
                                                          ProcessGroupOptions);
  ProcessGroup(const DistEnv& env, Device device, ProcessGroupOptions options);
  void start_watchdog();
  void stop_watchdog();
  void watch();

  DistEnv env_;
  Device device_;
  ProcessGroupOptions options_;
  int exceptions_at_start_;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<Store> store_;
  std::shared_ptr<Communicator> communicator_;
  // communicator_ for the watchdog's thread, once made (nullptr before and after).
  std::atomic<Communicator*> active_communicator_{nullptr};
  int barriers_ = 0;
  int agreements_ = 0;

  std::unique_ptr<Store> watch_store_;  // the watchdog's own connection: a get may block store_
  std::thread watchdog_;
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_wake_;
  bool stopping_ = false;
};

// Joins the job `env` describes on `device`: rank 0 serves the store, every rank connects to it
// and waits until all WORLD_SIZE have joined (kiln::Error after options.timeout, naming how many
// did), then starts the watchdog and creates the communicator. On CUDA it checks that this
// machine has a GPU for LOCAL_RANK and makes it the calling thread's current device first.
// A rank that fails here tells the others (they see it lost) before throwing.
std::unique_ptr<ProcessGroup> init_process_group(const DistEnv& env, Device device,
                                                 ProcessGroupOptions options = {});

}  // namespace kiln
