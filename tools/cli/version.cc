// `kiln version`: the version and whether (and on what) the CUDA backend runs.
#include "device/device_runtime.h"
#include "options.h"

namespace kiln::cli {

void add_version_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand("version", "Print the version and the CUDA backend's state");
  command->callback([] {
    fmt::print("kiln {}\n", KILN_VERSION);
    const DeviceAvailability cuda = device_availability(Device::kCuda);
    fmt::print("cuda backend: {}\n", cuda.built ? fmt::format("built; {} device(s); {}", cuda.count, cuda.description)
                                                   : std::string("not built"));
  });
}

}  // namespace kiln::cli
