// `kiln check FILE`: parse and verify IR text, or import an ONNX model; print its canonical form.
#include "ir/text.h"
#include "options.h"

namespace kiln::cli {

void add_check_command(CLI::App& app) {
  CLI::App* command =
      app.add_subcommand("check", "Parse and verify an IR file or import an ONNX model; print its normalized text");
  auto file = std::make_shared<std::string>();
  auto onnx = std::make_shared<onnx::ImportOptions>();
  command->add_option("FILE", *file, "IR text file ('-': standard input) or ONNX model (.onnx)")->required();
  add_onnx_options(command, *onnx);
  command->callback([file, onnx] { fmt::print("{}", print(load_model_file(*file, *onnx).graph)); });
}

}  // namespace kiln::cli
