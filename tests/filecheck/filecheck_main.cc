// `filecheck`: the command the .kir tests run (ctest runs `filecheck --run FILE` for each).
//
//   filecheck CHECK_FILE [--check-prefix P]   checks standard input against CHECK_FILE's
//                                             P: lines (default CHECK); prints why on failure
//   filecheck --run FILE [--path DIR]...      runs each of FILE's RUN: lines with bash (pipefail
//                                             on; `not CMD` succeeds when CMD fails), %s being
//                                             FILE, with this program's folder and each DIR
//                                             first on PATH (so `kiln` and `filecheck` are ours)
//
// Exit status: 0 when every check (or RUN line) passes, 1 when one fails, 2 on bad usage.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "filecheck/filecheck.h"

namespace {

bool read_file(const std::string& path, std::string* text) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *text = ss.str();
  return true;
}

int usage() {
  std::cerr << "usage: filecheck CHECK_FILE [--check-prefix PREFIX] < OUTPUT\n"
               "       filecheck --run TEST_FILE [--path DIR]...\n";
  return 2;
}

// Runs `command` with bash; returns its exit status (128 + signal when killed).
int run_with_bash(const std::string& command) {
  const std::string script = "set -o pipefail\nnot() { ! \"$@\"; }\n" + command;
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return 127;
  if (pid == 0) {
    execlp("bash", "bash", "-c", script.c_str(), static_cast<char*>(nullptr));
    std::perror("filecheck: cannot run bash");
    _exit(127);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return 127;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int run_test(const std::string& path, const std::vector<std::string>& dirs) {
  std::string text;
  if (!read_file(path, &text)) {
    std::cerr << "filecheck: cannot read '" << path << "'\n";
    return 2;
  }
  std::string search_path = std::filesystem::canonical("/proc/self/exe").parent_path().string();
  for (const std::string& dir : dirs) search_path += ":" + dir;
  if (const char* old = std::getenv("PATH")) search_path += std::string(":") + old;
  setenv("PATH", search_path.c_str(), 1);
  std::vector<std::string> commands = kiln::filecheck::run_lines(text, path);
  if (commands.empty()) {
    std::cerr << path << ": no RUN: lines\n";
    return 1;
  }
  for (const std::string& command : commands) {
    std::cout << "RUN: " << command << std::endl;
    if (int status = run_with_bash(command); status != 0) {
      std::cerr << path << ": RUN line failed (exit status " << status << "): " << command << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 2 && args[0] == "--run") {
    std::vector<std::string> dirs;
    for (size_t i = 2; i < args.size(); i += 2) {
      if (args[i] != "--path" || i + 1 >= args.size()) return usage();
      dirs.push_back(args[i + 1]);
    }
    return run_test(args[1], dirs);
  }
  std::string check_file, prefix = "CHECK";
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--check-prefix" && i + 1 < args.size()) prefix = args[++i];
    else if (args[i].rfind("--check-prefix=", 0) == 0) prefix = args[i].substr(15);
    else if (check_file.empty() && args[i].rfind("-", 0) != 0) check_file = args[i];
    else return usage();
  }
  if (check_file.empty()) return usage();
  std::string check_text;
  if (!read_file(check_file, &check_text)) {
    std::cerr << "filecheck: cannot read '" << check_file << "'\n";
    return 2;
  }
  std::stringstream output;
  output << std::cin.rdbuf();
  kiln::filecheck::Result result = kiln::filecheck::check(check_text, output.str(), prefix, check_file);
  if (result.ok) return 0;
  std::cerr << result.message << "\n";
  // The output, numbered as the message counts its lines (the first 80).
  std::istringstream lines(output.str());
  std::string line;
  std::cerr << "the output checked:\n";
  for (int number = 1; std::getline(lines, line); ++number) {
    if (number > 80) {
      std::cerr << "  ...\n";
      break;
    }
    std::cerr << "  " << number << " | " << line << "\n";
  }
  return 1;
}
