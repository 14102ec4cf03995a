// `kiln opt FILE --passes a,b`: run the named passes on an IR file, in order, and print the IR
// after them: a pass on its own, on text, as the .kir pass tests use it (tests/passes/kir/).
// Each pass's line `// NAME: changed, N -> M nodes` (or `unchanged`) comes first, then the notes
// of the passes that say what they did; being comments, the output is IR text again.
#include "ir/text.h"
#include "options.h"
#include "passes/pipeline.h"

namespace kiln::cli {
namespace {

struct OptOptions {
  std::string file;
  std::vector<std::string> passes;
  std::string amp = "bf16";
  PassOptions options;
};

void opt(const OptOptions& o) {
  Graph graph = parse_file(o.file);
  PassOptions options = o.options;
  options.low_precision = o.amp == "f16" ? DType::kF16 : DType::kBF16;
  // Made first, so that an unknown name fails before any pass runs.
  PassManager manager(options);
  for (const std::string& name : o.passes) manager.add(make_pass(name, options));
  std::vector<PassRecord> records = manager.run(graph);
  for (const PassRecord& r : records)
    fmt::print("// {}: {}\n", r.name,
               r.changed ? fmt::format("changed, {} -> {} nodes", r.nodes_before, r.nodes_after) : "unchanged");
  for (const PassRecord& r : records)
    for (const std::string& note : r.notes) fmt::print("// {}: {}\n", r.name, note);
  fmt::print("{}", print(graph));
}

}  // namespace

void add_opt_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand("opt", "Run the named passes on an IR file, in order; print the IR after them");
  auto o = std::make_shared<OptOptions>();
  command->add_option("FILE", o->file, "IR text file ('-': standard input)")->required();
  command
      ->add_option("--passes", o->passes,
                   fmt::format("Passes to run, in order, by name: {}", fmt::join(pass_names(), ", ")))
      ->delimiter(',')
      ->required();
  command->add_option("--amp", o->amp, "The mixed-precision pass's 16-bit dtype: bf16 | f16")
      ->check(CLI::IsMember({"bf16", "f16"}))
      ->default_val("bf16");
  add_pass_options(command, o->options);
  command->callback([o] { opt(*o); });
}

}  // namespace kiln::cli
