// The `kiln` command-line tool: one file per subcommand (tools/cli/*.cc), each a thin layer over
// the library, sharing option groups (options.h). Errors are kiln::Error, printed as one line,
// with a non-zero exit.
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "options.h"
#include "support/error.h"

namespace {

// OpenMP threads spin after each parallel loop by default, taking the cores that the next
// kernel's (pthread) OpenBLAS threads need: measured 2-10x slower steps on loaded or many-core
// hosts (bench/log/sessions-1-12.md). libgomp reads OMP_WAIT_POLICY when it loads, before main, so the CLI
// sets it and re-executes itself once; an explicit user setting is left alone.
void ensure_passive_openmp_waiting(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "passive", 0);
  execv("/proc/self/exe", argv);  // only returns on failure: then run as we are
}

}  // namespace

int main(int argc, char** argv) {
  ensure_passive_openmp_waiting(argv);
  CLI::App app{"kiln: a deep-learning training compiler (`kiln COMMAND --help`: a command's options)", "kiln"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("kiln ") + KILN_VERSION);
  app.footer(
      "Environment variables for measuring and caching (KILN_CACHE_DIR, KILN_GEMM_*, KILN_CUDNN_*, ...):\n"
      "see docs/developer.md.");
  kiln::cli::add_version_command(app);
  kiln::cli::add_check_command(app);
  kiln::cli::add_run_command(app);
  kiln::cli::add_opt_command(app);
  kiln::cli::add_compile_command(app);
  kiln::cli::add_train_command(app);
  kiln::cli::add_bench_command(app);
  kiln::cli::add_launch_command(app);
  kiln::cli::add_step_command(app);
  kiln::cli::add_hf_commands(app);
  // The subcommands run in their callbacks, inside parse.
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kiln::cli::ExitCode& e) {
    return e.code;
  } catch (const kiln::Error& e) {
    std::cerr << "kiln: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kiln: internal error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
