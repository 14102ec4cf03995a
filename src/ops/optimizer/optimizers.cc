#include "ops/optimizer/optimizers.h"

#include <algorithm>
#include <cmath>

#include "support/error.h"

namespace kiln::optim {
namespace {

double hyper(const Attributes& a, const HyperSpec& spec) {
  return spec.boolean ? (a.b(spec.name) ? 1.0 : 0.0) : a.f(spec.name);
}

// An elementwise rule's entry: its update is one optimizer_update node.
template <class Rule>
OptimizerDef rule_entry() {
  OptimizerDef def;
  def.name = Rule::kName;
  def.help = Rule::kHelp;
  def.hyper.assign(std::begin(Rule::kHyper), std::end(Rule::kHyper));
  for (const char* slot : Rule::kSlotNames) def.slots.push_back(StateSlot{slot});
  def.elementwise = true;
  def.build = [](const UpdateInputs& in) {
    std::vector<Expr> operands{in.param, in.grad};
    operands.insert(operands.end(), in.slots.begin(), in.slots.end());
    operands.push_back(in.lr);
    operands.push_back(in.step);
    Attributes attrs = in.hyper;
    attrs.set("optimizer", std::string(Rule::kName));
    return in.param.builder().apply(Op::kOptimizerUpdate, operands, attrs);
  };
  return def;
}

Expr rms(const Expr& x) { return sqrt(mean(square(x))); }

// Adafactor (Shazeer and Stern 2018) as transformers.optimization.Adafactor computes it with a
// fixed learning rate (relative_step=False, warmup_init=False) and no first moment (beta1=None).
// For a param of rank >= 2 (..., R, C) the second moment is kept as its row means v_row (..., R)
// and column means v_col (..., C); a smaller param keeps it whole (v). With u = g^2 + eps1,
// b = 1 - t^decay_rate:
//   v_row = b v_row + (1 - b) mean(u, -1); v_col = b v_col + (1 - b) mean(u, -2)
//   update = g rsqrt(v_row / mean(v_row, -1))[..., None] rsqrt(v_col)[..., None, :]
//   (unfactored: v = b v + (1 - b) u; update = g rsqrt(v))
//   update /= max(1, rms(update) / clip_threshold)
//   lr_t = lr max(eps2, rms(p)) when scale_parameter, else lr
//   p = p - weight_decay lr_t p - lr_t update
OptimizerDef adafactor_entry() {
  OptimizerDef def;
  def.name = "adafactor";
  def.help = "Adafactor with factored second moments and a fixed lr (transformers' Adafactor, relative_step=False)";
  def.hyper = {
      {"eps1", 1e-30, false, 0.0, kUnbounded, true, false, "added to the squared gradient"},
      {"eps2", 1e-3, false, 0.0, kUnbounded, false, false, "least param scale (scale_parameter)"},
      {"clip_threshold", 1.0, false, 0.0, kUnbounded, true, false, "the update's RMS is clipped to this"},
      {"decay_rate", -0.8, false, -kUnbounded, 0.0, false, true, "second-moment decay is 1 - t^decay_rate"},
      {"scale_parameter", 1.0, true, 0, 1, false, false, "scale lr by the param's RMS"},
      {"weight_decay", 0.0, false, 0.0, kUnbounded, false, false, "decoupled weight decay"},
  };
  // Factored moments are means over whole rows and columns: no flat shard of them is a rank's.
  def.slots = {{"v_row", SlotShape::kFactoredRow, false, false},
               {"v_col", SlotShape::kFactoredCol, false, false},
               {"v", SlotShape::kUnfactored, false, false}};
  def.build = [](const UpdateInputs& in) {
    const Attributes& h = in.hyper;
    const Expr &p = in.param, &g = in.grad;
    Builder& builder = p.builder();
    const double eps1 = h.f("eps1"), eps2 = h.f("eps2"), wd = h.f("weight_decay");
    Expr lr = in.lr;
    if (h.b("scale_parameter")) lr = lr * maximum(builder.scalar(eps2, p.dtype()), rms(p));
    const Expr b = 1.0 - pow(in.step, h.f("decay_rate"));  // the moments' decay this step
    const Expr one_minus_b = 1.0 - b;
    const Expr u = square(g) + eps1;
    std::vector<Expr> out(4);
    Expr update;
    if (p.rank() >= 2) {
      out[1] = b * in.slots[0] + one_minus_b * mean(u, {-1});
      out[2] = b * in.slots[1] + one_minus_b * mean(u, {-2});
      Expr r_factor = rsqrt(out[1] / mean(out[1], {-1}, true));
      Expr c_factor = rsqrt(out[2]);
      Shape r_shape = r_factor.shape(), c_shape = c_factor.shape();
      r_shape.push_back(1);
      c_shape.insert(c_shape.end() - 1, 1);
      update = reshape(r_factor, r_shape) * reshape(c_factor, c_shape) * g;
    } else {
      out[3] = b * in.slots[2] + one_minus_b * u;
      update = rsqrt(out[3]) * g;
    }
    update = update / maximum(builder.scalar(1.0, p.dtype()), rms(update) / h.f("clip_threshold"));
    Expr decayed = wd != 0 ? p - lr * wd * p : p;
    out[0] = decayed - lr * update;
    return out;
  };
  return def;
}

std::vector<OptimizerDef> make_optimizers() {
  std::vector<OptimizerDef> all;
#define KILN_RULE_ENTRY(Rule) all.push_back(rule_entry<Rule>());
  KILN_OPTIMIZER_RULES(KILN_RULE_ENTRY)
#undef KILN_RULE_ENTRY
  all.push_back(adafactor_entry());
  return all;
}

bool in_range(const HyperSpec& spec, double v) {
  if (spec.boolean) return v == 0 || v == 1;
  if (!std::isfinite(v)) return false;
  const bool above = spec.low_open ? v > spec.low : v >= spec.low;
  const bool below = spec.high_open ? v < spec.high : v <= spec.high;
  return above && below;
}

std::string range_text(const HyperSpec& spec) {
  if (spec.boolean) return "0 or 1 (false or true)";
  const std::string low = spec.low <= -kUnbounded ? "(-inf" : fmt::format("{}{}", spec.low_open ? "(" : "[", spec.low);
  const std::string high = spec.high >= kUnbounded ? "inf)" : fmt::format("{}{}", spec.high, spec.high_open ? ")" : "]");
  return low + ", " + high;
}

}  // namespace

std::optional<Shape> slot_shape(const StateSlot& slot, const Shape& param) {
  const bool matrix = param.size() >= 2;
  switch (slot.shape) {
    case SlotShape::kParam:
      return param;
    case SlotShape::kUnfactored:
      if (matrix) return std::nullopt;
      return param;
    case SlotShape::kFactoredRow:
      if (!matrix) return std::nullopt;
      return Shape(param.begin(), param.end() - 1);
    case SlotShape::kFactoredCol: {
      if (!matrix) return std::nullopt;
      Shape s(param.begin(), param.end() - 2);
      s.push_back(param.back());
      return s;
    }
  }
  return std::nullopt;
}

const HyperSpec* OptimizerDef::find_hyper(std::string_view hyper_name) const {
  for (const HyperSpec& spec : hyper)
    if (hyper_name == spec.name) return &spec;
  return nullptr;
}

int OptimizerDef::state_per_param_element() const {
  return static_cast<int>(std::count_if(slots.begin(), slots.end(),
                                        [](const StateSlot& s) { return s.shape == SlotShape::kParam; }));
}

const std::vector<OptimizerDef>& optimizers() {
  static const std::vector<OptimizerDef> all = make_optimizers();
  return all;
}

std::string optimizer_names(std::string_view separator) {
  std::string names;
  for (const OptimizerDef& def : optimizers()) names += (names.empty() ? "" : std::string(separator)) + def.name;
  return names;
}

const OptimizerDef& optimizer_def(const std::string& name) {
  for (const OptimizerDef& def : optimizers())
    if (def.name == name) return def;
  fail("unknown optimizer '{}' (expected {})", name, optimizer_names(", "));
}

std::vector<std::string> hyperparameter_names() {
  std::vector<std::string> names;
  for (const OptimizerDef& def : optimizers())
    for (const HyperSpec& spec : def.hyper)
      if (std::find(names.begin(), names.end(), spec.name) == names.end()) names.push_back(spec.name);
  return names;
}

std::vector<std::string> slot_names(std::optional<SlotShape> shape) {
  std::vector<std::string> names;
  for (const OptimizerDef& def : optimizers())
    for (const StateSlot& slot : def.slots)
      if ((!shape || slot.shape == *shape) && std::find(names.begin(), names.end(), slot.name) == names.end()) names.push_back(slot.name);
  return names;
}

Attributes hyper_attributes(const OptimizerDef& def, const std::map<std::string, double>& values) {
  for (const auto& [name, value] : values) {
    const HyperSpec* spec = def.find_hyper(name);
    if (!spec) {
      std::vector<std::string> known;
      for (const HyperSpec& s : def.hyper) known.push_back(s.name);
      fail("optimizer {} has no hyperparameter '{}' (it has: {})", def.name, name, fmt::join(known, ", "));
    }
    KILN_CHECK(in_range(*spec, value), "optimizer {}: {} must be in {}, got {}", def.name, name, range_text(*spec), value);
  }
  Attributes attrs;
  for (const HyperSpec& spec : def.hyper) {
    auto it = values.find(spec.name);
    const double v = it != values.end() ? it->second : spec.default_value;
    if (spec.boolean) attrs.set(spec.name, v != 0);
    else attrs.set(spec.name, v);
  }
  if (def.name == Sgd::kName)
    KILN_CHECK(!attrs.b("nesterov") || attrs.f("momentum") > 0, "optimizer sgd: nesterov needs momentum > 0");
  return attrs;
}

void check_hyper_attributes(const OptimizerDef& def, const Attributes& attrs) {
  std::map<std::string, double> values;
  for (const auto& [name, value] : attrs.items()) {
    if (name == "optimizer") continue;
    const HyperSpec* spec = def.find_hyper(name);
    KILN_CHECK(spec, "optimizer {} has no hyperparameter '{}'", def.name, name);
    values[name] = hyper(attrs, *spec);
  }
  for (const HyperSpec& spec : def.hyper)
    KILN_CHECK(attrs.has(spec.name), "optimizer {}: hyperparameter '{}' is missing", def.name, spec.name);
  hyper_attributes(def, values);  // the range checks
}

HyperValues hyper_values(const OptimizerDef& def, const Attributes& attrs) {
  HyperValues h{};
  for (size_t i = 0; i < def.hyper.size(); ++i) h.v[i] = hyper(attrs, def.hyper[i]);
  return h;
}

}  // namespace kiln::optim
