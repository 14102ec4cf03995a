// The optimizer update of the elementwise optimizers, as one op of the training graph:
//
//   optimizer_update(param, grad, slot..., lr, step) {optimizer, <its hyperparameters>}
//       -> (param', slot'...)
//
// `optimizer` names a rule of ops/optimizer/rules.h (sgd, adamw, lion); the slots are its state
// (sgd: buf; adamw: m, v; lion: m), each shaped like the param; lr and step are f32/f64 scalars
// (shape ()), step is t >= 1 (this update's number), so a schedule needs no recompilation. The
// node returns the new values; Graph::updates then writes them back over the param and state
// inputs, so the whole step (forward, backward, update) is one graph and nothing is read back
// to the host. The reference kernel evaluates the rule in double.
#include "ops/common.h"
#include "ops/optimizer/optimizers.h"

namespace kiln::ops {
namespace {

void check_scalar(const TensorType& t, const char* what) {
  KILN_CHECK(t.rank() == 0 && is_float(t.dtype), "{} must be a float scalar, got {}", what, to_string(t));
}

void check_like(const TensorType& param, const TensorType& t, const std::string& what) {
  KILN_CHECK(t.shape == param.shape, "{} has shape {}, expected the param's {}", what,
             to_string(t.shape), to_string(param.shape));
  KILN_CHECK(is_float(t.dtype), "{} must be float, got {}", what, to_string(t));
}

template <class Rule>
void reference_update(const KernelArgs& k) {
  constexpr int kSlots = Rule::kSlots;
  const optim::HyperValues h = optim::hyper_values(optim::optimizer_def(Rule::kName), k.attrs);
  const double lr = k.inputs[2 + kSlots].get(0), t = k.inputs[3 + kSlots].get(0);
  const auto c = Rule::template prepare<double>(h, lr, t);
  for (int64_t i = 0; i < k.inputs[0].numel(); ++i) {
    double s[kSlots > 0 ? kSlots : 1];
    for (int j = 0; j < kSlots; ++j) s[j] = k.inputs[2 + j].get(i);
    k.outputs[0].set(i, Rule::apply(c, k.inputs[0].get(i), k.inputs[1].get(i), s));
    for (int j = 0; j < kSlots; ++j) k.outputs[1 + j].set(i, s[j]);
  }
}

}  // namespace

void define_optimizer_ops(OpRegistry& registry) {
  // The attributes: the optimizer's name and every optimizer's hyperparameters, each optional
  // in the schema; normalization fills in the optimizer's defaults, and inference checks that a
  // node has exactly its optimizer's.
  std::vector<AttrSpec> attrs{{"optimizer", AttrKind::kString}};
  for (const std::string& name : optim::hyperparameter_names()) {
    bool boolean = false;
    for (const optim::OptimizerDef& def : optim::optimizers())
      if (const optim::HyperSpec* spec = def.find_hyper(name)) boolean = spec->boolean;
    attrs.push_back(AttrSpec{name, boolean ? AttrKind::kBool : AttrKind::kFloat, std::nullopt, true});
  }
  OpDef update{
      attrs,
      [](std::span<const TensorType> in, const Attributes& a) {
        const optim::OptimizerDef& def = optim::optimizer_def(a.s("optimizer"));
        KILN_CHECK(def.elementwise, "optimizer {} is built from graph ops, not an optimizer_update node", def.name);
        const size_t slots = def.slots.size();
        KILN_CHECK(in.size() == 4 + slots, "optimizer_update {{optimizer={}}} takes param, grad, {} state slot(s), lr "
                   "and step ({} inputs), got {}", def.name, slots, 4 + slots, in.size());
        KILN_CHECK(is_float(in[0].dtype), "param must be float, got {}", to_string(in[0]));
        check_like(in[0], in[1], "grad");
        std::vector<TensorType> out{in[0]};
        for (size_t j = 0; j < slots; ++j) {
          check_like(in[0], in[2 + j], "state slot " + def.slots[j].name);
          if (j > 0)
            KILN_CHECK(in[2 + j].dtype == in[2].dtype, "state slot {} is {}, expected slot {}'s dtype {}",
                       def.slots[j].name, to_string(in[2 + j]), def.slots[0].name, dtype_name(in[2].dtype));
          out.push_back(in[2 + j]);
        }
        check_scalar(in[2 + slots], "lr");
        check_scalar(in[3 + slots], "step");
        optim::check_hyper_attributes(def, a);
        return out;
      },
      [](const KernelArgs& k) {
        const bool known = optim::visit_rule(k.attrs.s("optimizer").c_str(),
                                             [&](auto rule) { reference_update<decltype(rule)>(k); });
        KILN_CHECK(known, "optimizer_update: no rule for optimizer '{}'", k.attrs.s("optimizer"));
      },
      nullptr, false};
  // The hyperparameters a node leaves out take its optimizer's defaults (an unknown optimizer
  // is left for inference to name).
  update.normalize = [](Attributes& a) {
    if (!a.has("optimizer") || attr_kind(a.get("optimizer")) != AttrKind::kString) return;
    for (const optim::OptimizerDef& def : optim::optimizers()) {
      if (def.name != a.s("optimizer")) continue;
      for (const optim::HyperSpec& spec : def.hyper) {
        if (a.has(spec.name)) continue;
        if (spec.boolean) a.set(spec.name, spec.default_value != 0);
        else a.set(spec.name, spec.default_value);
      }
    }
  };
  update.traits.recompute = Recompute::kNever;  // an update changes state: run once
  registry.define(Op::kOptimizerUpdate, std::move(update));
}

}  // namespace kiln::ops
