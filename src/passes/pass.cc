#include "passes/pass.h"

#include <algorithm>

#include "ir/text.h"
#include "ir/verifier.h"
#include "support/error.h"
#include "support/stopwatch.h"

namespace kiln {

PassManager& PassManager::add(std::unique_ptr<Pass> pass) {
  passes_.push_back(std::move(pass));
  return *this;
}

std::vector<std::string> PassManager::names() const {
  std::vector<std::string> out;
  for (const auto& p : passes_) out.push_back(p->name());
  return out;
}

std::vector<PassRecord> PassManager::run(Graph& graph) const {
  std::vector<std::string> known = names();
  auto check_known = [&](const std::set<std::string>& wanted, const char* what) {
    for (const std::string& n : wanted)
      KILN_CHECK(n == "all" || std::find(known.begin(), known.end(), n) != known.end(),
                 "{}: unknown pass '{}' (passes: {})", what, n, fmt::join(known, ", "));
  };
  check_known(options_.disabled, "--disable-pass");
  check_known(options_.print_after, "--print-after");

  std::vector<PassRecord> records;
  for (const auto& pass : passes_) {
    PassRecord r;
    r.name = pass->name();
    r.nodes_before = graph.nodes.size();
    if (!options_.disabled.count(r.name) && !options_.disabled.count("all")) {
      const Stopwatch watch;
      try {
        r.changed = pass->run(graph);
        verify(graph);
      } catch (const Error& e) {
        fail("pass {}: {}", r.name, e.what());
      }
      r.seconds = watch.seconds();
      r.ran = true;
      r.notes = pass->notes();
    }
    r.nodes_after = graph.nodes.size();
    records.push_back(r);
    if (options_.print_after.count("all") || options_.print_after.count(r.name)) {
      if (options_.printer) options_.printer(r.name, graph);
      else fmt::print("// after {}\n{}", r.name, print(graph));
    }
  }
  return records;
}

}  // namespace kiln
