// `kiln version`: the version and whether (and on what) the CUDA backend runs.
#include "backends/cuda/device.h"
#include "options.h"

namespace kiln::cli {

void add_version_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand("version", "Print the version and the CUDA backend's state");
  command->callback([] {
    fmt::print("kiln {}\n", KILN_VERSION);
    fmt::print("cuda backend: {}\n",
               cuda::built_with_cuda()
                   ? fmt::format("built; {} device(s); {}", cuda::device_count(), cuda::describe_device(0))
                   : std::string("not built"));
  });
}

}  // namespace kiln::cli
