#include "processes.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "support/error.h"

extern char** environ;

namespace kiln::cli {
namespace {

void close_fd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// The write end of the live SignalPipe, for its handler (a handler gets no context).
int signal_pipe_write_fd = -1;

void write_signal_number(int signal) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal);
  [[maybe_unused]] ssize_t written = write(signal_pipe_write_fd, &byte, 1);
  errno = saved_errno;
}

}  // namespace

ChildProcess start_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& environment) {
  KILN_CHECK(!argv.empty(), "no command to start");
  // Everything the child uses is built before fork: the launcher has threads (OpenBLAS's), so
  // between fork and exec the child may only make async-signal-safe calls.
  std::vector<std::string> entries;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    if (environment.count(std::string(text.substr(0, text.find('=')))) == 0) entries.emplace_back(text);
  }
  for (const auto& [name, value] : environment) entries.push_back(name + "=" + value);
  std::vector<char*> envp;
  for (std::string& entry : entries) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> arg_pointers;
  for (std::string& arg : args) arg_pointers.push_back(arg.data());
  arg_pointers.push_back(nullptr);

  int out[2], err[2], exec_status[2];
  KILN_CHECK(pipe2(out, O_CLOEXEC) == 0 && pipe2(err, O_CLOEXEC) == 0 && pipe2(exec_status, O_CLOEXEC) == 0,
             "cannot start '{}': pipe: {}", argv[0], std::strerror(errno));
  const int null_input = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = getpid();
  // Signals stay blocked until the child has reset the launcher's handlers, so none runs a
  // launcher handler in the child.
  sigset_t all, previous_mask;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous_mask);
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the launcher died before prctl
    for (int signal = 1; signal < NSIG; ++signal) {
      struct sigaction action;
      if (sigaction(signal, nullptr, &action) == 0 && action.sa_handler != SIG_DFL && action.sa_handler != SIG_IGN) {
        action.sa_handler = SIG_DFL;
        action.sa_flags = 0;
        sigaction(signal, &action, nullptr);
      }
    }
    sigprocmask(SIG_SETMASK, &previous_mask, nullptr);
    if (null_input >= 0) dup2(null_input, STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    execvpe(arg_pointers[0], arg_pointers.data(), envp.data());
    const int error = errno;
    [[maybe_unused]] ssize_t written = write(exec_status[1], &error, sizeof error);
    _exit(127);
  }
  const int fork_error = errno;
  pthread_sigmask(SIG_SETMASK, &previous_mask, nullptr);
  close(out[1]);
  close(err[1]);
  close(exec_status[1]);
  if (null_input >= 0) close(null_input);
  int error = 0;
  ssize_t got = -1;
  if (pid > 0) {
    setpgid(pid, pid);  // here too, so that the group exists before the launcher signals it
    do got = read(exec_status[0], &error, sizeof error);
    while (got < 0 && errno == EINTR);
  }
  close(exec_status[0]);
  if (pid < 0 || got > 0) {
    if (pid > 0) waitpid(pid, nullptr, 0);
    close(out[0]);
    close(err[0]);
    fail("cannot run '{}': {}", argv[0], std::strerror(pid < 0 ? fork_error : error));
  }
  set_nonblocking(out[0]);
  set_nonblocking(err[0]);
  return ChildProcess{pid, out[0], err[0]};
}

void signal_group(pid_t group, int signal) {
  if (group > 0) kill(-group, signal);
}

ExitStatus ExitStatus::from_wait_status(int status) {
  ExitStatus result;
  if (WIFEXITED(status)) result.code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  return result;
}

std::string signal_name(int signal) {
  const char* abbreviation = sigabbrev_np(signal);
  return abbreviation != nullptr ? std::string("SIG") + abbreviation : fmt::format("signal {}", signal);
}

std::string ExitStatus::describe() const {
  if (signal != 0) return fmt::format("killed by signal {}, {}", signal, signal_name(signal));
  return fmt::format("exit code {}", code);
}

std::vector<std::string> LineSplitter::feed(std::string_view bytes) {
  std::vector<std::string> lines;
  while (!bytes.empty()) {
    const size_t end = bytes.find('\n');
    const size_t take = end == std::string_view::npos ? bytes.size() : end + 1;
    partial_.append(bytes.substr(0, take));
    bytes.remove_prefix(take);
    if (end != std::string_view::npos || partial_.size() >= kMaxLine) lines.push_back(take_rest());
  }
  return lines;
}

std::string LineSplitter::take_rest() {
  std::string rest;
  rest.swap(partial_);
  return rest;
}

SignalPipe::SignalPipe(const std::vector<int>& signals) : signals_(signals) {
  KILN_CHECK(signal_pipe_write_fd < 0, "only one SignalPipe may be live at a time");
  int ends[2];
  KILN_CHECK(pipe2(ends, O_CLOEXEC | O_NONBLOCK) == 0, "signal pipe: {}", std::strerror(errno));
  read_fd_ = ends[0];
  signal_pipe_write_fd = ends[1];
  struct sigaction action {};
  action.sa_handler = write_signal_number;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  previous_.resize(signals_.size());
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &action, &previous_[i]);
}

SignalPipe::~SignalPipe() {
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  close_fd(read_fd_);
  close_fd(signal_pipe_write_fd);
}

std::vector<int> SignalPipe::take() {
  std::vector<int> caught;
  unsigned char bytes[64];
  ssize_t got;
  while ((got = read(read_fd_, bytes, sizeof bytes)) > 0) caught.insert(caught.end(), bytes, bytes + got);
  return caught;
}

void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t written = write(fd, text.data(), text.size());
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return;  // EPIPE and the like: nobody reads the output any more
    text.remove_prefix(static_cast<size_t>(written));
  }
}

}  // namespace kiln::cli
