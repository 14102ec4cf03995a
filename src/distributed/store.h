// The rendezvous store: a small TCP key-value store that the ranks of a job meet through (as
// torch's TCPStore). Rank 0 runs the server (StoreServer: one thread, poll(2) over its clients);
// every rank, rank 0 included, is a client (Store) connected to MASTER_ADDR:MASTER_PORT. The
// process group keeps its agreement checks and barriers here, Gloo its addresses and NCCL its
// unique id (through KeyValueStore, device/communicator.h).
//
// Liveness: each connection says its rank when it connects and says goodbye when it closes.
// When a connection with a rank closes without a goodbye (the process died or was killed), the
// server records that rank as lost, sets the key "kiln/lost" to its number, and answers every
// get that is waiting on another key with "rank N was lost" at once, so that no rank waits for
// a timeout to learn it. A client whose connection to the server drops learns that rank 0 (the
// server's process) was lost. The first lost rank is the one reported; the job is over then.
//
// Protocol: frames of a 4-byte little-endian length and a payload (an opcode and its fields);
// one request in flight per connection, answered in order. A get that must wait is parked on
// the server with its deadline, so the connection never desynchronizes on a timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "device/communicator.h"
#include "support/error.h"

namespace kiln {

using namespace std::chrono_literals;

// What the store's requests throw once a rank is lost ("... rank N was lost (<reason>)"), so
// that a caller can tell it from a timeout.
class LostRankError : public Error {
 public:
  LostRankError(int rank, const std::string& message) : Error(message), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// "60 s", "0.3 s" (for messages).
std::string format_seconds(std::chrono::milliseconds duration);

// The server, in rank 0's process. Binds every interface of MASTER_ADDR's address family on
// `port` (0: any free port; port() tells which), so that the other machines reach it.
class StoreServer {
 public:
  // Throws kiln::Error "MASTER_PORT 29500 on <host> is taken: ..." when the port is in use.
  // `host` (MASTER_ADDR) picks the address family and names the server in messages.
  // `world_size` is what every client must say it belongs to.
  StoreServer(const std::string& host, int port, int world_size);
  // Keeps serving until every client has gone (clients close after their last request), for
  // at most shutdown_timeout: rank 0 reaching the end first must not look like rank 0 lost.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  void set_shutdown_timeout(std::chrono::milliseconds timeout) { shutdown_timeout_ = timeout; }

 private:
  struct State;
  void serve();

  int port_ = 0;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::chrono::milliseconds shutdown_timeout_ = 60s;
  std::unique_ptr<State> state_;
  std::thread thread_;
};

struct StoreOptions {
  std::string host = "127.0.0.1";  // MASTER_ADDR
  int port = 29500;                // MASTER_PORT
  int rank = 0;
  int world_size = 1;
  // How long to keep trying to reach the server, and the default wait of get().
  std::chrono::milliseconds timeout = 60s;
  // Names this connection among its rank's. A rank's process may hold several (the process
  // group's watchdog has its own, since a get may block the first); the server refuses a second
  // connection of the same rank and name: two processes were given one RANK.
  std::string connection = "main";
};

// A client. Thread-safe: requests from several threads take turns on the one connection (a get
// that waits blocks the others: a thread that must not wait opens its own Store).
class Store final : public KeyValueStore {
 public:
  // Connects to the server, retrying (it may not be up yet) until options.timeout; throws
  // kiln::Error "cannot reach the rendezvous at host:port after 60 s (...)" past it, and the
  // server's refusal (a wrong world size, a rank that joined twice) at once.
  explicit Store(StoreOptions options);
  // Says goodbye: the server does not count this rank as lost.
  ~Store() override;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const StoreOptions& options() const { return options_; }

  void set(const std::string& key, const std::string& value) override;
  // Waits until `key` is set and returns its value. Throws kiln::Error naming the key and the
  // wait after `timeout` (default: options().timeout), and LostRankError ("rank N was lost")
  // as soon as the server knows one is; every request throws LostRankError once the
  // connection to the server has dropped (rank 0 lost).
  std::string get(const std::string& key) { return get(key, options_.timeout); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  // Adds `delta` to the counter `key` (absent: 0) atomically and returns the new value; get()
  // reads it as decimal text.
  int64_t add(const std::string& key, int64_t delta);
  // Waits until every key is set (errors as get's).
  void wait(const std::vector<std::string>& keys) { wait(keys, options_.timeout); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // The rank the server saw lost (0 when the server itself is gone), or nullopt; asks the
  // server unless one is already known. Never throws.
  std::optional<int> lost_rank();
  // Why lost_rank() was lost, "" while none is.
  std::string lost_reason() const;
  // Tells the server that this rank is leaving the job because of an error: the other ranks see
  // it lost at once, with `reason`, as if its process had died (rather than waiting on it until
  // their timeouts). Never throws.
  void declare_lost(const std::string& reason) noexcept;
  std::string local_address() const override { return local_address_; }

 private:
  struct Reply;
  Reply request(const std::string& frame, std::chrono::milliseconds wait, const char* what);
  [[noreturn]] void throw_lost(const std::string& doing) const;
  void record_lost(int rank, const std::string& reason);

  StoreOptions options_;
  int fd_ = -1;
  std::string local_address_;
  mutable std::mutex mutex_;          // one request at a time
  bool broken_ = false;               // the connection is unusable (guarded by mutex_)
  std::atomic<int> lost_{-1};
  std::string lost_reason_;           // set once, before lost_ (guarded by reason_mutex_)
  mutable std::mutex reason_mutex_;
};

}  // namespace kiln
