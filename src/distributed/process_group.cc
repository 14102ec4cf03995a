// The process group: rendezvous, communicator, agreement, watchdog (distributed/process_group.h).
#include "distributed/process_group.h"

#include <unistd.h>

#include <cstdio>
#include <exception>

#include "device/device_runtime.h"
#include "support/error.h"

namespace kiln {
namespace {

// Waits until every rank of `store`'s world has reached the counter `key`; throws kiln::Error
// "<what>: only K of N ranks arrived within T <hint>" after `timeout`, and the store's "rank N
// was lost" at once.
void meet(Store& store, const std::string& key, std::chrono::milliseconds timeout,
          const std::string& what, const std::string& hint) {
  int world_size = store.options().world_size;
  if (store.add(key, 1) == world_size) store.set(key + "/all", "");
  try {
    store.get(key + "/all", timeout);
  } catch (const LostRankError&) {
    throw;
  } catch (const Error&) {
    fail("{}: only {} of {} ranks arrived within {}{}", what, store.add(key, 0), world_size,
         format_seconds(timeout), hint);
  }
}

}  // namespace

ProcessGroup::ProcessGroup(const DistEnv& env, Device device, ProcessGroupOptions options)
    : env_(env),
      device_(device),
      options_(std::move(options)),
      exceptions_at_start_(std::uncaught_exceptions()) {}

std::unique_ptr<ProcessGroup> init_process_group(const DistEnv& env, Device device,
                                                 ProcessGroupOptions options) {
  KILN_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
             "RANK={} is not a rank of WORLD_SIZE={}", env.rank, env.world_size);
  std::unique_ptr<ProcessGroup> group(new ProcessGroup(env, device, std::move(options)));
  ProcessGroup& g = *group;
  StoreOptions store_options;
  store_options.host = env.master_addr;
  store_options.port = env.master_port;
  store_options.rank = env.rank;
  store_options.world_size = env.world_size;
  store_options.timeout = g.options_.timeout;
  if (env.rank == 0 && g.options_.serve_store) {
    g.server_ = std::make_unique<StoreServer>(env.master_addr, env.master_port, env.world_size);
    g.server_->set_shutdown_timeout(g.options_.timeout);
    store_options.port = g.server_->port();
  }
  g.store_ = std::make_unique<Store>(store_options);
  try {
    if (device == Device::kCuda) {
      DeviceAvailability gpus = device_availability(Device::kCuda);
      KILN_CHECK(gpus.built, "this build has no CUDA backend (configure with -DKILN_CUDA=ON)");
      KILN_CHECK(env.local_rank < gpus.count,
                 "WORLD_SIZE={} with LOCAL_RANK={} (LOCAL_WORLD_SIZE={}) needs a GPU per local "
                 "rank, but this machine has {} GPU{}", env.world_size, env.local_rank,
                 env.local_world_size, gpus.count, gpus.count == 1 ? "" : "s");
      device_runtime(Device::kCuda, env.local_rank)->make_current();
    }
    meet(*g.store_, "kiln/joined", g.options_.timeout,
         fmt::format("joining the rendezvous at {}:{}", env.master_addr, store_options.port),
         " (did every rank start, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?)");
    // The watchdog first: NCCL's initialization waits for every rank without a timeout of its
    // own, so a rank lost meanwhile must reach the handler too.
    if (g.options_.watchdog) g.start_watchdog();
    g.communicator_ = make_communicator(device, env.rank, env.world_size, *g.store_,
                                        g.options_.timeout);
    g.active_communicator_ = g.communicator_.get();
  } catch (const std::exception& e) {
    // The others would otherwise wait for this rank until their timeout.
    g.store_->declare_lost(fmt::format("it failed to join: {}", e.what()));
    throw;
  }
  return group;
}

ProcessGroup::~ProcessGroup() {
  stop_watchdog();
  if (!store_) return;
  std::string failure;
  if (std::uncaught_exceptions() > exceptions_at_start_) {
    failure = "it stopped with an error (see its output)";
  } else if (communicator_) {
    // A rank that leaves while the others still run collectives would leave them blocked:
    // leave together, or as lost.
    try {
      meet(*store_, "kiln/finished", options_.timeout, "finishing the job", "");
    } catch (const Error& e) {
      failure = fmt::format("it left before the others finished ({})", e.what());
    }
  }
  if (!failure.empty()) {
    store_->declare_lost(failure);
    abort();
  }
  active_communicator_ = nullptr;
  communicator_.reset();
  store_.reset();
  server_.reset();  // waits for the other ranks to leave the store
}

void ProcessGroup::barrier() {
  meet(*store_, fmt::format("kiln/barrier/{}", barriers_++), options_.timeout, "barrier", "");
}

void ProcessGroup::check_agreement(const std::string& what, const std::string& fingerprint) {
  std::string prefix = fmt::format("kiln/agree/{}/", agreements_++);
  std::string mine = what + '\n' + fingerprint;
  store_->set(prefix + std::to_string(rank()), mine);
  auto split = [](const std::string& value) {
    size_t newline = value.find('\n');
    return std::pair(value.substr(0, newline), value.substr(newline + 1));
  };
  std::string first;
  // Every rank compares every rank with rank 0, so that all of them throw the same error.
  for (int r = 0; r < world_size(); ++r) {
    std::string value;
    try {
      value = r == rank() ? mine : store_->get(prefix + std::to_string(r), options_.timeout);
    } catch (const LostRankError&) {
      throw;
    } catch (const Error&) {
      fail("checking that the ranks agree on {}: rank {} did not give its fingerprint within {}",
           what, r, format_seconds(options_.timeout));
    }
    if (r == 0) {
      first = value;
      continue;
    }
    if (value == first) continue;
    auto [their_what, theirs] = split(value);
    auto [first_what, firsts] = split(first);
    KILN_CHECK(their_what == first_what,
               "rank {} checks its agreement on '{}' where rank 0 checks '{}' (different code on "
               "the ranks?)", r, their_what, first_what);
    fail("rank {} disagrees with rank 0 on {}: {} vs {} (different model, batch, flags or build?)",
         r, what, theirs, firsts);
  }
}

void ProcessGroup::abort() noexcept {
  if (Communicator* communicator = active_communicator_.load()) communicator->abort();
}

void ProcessGroup::exit_on_lost_rank(int rank, const std::string& reason) noexcept {
  if (rank >= 0)
    std::fprintf(stderr, "kiln: rank %d was lost (%s); exiting\n", rank, reason.c_str());
  else
    std::fprintf(stderr, "kiln: the communicator failed (%s); exiting\n", reason.c_str());
  std::fflush(stderr);
  // Aborting NCCL tears its connections down so that the peers' kernels end too; on a thread
  // of its own, in case the abort itself waits on the device for long.
  try {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread([this, done] {
      abort();
      *done = true;
    }).detach();
    for (int i = 0; i < 50 && !*done; ++i) std::this_thread::sleep_for(100ms);
  } catch (...) {
  }
  if (server_) std::this_thread::sleep_for(std::max<std::chrono::milliseconds>(1s, 5 * options_.watchdog_period));
  ::_exit(1);
}

void ProcessGroup::start_watchdog() {
  StoreOptions watch_options = store_->options();
  watch_options.connection = "watchdog";
  watch_store_ = std::make_unique<Store>(watch_options);
  watchdog_ = std::thread([this] { watch(); });
}

void ProcessGroup::stop_watchdog() {
  if (watchdog_.joinable()) {
    {
      std::lock_guard lock(watchdog_mutex_);
      stopping_ = true;
    }
    watchdog_wake_.notify_all();
    watchdog_.join();
  }
  watch_store_.reset();
}

void ProcessGroup::watch() {
  std::unique_lock lock(watchdog_mutex_);
  for (;;) {
    if (watchdog_wake_.wait_for(lock, options_.watchdog_period, [&] { return stopping_; })) return;
    lock.unlock();
    std::optional<int> lost = watch_store_->lost_rank();
    Communicator* communicator = active_communicator_.load();
    std::string reason = lost            ? watch_store_->lost_reason()
                         : communicator ? communicator->async_error()
                                        : "";
    if (lost || !reason.empty()) {
      int rank = lost.value_or(-1);
      if (options_.on_lost) options_.on_lost(rank, reason);
      else exit_on_lost_rank(rank, reason);
      return;
    }
    lock.lock();
  }
}

}  // namespace kiln
