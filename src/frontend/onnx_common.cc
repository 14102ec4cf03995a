// What the ONNX front end's header promises in every build: kiln_name, and where CMake found no
// libonnx-dev / libprotobuf-dev, the functions that say the front end is not built.
#include <cctype>

#include "frontend/onnx/onnx_import.h"

namespace kiln::onnx {

std::string kiln_name(const std::string& onnx_name) {
  std::string out = onnx_name;
  for (char& c : out)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-')) c = '_';
  if (out.empty()) out = "_";
  return out;
}

#ifndef KILN_HAVE_ONNX
namespace {
[[noreturn]] void not_built(const std::string& what) {
  fail("{}: this kiln was built without the ONNX front end (install Debian's libonnx-dev and libprotobuf-dev, "
       "then configure and build again)",
       what);
}
}  // namespace

bool onnx_available() { return false; }
ImportedModel import_onnx(const std::string& path, const ImportOptions&) { not_built(path); }
ImportedModel import_onnx_bytes(const std::string&, const std::string&, const ImportOptions&,
                                const std::string& source) {
  not_built(source);
}
std::pair<std::string, Tensor> load_onnx_tensor(const std::string& path) { not_built(path); }
#endif

}  // namespace kiln::onnx
