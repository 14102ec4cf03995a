// Child processes for `kiln launch` (POSIX): starting a program in its own process group with
// extra environment variables and its output on pipes, splitting that output into lines, turning
// signals into readable bytes for a poll(2) loop, and describing how a process ended.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::cli {

// A started child: its pid (also its process group's id) and the read ends of its stdout and
// stderr pipes (close-on-exec, non-blocking; -1 once closed).
struct ChildProcess {
  pid_t pid = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
};

// Starts `argv` (argv[0] looked up on PATH unless it contains a '/') with the launcher's
// environment plus `environment` (which replaces variables of the same name), in a new process
// group, stdin from /dev/null, stdout and stderr on pipes. The child is killed if the launcher
// dies, so that no rank outlives it. Throws kiln::Error naming the program if it cannot run.
ChildProcess start_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& environment);

// Sends `signal` to the process group `group` (a child's pid); a group that is gone is no error.
void signal_group(pid_t group, int signal);

// How a process ended, from waitpid's status.
struct ExitStatus {
  int code = 0;    // the exit code when it exited
  int signal = 0;  // the signal that killed it, or 0
  static ExitStatus from_wait_status(int status);
  bool failed() const { return code != 0 || signal != 0; }
  // The shell's convention: the exit code, or 128 + the signal.
  int shell_code() const { return signal != 0 ? 128 + signal : code; }
  // "exit code 3" or "killed by signal 9 (SIGKILL)".
  std::string describe() const;
};

// "SIGTERM" for SIGTERM; "signal N" for a signal without a short name here.
std::string signal_name(int signal);

// Splits a byte stream into lines: bytes go in as they arrive, complete lines (each with its
// '\n') come out, and a partial line waits for its end (or for take_rest at end of stream).
class LineSplitter {
 public:
  // Complete lines in `bytes` and the partial line before it. A partial line longer than
  // kMaxLine comes out as a line, so a stream without newlines cannot grow without bound.
  std::vector<std::string> feed(std::string_view bytes);
  // The partial line (no '\n'), emptied.
  std::string take_rest();
  const std::string& partial() const { return partial_; }
  static constexpr size_t kMaxLine = 64 * 1024;

 private:
  std::string partial_;
};

// Signals as bytes on a pipe: while it lives, the given signals are caught and each one's number
// is written to fd(), which a poll(2) loop watches (the self-pipe pattern); destruction restores
// the previous handlers. One at a time per process.
class SignalPipe {
 public:
  explicit SignalPipe(const std::vector<int>& signals);
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;
  int fd() const { return read_fd_; }
  // The signals caught since the last call, in order.
  std::vector<int> take();

 private:
  int read_fd_ = -1;
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

// Writes all of `text` to `fd`, retrying short writes; a closed reader (EPIPE) drops the text.
void write_all(int fd, std::string_view text);

}  // namespace kiln::cli
