// `kiln launch -n N -- COMMAND...`: N local processes of a command, one per device, each with
// torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), so that a process group forms as it does under torchrun. One poll(2) loop reads
// every rank's output line by line (rank 0's as it is, the others' prefixed), forwards SIGINT and
// SIGTERM, and fails fast: when a rank fails, the others get --grace seconds to end on their own,
// then SIGTERM, then SIGKILL, and the launcher exits with the failed rank's code.
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
  int processes = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port
  double grace_seconds = 10;
  std::vector<std::string> command;
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

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options) : options_(options) {}
  // Runs the ranks to their end; returns the launcher's exit code.
  int run();

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
  std::vector<Rank> ranks_;
  int exit_code_ = 0;
  bool stopping_ = false;  // a rank failed or a signal came: the ranks are being ended
  bool interrupted_ = false;
  bool sent_terminate_ = false;
  bool sent_kill_ = false;
  Clock::time_point terminate_at_;
};

void Launcher::start_ranks() {
  std::map<std::string, std::string> environment = kForcedEnvironment;
  environment["WORLD_SIZE"] = environment["LOCAL_WORLD_SIZE"] = std::to_string(options_.processes);
  environment["MASTER_ADDR"] = options_.master_addr;
  environment["MASTER_PORT"] = std::to_string(options_.master_port);
  // N ranks each with every core's OpenMP threads would oversubscribe the CPU N times (CPU
  // ranks compute on OpenMP): share the cores, unless the caller chose.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    environment["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(options_.processes)));
  }
  for (int index = 0; index < options_.processes; ++index) {
    environment["RANK"] = environment["LOCAL_RANK"] = std::to_string(index);
    try {
      ranks_.push_back(Rank{index, start_child(options_.command, environment), {}, {}, {}, {}});
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

int Launcher::run() {
  // SIGPIPE is caught (not left to kill the launcher) so that output nobody reads is dropped
  // while the ranks run on; caught signals are back to their defaults in the ranks.
  SignalPipe signals({SIGINT, SIGTERM, SIGCHLD, SIGPIPE});
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
  command->add_option("-n,--nproc-per-node", options->processes, "Number of processes (ranks 0 to N-1)")->required();
  command->add_option("--master-addr", options->master_addr, "MASTER_ADDR: where rank 0's store listens")
      ->default_val(options->master_addr);
  command->add_option("--master-port", options->master_port, "MASTER_PORT (default: a free port)");
  command->add_option("--grace", options->grace_seconds,
                      "Seconds the other ranks get to end on their own after one fails, before SIGTERM (then "
                      "SIGKILL 5 s later)")
      ->default_val(options->grace_seconds);
  // Everything from COMMAND on is the command's, options included, with or without "--".
  command->add_option("COMMAND", options->command, "A kiln command (train, bench, ...) or a program, and its arguments");
  command->positionals_at_end();
  command->footer(
      "kiln launch -n N [OPTIONS] [--] COMMAND [ARGS...]: COMMAND's own options come after it.\n"
      "COMMAND is a kiln command (train, bench, ...), run by this kiln, or any program on PATH.\n"
      "Each process gets RANK and LOCAL_RANK (0..N-1), WORLD_SIZE and LOCAL_WORLD_SIZE (N),\n"
      "MASTER_ADDR, MASTER_PORT, and NCCL_NVLS_ENABLE=0 (NVLink multicast off).\n"
      "Rank 0's output passes through; the others' lines start with '[rank R] '.\n"
      "SIGINT and SIGTERM go to every rank. When a rank fails, the launcher names it, ends the\n"
      "others and exits with its code (128 + the signal that killed it).");
  command->callback([options, command, &app] {
    LaunchOptions launch = *options;
    KILN_CHECK(launch.processes >= 1 && launch.processes <= kMaxProcesses,
               "launch: -n {}: expected 1 to {} processes (one per device)", launch.processes, kMaxProcesses);
    KILN_CHECK(!launch.command.empty(), "launch: no command given: kiln launch -n N -- COMMAND [ARGS...]");
    KILN_CHECK(launch.grace_seconds >= 0 && launch.grace_seconds <= kMaxGraceSeconds,
               "launch: --grace {}: expected seconds from 0 to {}", launch.grace_seconds, kMaxGraceSeconds);
    KILN_CHECK(launch.master_port >= 0 && launch.master_port <= 65535,
               "launch: --master-port {}: expected a port from 1 to 65535 (0: a free one)", launch.master_port);
    launch.command = resolve_command(app, *command, launch.command);
    if (launch.master_port == 0) launch.master_port = free_port();
    const int code = Launcher(launch).run();
    if (code != 0) throw ExitCode{code};
  });
}

}  // namespace kiln::cli
