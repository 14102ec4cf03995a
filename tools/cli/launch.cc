// `kiln launch -n N -- COMMAND...`: N local processes of a command, one per device, each with
// torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), so that a process group forms as it does under torchrun. With --nnodes M the
// job spans M machines: one launcher on each, all naming rank 0's machine and port, node R's
// ranks numbered R*N .. R*N+N-1 (the engines connect across the machines themselves). One
// poll(2) loop reads every rank's output line by line (rank 0's as it is, the others' prefixed),
// forwards SIGINT and SIGTERM, and fails fast: when a rank fails, the others get --grace seconds
// to end on their own, then SIGTERM, then SIGKILL. Then, with --max-restarts K, the group starts
// again (K times at most; TORCHELASTIC_RESTART_COUNT says which start it is, and a restarted
// `kiln train` resumes from its last checkpoint), on fewer local processes with --min-nproc;
// else the launcher exits with the failed rank's code.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <cstdlib>
#include <map>
#include <optional>
#include <thread>

#include "options.h"
#include "processes.h"
#include "support/error.h"

namespace kiln::cli {
namespace {

using Clock = std::chrono::steady_clock;

// More local processes than this is a typo, not a machine (and each rank holds two pipes).
constexpr int kMaxProcesses = 256;
constexpr double kMaxGraceSeconds = 24 * 3600;
constexpr auto kKillAfterTerm = std::chrono::seconds(5);
// Once every rank has exited, output that their leftover descendants still write is read this
// long before the pipes are closed.
constexpr auto kDrainAfterExit = std::chrono::seconds(1);
constexpr size_t kRememberedLines = 5;

struct LaunchOptions {
  int processes = 0;  // on this node
  int nodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (one node only)
  double grace_seconds = 10;
  int max_restarts = 0;
  int min_processes = 0;  // 0: restarts keep every process
  std::vector<std::string> command;
};

// One start of the group: which local slots run (slot i is the i-th device of the node), and
// which start it is.
struct Attempt {
  std::vector<int> slots;
  int restart = 0;
  int master_port = 0;
};

// Variables every process kiln starts gets, whatever the launcher's environment says: NVLink
// multicast stays off on the lent machines (NCCL's, PyTorch's symmetric memory's, NVSHMEM's).
const std::map<std::string, std::string> kForcedEnvironment = {
    {"NCCL_NVLS_ENABLE", "0"},
    {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
    {"NVSHMEM_DISABLE_NVLS", "1"},
};

// A TCP port that is free now (the kernel's choice for port 0), for rank 0's store.
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  KILN_CHECK(fd >= 0, "launch: socket: {}", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof address;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  close(fd);
  KILN_CHECK(ok, "launch: cannot find a free port for MASTER_PORT: {}", std::strerror(error));
  return ntohs(address.sin_port);
}

// One rank: its process, its output streams, the end of its stderr, and how it ended.
struct Rank {
  int index = 0;
  ChildProcess process;
  LineSplitter out;
  LineSplitter err;
  std::deque<std::string> last_error_lines;  // non-blank, newest last
  std::optional<ExitStatus> exit;
};

// One start of the group: runs its ranks to their end.
class Launcher {
 public:
  Launcher(const LaunchOptions& options, Attempt attempt) : options_(options), attempt_(std::move(attempt)) {}
  // Runs the ranks to their end, with `signals` watched; returns the launcher's exit code.
  int run(SignalPipe& signals);
  bool interrupted() const { return interrupted_; }
  // The slot of the rank whose failure ended the group (not those that failed after it), or -1.
  int failed_slot() const { return failed_slot_; }

 private:
  void start_ranks();
  // Reads what the stream has now (everything, with `until_empty`, else one buffer); at its end
  // prints its partial line and closes it.
  void read_stream(Rank& rank, bool is_stderr, bool until_empty);
  void print_line(Rank& rank, bool is_stderr, std::string line);
  void reap_exited();
  void on_signal(int signal);
  void escalate(Clock::time_point now);
  void begin_stop() {
    stopping_ = true;
    terminate_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(options_.grace_seconds));
  }
  // To every rank's process group, so that a rank's descendants get it too (also those of a
  // rank that has exited).
  void signal_all(int signal) {
    for (const Rank& rank : ranks_) signal_group(rank.process.pid, signal);
  }
  std::string last_error_line(const Rank& rank) const;

  LaunchOptions options_;
  Attempt attempt_;
  std::vector<Rank> ranks_;
  int exit_code_ = 0;
  int failed_slot_ = -1;
  bool stopping_ = false;  // a rank failed or a signal came: the ranks are being ended
  bool interrupted_ = false;
  bool sent_terminate_ = false;
  bool sent_kill_ = false;
  Clock::time_point terminate_at_;
};

// The devices of the node's slots, for CUDA_VISIBLE_DEVICES once a restart has left some out:
// the launcher's own CUDA_VISIBLE_DEVICES list where it has one, else 0 .. N-1.
std::string visible_devices(const std::vector<int>& slots) {
  std::vector<std::string> devices;
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::string_view list(visible);
    while (!list.empty()) {
      const size_t comma = list.find(',');
      devices.emplace_back(list.substr(0, comma));
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    }
  }
  std::string out;
  for (int slot : slots) {
    if (!out.empty()) out += ',';
    out += static_cast<size_t>(slot) < devices.size() ? devices[slot] : std::to_string(slot);
  }
  return out;
}

void Launcher::start_ranks() {
  const int processes = static_cast<int>(attempt_.slots.size());
  std::map<std::string, std::string> environment = kForcedEnvironment;
  environment["WORLD_SIZE"] = std::to_string(processes * options_.nodes);
  environment["LOCAL_WORLD_SIZE"] = std::to_string(processes);
  environment["GROUP_RANK"] = std::to_string(options_.node_rank);  // torchrun's name for the node's rank
  environment["MASTER_ADDR"] = options_.master_addr;
  environment["MASTER_PORT"] = std::to_string(attempt_.master_port);
  environment["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt_.restart);
  environment["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options_.max_restarts);
  // A group that lost slots runs on the devices of the others (LOCAL_RANK i is the i-th visible).
  if (processes < options_.processes) environment["CUDA_VISIBLE_DEVICES"] = visible_devices(attempt_.slots);
  // N ranks each with every core's OpenMP threads would oversubscribe the CPU N times (CPU
  // ranks compute on OpenMP): share the cores, unless the caller chose.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    environment["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(processes)));
  }
  for (int index = 0; index < processes; ++index) {
    environment["RANK"] = std::to_string(options_.node_rank * processes + index);
    environment["LOCAL_RANK"] = std::to_string(index);
    try {
      ranks_.push_back(Rank{options_.node_rank * processes + index, start_child(options_.command, environment), {}, {}, {}, {}});
    } catch (const Error&) {
      for (Rank& rank : ranks_) {
        signal_group(rank.process.pid, SIGKILL);
        waitpid(rank.process.pid, nullptr, 0);
        close(rank.process.stdout_fd);
        close(rank.process.stderr_fd);
      }
      throw;
    }
  }
}

void Launcher::print_line(Rank& rank, bool is_stderr, std::string line) {
  if (line.empty() || line.back() != '\n') line += '\n';  // a stream's last bytes, or an overlong line
  if (is_stderr) {
    std::string_view text(line);
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.remove_suffix(1);
    if (!text.empty()) {
      rank.last_error_lines.emplace_back(text);
      if (rank.last_error_lines.size() > kRememberedLines) rank.last_error_lines.pop_front();
    }
  }
  // Rank 0 prints the progress; the others' lines say whose they are.
  if (rank.index != 0) line = fmt::format("[rank {}] {}", rank.index, line);
  write_all(is_stderr ? STDERR_FILENO : STDOUT_FILENO, line);
}

void Launcher::read_stream(Rank& rank, bool is_stderr, bool until_empty) {
  int& fd = is_stderr ? rank.process.stderr_fd : rank.process.stdout_fd;
  LineSplitter& splitter = is_stderr ? rank.err : rank.out;
  char buffer[1 << 16];
  while (fd >= 0) {
    const ssize_t got = read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno == EAGAIN) return;
    if (got <= 0) {  // end of stream
      if (std::string rest = splitter.take_rest(); !rest.empty()) print_line(rank, is_stderr, rest);
      close(fd);
      fd = -1;
      return;
    }
    for (std::string& line : splitter.feed(std::string_view(buffer, static_cast<size_t>(got))))
      print_line(rank, is_stderr, std::move(line));
    if (!until_empty) return;
  }
}

std::string Launcher::last_error_line(const Rank& rank) const {
  std::string_view partial = rank.err.partial();
  while (!partial.empty() && std::isspace(static_cast<unsigned char>(partial.back()))) partial.remove_suffix(1);
  if (!partial.empty()) return std::string(partial);
  if (!rank.last_error_lines.empty()) return rank.last_error_lines.back();
  return "(nothing on stderr)";
}

void Launcher::reap_exited() {
  for (Rank& rank : ranks_) {
    int status = 0;
    if (rank.exit || waitpid(rank.process.pid, &status, WNOHANG) != rank.process.pid) continue;
    rank.exit = ExitStatus::from_wait_status(status);
    // What it wrote before it ended is in its pipes: print it before saying why it ended.
    read_stream(rank, /*is_stderr=*/false, /*until_empty=*/true);
    read_stream(rank, /*is_stderr=*/true, /*until_empty=*/true);
    if (!rank.exit->failed() || stopping_) continue;
    write_all(STDERR_FILENO, fmt::format("kiln launch: rank {} failed ({}): {}\n", rank.index, rank.exit->describe(),
                                         last_error_line(rank)));
    exit_code_ = rank.exit->shell_code();
    failed_slot_ = attempt_.slots[static_cast<size_t>(&rank - ranks_.data())];
    begin_stop();
  }
}

void Launcher::on_signal(int signal) {
  if (signal != SIGINT && signal != SIGTERM) return;  // SIGCHLD: reaped by the loop; SIGPIPE: output dropped
  if (interrupted_) {  // a second interrupt: the user will not wait
    write_all(STDERR_FILENO, fmt::format("kiln launch: {} again: killing every rank\n", signal_name(signal)));
    signal_all(SIGKILL);
    sent_terminate_ = sent_kill_ = true;
    return;
  }
  interrupted_ = true;
  write_all(STDERR_FILENO, fmt::format("kiln launch: {}: passing it to every rank\n", signal_name(signal)));
  signal_all(signal);
  if (!stopping_) {
    exit_code_ = 128 + signal;
    begin_stop();
  }
}

void Launcher::escalate(Clock::time_point now) {
  if (!stopping_) return;
  if (!sent_terminate_ && now >= terminate_at_) {
    signal_all(SIGTERM);
    sent_terminate_ = true;
  }
  if (!sent_kill_ && now >= terminate_at_ + kKillAfterTerm) {
    for (const Rank& rank : ranks_)
      if (!rank.exit)
        write_all(STDERR_FILENO, fmt::format("kiln launch: rank {} still running {} s after SIGTERM: killing it\n",
                                             rank.index, kKillAfterTerm.count()));
    signal_all(SIGKILL);
    sent_kill_ = true;
  }
}

int Launcher::run(SignalPipe& signals) {
  start_ranks();
  std::optional<Clock::time_point> all_exited_at;
  while (true) {
    reap_exited();
    const Clock::time_point now = Clock::now();
    escalate(now);

    std::vector<pollfd> watched{{signals.fd(), POLLIN, 0}};
    std::vector<std::pair<Rank*, bool>> streams;  // (rank, is_stderr) of watched[1...]
    for (Rank& rank : ranks_) {
      for (const bool is_stderr : {false, true}) {
        const int fd = is_stderr ? rank.process.stderr_fd : rank.process.stdout_fd;
        if (fd < 0) continue;
        watched.push_back({fd, POLLIN, 0});
        streams.emplace_back(&rank, is_stderr);
      }
    }
    std::optional<Clock::time_point> deadline;
    const bool all_exited = std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& rank) { return rank.exit.has_value(); });
    if (all_exited) {
      if (!all_exited_at) all_exited_at = now;
      if (streams.empty() || now >= *all_exited_at + kDrainAfterExit) break;
      deadline = *all_exited_at + kDrainAfterExit;
    } else if (stopping_ && !sent_kill_) {
      deadline = sent_terminate_ ? terminate_at_ + kKillAfterTerm : terminate_at_;
    }
    int timeout_ms = -1;
    if (deadline)
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, std::chrono::ceil<std::chrono::milliseconds>(*deadline - now).count()));
    if (poll(watched.data(), watched.size(), timeout_ms) < 0) {
      KILN_CHECK(errno == EINTR, "launch: poll: {}", std::strerror(errno));
      continue;
    }
    if (watched[0].revents != 0)
      for (const int signal : signals.take()) on_signal(signal);
    for (size_t i = 1; i < watched.size(); ++i)
      if (watched[i].revents != 0) read_stream(*streams[i - 1].first, streams[i - 1].second, /*until_empty=*/false);
  }
  for (Rank& rank : ranks_) {
    // Ending: what is left of each rank's process group (its descendants) goes too.
    if (stopping_) signal_group(rank.process.pid, SIGKILL);
    if (rank.process.stdout_fd >= 0) close(rank.process.stdout_fd);
    if (rank.process.stderr_fd >= 0) close(rank.process.stderr_fd);
  }
  return exit_code_;
}

// Starts the group, and again after a failure while restarts are left; returns the exit code.
int launch(const LaunchOptions& options) {
  // SIGPIPE is caught (not left to kill the launcher) so that output nobody reads is dropped
  // while the ranks run on; caught signals are back to their defaults in the ranks.
  SignalPipe signals({SIGINT, SIGTERM, SIGCHLD, SIGPIPE});
  Attempt attempt;
  for (int slot = 0; slot < options.processes; ++slot) attempt.slots.push_back(slot);
  while (true) {
    // A new port each start on one node: the last start's may still be held by its connections.
    attempt.master_port = options.master_port != 0 ? options.master_port : free_port();
    Launcher launcher(options, attempt);
    const int code = launcher.run(signals);
    if (code == 0 || launcher.interrupted() || attempt.restart >= options.max_restarts) return code;
    ++attempt.restart;
    // Leave the failed rank's device out (it may be the cause) while enough processes remain.
    const int least = options.min_processes > 0 ? options.min_processes : options.processes;
    if (launcher.failed_slot() >= 0 && static_cast<int>(attempt.slots.size()) > least)
      std::erase(attempt.slots, launcher.failed_slot());
    write_all(STDERR_FILENO, fmt::format("kiln launch: restarting the group ({} of at most {}) on {} process{}{}\n",
                                         attempt.restart, options.max_restarts, attempt.slots.size(),
                                         attempt.slots.size() == 1 ? "" : "es",
                                         options.nodes > 1 ? " a node" : ""));
  }
}

// The program that runs COMMAND: this kiln itself when COMMAND's first word is one of its
// commands, else the program as given (looked up on PATH).
std::vector<std::string> resolve_command(const CLI::App& app, const CLI::App& launch, std::vector<std::string> command) {
  KILN_CHECK(!launch.check_name(command[0]), "launch: COMMAND cannot be launch itself");
  const auto is_kiln_command = [&](const CLI::App* sub) { return sub->check_name(command[0]); };
  if (!app.get_subcommands(is_kiln_command).empty())
    command.insert(command.begin(), std::filesystem::read_symlink("/proc/self/exe").string());
  return command;
}

}  // namespace

void add_launch_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand(
      "launch", "Run N local processes of a command, one per device, with torchrun's variables; end all if one fails");
  auto options = std::make_shared<LaunchOptions>();
  command->add_option("-n,--nproc-per-node", options->processes, "Number of processes on this node (one per device)")->required();
  command->add_option("--nnodes", options->nodes, "Number of nodes (machines), each running kiln launch with the same options")
      ->default_val(options->nodes);
  command->add_option("--node-rank", options->node_rank, "This node's rank, 0 to nnodes-1 (node 0 runs rank 0)")
      ->default_val(options->node_rank);
  command->add_option("--master-addr", options->master_addr, "MASTER_ADDR: node 0's address, where rank 0's store listens")
      ->default_val(options->master_addr);
  command->add_option("--master-port", options->master_port, "MASTER_PORT (default on one node: a free port)");
  command->add_option("--grace", options->grace_seconds,
                      "Seconds the other ranks get to end on their own after one fails, before SIGTERM (then "
                      "SIGKILL 5 s later)")
      ->default_val(options->grace_seconds);
  command->add_option("--max-restarts", options->max_restarts,
                      "Start the group again after a rank fails, up to K times (kiln train resumes from its "
                      "last checkpoint)")
      ->default_val(options->max_restarts);
  command->add_option("--min-nproc", options->min_processes,
                      "On a restart, leave out the failed rank's device while at least this many processes remain "
                      "(one node; default: restart on all)");
  // Everything from COMMAND on is the command's, options included, with or without "--".
  command->add_option("COMMAND", options->command, "A kiln command (train, bench, ...) or a program, and its arguments");
  command->positionals_at_end();
  command->footer(
      "kiln launch -n N [OPTIONS] [--] COMMAND [ARGS...]: COMMAND's own options come after it.\n"
      "COMMAND is a kiln command (train, bench, ...), run by this kiln, or any program on PATH.\n"
      "Each process gets RANK (node_rank*N + 0..N-1), LOCAL_RANK (0..N-1), WORLD_SIZE (nnodes*N),\n"
      "LOCAL_WORLD_SIZE (N), MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, and\n"
      "NCCL_NVLS_ENABLE=0 (NVLink multicast off).\n"
      "Several nodes: run it on each with --nnodes M --node-rank R --master-addr NODE0 --master-port P.\n"
      "Rank 0's output passes through; the others' lines start with '[rank R] '.\n"
      "SIGINT and SIGTERM go to every rank. When a rank fails, the launcher names it and ends the\n"
      "others; then it restarts the group (--max-restarts) or exits with the rank's code (128 + the\n"
      "signal that killed it).");
  command->callback([options, command, &app] {
    LaunchOptions launch_options = *options;
    KILN_CHECK(launch_options.processes >= 1 && launch_options.processes <= kMaxProcesses,
               "launch: -n {}: expected 1 to {} processes (one per device)", launch_options.processes, kMaxProcesses);
    KILN_CHECK(!launch_options.command.empty(), "launch: no command given: kiln launch -n N -- COMMAND [ARGS...]");
    KILN_CHECK(launch_options.grace_seconds >= 0 && launch_options.grace_seconds <= kMaxGraceSeconds,
               "launch: --grace {}: expected seconds from 0 to {}", launch_options.grace_seconds, kMaxGraceSeconds);
    KILN_CHECK(launch_options.master_port >= 0 && launch_options.master_port <= 65535,
               "launch: --master-port {}: expected a port from 1 to 65535 (0: a free one)", launch_options.master_port);
    KILN_CHECK(launch_options.nodes >= 1, "launch: --nnodes {}: expected 1 or more", launch_options.nodes);
    KILN_CHECK(launch_options.node_rank >= 0 && launch_options.node_rank < launch_options.nodes,
               "launch: --node-rank {}: expected 0 to {} (--nnodes {})", launch_options.node_rank,
               launch_options.nodes - 1, launch_options.nodes);
    KILN_CHECK(launch_options.nodes == 1 || launch_options.master_port != 0,
               "launch: --nnodes {} needs --master-port: every node must name the same port of node 0",
               launch_options.nodes);
    KILN_CHECK(launch_options.max_restarts >= 0, "launch: --max-restarts {}: expected 0 or more",
               launch_options.max_restarts);
    KILN_CHECK(launch_options.min_processes >= 0 && launch_options.min_processes <= launch_options.processes,
               "launch: --min-nproc {}: expected 1 to -n {}", launch_options.min_processes, launch_options.processes);
    KILN_CHECK(launch_options.min_processes == 0 || launch_options.nodes == 1,
               "launch: --min-nproc needs --nnodes 1 (every node of a group runs as many processes)");
    launch_options.command = resolve_command(app, *command, launch_options.command);
    const int code = launch(launch_options);
    if (code != 0) throw ExitCode{code};
  });
}

}  // namespace kiln::cli
