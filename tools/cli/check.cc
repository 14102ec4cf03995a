// `kiln check FILE`: parse and verify IR text, print its canonical form.
#include "ir/text.h"
#include "options.h"

namespace kiln::cli {

void add_check_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand("check", "Parse and verify an IR file; print its normalized text");
  auto file = std::make_shared<std::string>();
  command->add_option("FILE", *file, "IR text file ('-': standard input)")->required();
  command->callback([file] { fmt::print("{}", print(parse_file(*file))); });
}

}  // namespace kiln::cli
