// The extension module kiln._kiln: a thin layer over kiln's C++ API for the Python package
// (python/kiln/, docs/python.md). What lives here:
// - Program: a forward graph with the initial values of its params and state, from an ONNX
//   model's bytes (the ONNX front end) or from IR text (a checkpoint written by step.save).
// - Session: a train::TrainingSession over a Program (compile, step, evaluate, tensors by name,
//   checkpoints, the compile report), its tensors crossing as DLPack without copies
//   (tensors.h); sharded (dp, ZeRO-1/2/3) over a Group.
// - Group: the data-parallel process group this process is a rank of, joined from torchrun's
//   variables as `kiln train` joins it (train/placement.h), shared by the process's sharded sessions.
// - kiln::Error becomes the Python exception kiln.Error with kiln's message.
// Everything a user chooses (names, defaults, torch, streams, progress) is Python's
// (python/kiln/); long C++ calls release the GIL.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "compile/report.h"
#include "device/device_runtime.h"
#include "distributed/process_group.h"
#include "frontend/onnx/onnx_import.h"
#include "ir/text.h"
#include "ir/verifier.h"
#include "ops/optimizer/optimizers.h"
#include "support/stopwatch.h"
#include "tensors.h"
#include "train/placement.h"
#include "train/session.h"
#include "train/trainer.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kiln::python {
namespace {

std::string_view role_text(Role role) {
  switch (role) {
    case Role::kParam: return "param";
    case Role::kState: return "state";
    case Role::kData: return "data";
  }
  return "?";
}

// A forward graph and where it came from.
struct Program {
  Graph graph;
  std::map<std::string, Tensor> initial_values;  // params and state, by graph-input name
  std::map<std::string, std::string> onnx_names;  // kiln name -> ONNX name, where they differ
  std::string source;                             // "import" or "parse"
  double source_seconds = 0;

  // (name, role, dtype, shape) of each graph input, in order.
  std::vector<std::tuple<std::string, std::string, std::string, std::vector<int64_t>>> inputs() const {
    std::vector<std::tuple<std::string, std::string, std::string, std::vector<int64_t>>> out;
    for (const GraphInput& in : graph.inputs) {
      const Value& v = graph.value(in.value);
      out.emplace_back(v.name, std::string(role_text(in.role)), std::string(dtype_name(v.type.dtype)), v.type.shape);
    }
    return out;
  }
};

Program import_program(const nb::bytes& data, const std::string& source, const std::vector<std::string>& freeze,
                       const std::string& loss, const std::string& labels) {
  onnx::ImportOptions options;
  options.freeze = freeze;
  options.loss = loss;
  options.labels = labels;
  std::string bytes(data.c_str(), data.size());
  nb::gil_scoped_release release;
  const Stopwatch clock;
  onnx::ImportedModel model = onnx::import_onnx_bytes(bytes, ".", options, source);
  return Program{std::move(model.graph), std::move(model.initial_values), std::move(model.onnx_names), "import",
                 clock.seconds()};
}

Program parse_program(const std::string& text) {
  const Stopwatch clock;
  Graph graph = parse(text);
  verify(graph);
  return Program{std::move(graph), {}, {}, "parse", clock.seconds()};
}

// The process group of a distributed job (WORLD_SIZE > 1), shared: every session of the
// process that trains sharded runs its collectives through it, and it lives as long as they do.
struct Group {
  std::shared_ptr<ProcessGroup> group;
};

// The group from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
// joined on "cpu" (Gloo) or "cuda" (NCCL; GPU LOCAL_RANK becomes current); none without
// WORLD_SIZE or with WORLD_SIZE=1. Waits for every rank to join (kiln::Error after a timeout).
std::optional<Group> join_group(const std::string& device) {
  nb::gil_scoped_release release;
  std::unique_ptr<ProcessGroup> group = train::join_group(device);
  if (!group) return std::nullopt;
  return Group{std::shared_ptr<ProcessGroup>(std::move(group))};
}

struct SessionOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  int device_index = 0;        // which CUDA device
  std::string shard = "none";  // none | auto | dp | zero1 | zero2 | zero3: over the Group given
  std::optional<size_t> memory_budget;
  std::vector<std::string> disabled_passes;
  std::vector<std::string> dialects;
};

// A compiled training step over a Program, and its tensors.
class Session {
 public:
  // Sharded (options.shard other than "none") over `group`: this process is one rank, the data
  // are its rows, and the step is what `kiln train --shard` compiles: both are a training
  // session (train/session.h).
  Session(Program program, OptimizerConfig config, SessionOptions options, const Group* group)
      : program_(std::move(program)), options_(std::move(options)) {
    const Stopwatch clock;
    KILN_CHECK(options_.device == "cpu" || options_.device == "cuda", "device '{}': expected 'cpu' or 'cuda'",
               options_.device);
    if (options_.device == "cuda") device_runtime(Device::kCuda, options_.device_index)->make_current();
    ProcessGroup* process_group = nullptr;
    if (options_.shard != "none") {
      KILN_CHECK(group != nullptr && group->group, "shard '{}' needs the process group of a distributed job",
                 options_.shard);
      group_ = group->group;
      process_group = group_.get();
    }
    train::SessionOptions session;
    session.device = options_.device;
    session.shard = options_.shard;
    session.optimizer = std::move(config);
    session.passes.memory_budget = options_.memory_budget;
    session.passes.disabled.insert(options_.disabled_passes.begin(), options_.disabled_passes.end());
    session.executor.dialects = options_.dialects;
    session.agreement = "python";
    session_ = std::make_unique<train::TrainingSession>(train::model_from_values(program_.graph, program_.initial_values),
                                                        session, process_group);
    if (!session_->group()) group_.reset();  // "auto" chose none: the group is not used
    trainer_ = &session_->trainer();
    compile_seconds_ = clock.seconds();
  }

  ~Session() {
    nb::gil_scoped_release release;  // the trainer waits for its stream; the group for the other ranks
    session_.reset();
    group_.reset();
  }

  const Program& program() const { return program_; }
  const train::Trainer& trainer() const { return session_->trainer(); }

  // One training step; the loss into `loss_out` (a device tensor the caller made) when given,
  // else returned (the CPU's output buffer, fresh each step).
  nb::object step(const std::vector<Array>& data, const std::optional<Array>& loss_out) {
    std::vector<Tensor> tensors = data_tensors(data);
    std::optional<Tensor> out;
    if (loss_out) out = from_array(*loss_out, "the loss buffer");
    std::vector<Tensor> outputs;
    {
      nb::gil_scoped_release release;
      outputs = trainer_->step(tensors);
      if (out) trainer_->runtime().copy_async(*out, outputs[0], trainer_->step_executor().stream());
    }
    if (out) return nb::none();
    KILN_CHECK(trainer_->device() == Device::kCpu, "a step on {} needs a loss buffer", device_name(trainer_->device()));
    return to_array(outputs[0]);
  }

  // The forward's outputs on `data`, on the step's device, without a host wait: on the CPU
  // returned (fresh tensors); on a GPU copied on the stream into `outputs_out` (device tensors
  // the caller made, of output_types()), and none returned, as step() does with the loss (the
  // forward step's own output buffers are overwritten by its next run).
  std::vector<nb::object> evaluate(const std::vector<Array>& data,
                                   const std::optional<std::vector<Array>>& outputs_out) const {
    std::vector<Tensor> tensors = data_tensors(data);
    std::vector<Tensor> buffers;
    if (outputs_out)
      for (size_t i = 0; i < outputs_out->size(); ++i)
        buffers.push_back(from_array((*outputs_out)[i], fmt::format("output buffer {}", i)));
    std::vector<Tensor> outputs;
    {
      nb::gil_scoped_release release;
      outputs = trainer_->evaluate_on_device(tensors);
      if (outputs_out) {
        KILN_CHECK(buffers.size() == outputs.size(), "evaluate: {} output buffers for {} outputs", buffers.size(),
                   outputs.size());
        for (size_t i = 0; i < outputs.size(); ++i) {
          KILN_CHECK(buffers[i].type() == outputs[i].type(), "evaluate: output {} is {}, its buffer {}", i,
                     to_string(outputs[i].type()), to_string(buffers[i].type()));
          trainer_->runtime().copy_async(buffers[i], outputs[i], trainer_->step_executor().stream());
        }
      }
    }
    std::vector<nb::object> out;
    if (outputs_out) return out;
    KILN_CHECK(trainer_->device() == Device::kCpu, "an evaluation on {} needs output buffers",
               device_name(trainer_->device()));
    for (const Tensor& t : outputs) out.push_back(to_array(t));
    return out;
  }

  // (dtype, shape) of each of the forward's outputs, the loss first.
  std::vector<std::tuple<std::string, std::vector<int64_t>>> output_types() const {
    std::vector<std::tuple<std::string, std::vector<int64_t>>> out;
    for (ValueId id : program_.graph.outputs) {
      const TensorType& t = program_.graph.type(id);
      out.emplace_back(std::string(dtype_name(t.dtype)), t.shape);
    }
    return out;
  }

  std::vector<double> take_losses() {
    nb::gil_scoped_release release;
    return trainer_->take_losses();
  }

  void synchronize() const {
    nb::gil_scoped_release release;
    trainer_->synchronize();
  }

  // Params and state by graph-input name at their full shapes: the forward's (model = true),
  // or also the optimizer's and the step's. Over kiln's own storage (no copies) where this rank
  // holds a tensor whole; a shard is gathered from every rank into a new tensor (every rank
  // must call this: Trainer::full_tensor).
  std::map<std::string, nb::object> tensors(bool model_only) const {
    std::map<std::string, Tensor> full;
    {
      nb::gil_scoped_release release;
      for (const auto& [name, tensor] : trainer_->named_tensors())
        if (!model_only || is_forward_input(name)) full[name] = trainer_->full_tensor(name);
    }
    std::map<std::string, nb::object> out;
    for (const auto& [name, tensor] : full) out[name] = to_array(tensor, options_.device_index);
    return out;
  }

  // Copies `value` (the full shape) into param or state `name`, this rank's shard of it where
  // it holds one; returns when the copy is done.
  void copy_into(const std::string& name, const Array& value) {
    const Tensor source = from_array(value, fmt::format("the value of '{}'", name));
    nb::gil_scoped_release release;
    trainer_->assign(name, source);
  }

  // The params and state this rank holds a shard of (zero3's params, zero1/2/3's optimizer
  // state): a caller's tensor cannot be adopted for them.
  std::vector<std::string> sharded() const {
    std::vector<std::string> out;
    for (const auto& [name, tensor] : trainer_->named_tensors())
      if (trainer_->holds_shard(name)) out.push_back(name);
    return out;
  }

  // Param or state `name` lives in `value`'s bytes from now on (Trainer::adopt); `value` is
  // kept alive with the session.
  void adopt(const std::string& name, const Array& value, nb::object owner) {
    Tensor tensor = from_array(value, fmt::format("'{}'", name));
    {
      nb::gil_scoped_release release;
      trainer_->adopt(name, tensor);
    }
    adopted_.push_back(std::move(owner));
  }

  // Every tensor whole (a group's shards gathered; rank 0 writes, every rank must call it, and
  // returns once the file is there), so that a group of any size, or one process, loads it.
  void save(const std::string& path, const std::map<std::string, std::string>& metadata) const {
    nb::gil_scoped_release release;
    session_->save_consolidated(path, metadata);
  }

  std::map<std::string, std::string> load(const std::string& path) {
    nb::gil_scoped_release release;
    return session_->load({path});
  }

  std::string report(const std::string& what) const {
    return compile_report(what, program_.source, program_.graph, program_.source_seconds, trainer_->compiled_step(),
                          program_.source_seconds + compile_seconds_);
  }

  uintptr_t stream() const { return reinterpret_cast<uintptr_t>(trainer_->step_executor().stream().handle()); }
  std::string loss_dtype() const {
    const Graph& g = trainer_->program().graph;
    return std::string(dtype_name(g.type(g.outputs.at(0)).dtype));
  }
  double compile_seconds() const { return compile_seconds_; }
  const std::string& shard() const { return session_->shard(); }
  int rank() const { return trainer_->rank(); }
  int world_size() const { return trainer_->world_size(); }

 private:
  bool is_forward_input(const std::string& name) const {
    for (const GraphInput& in : program_.graph.inputs)
      if (in.role != Role::kData && program_.graph.value(in.value).name == name) return true;
    return false;
  }

  std::vector<Tensor> data_tensors(const std::vector<Array>& data) const {
    std::vector<std::string> names;
    for (const GraphInput& in : program_.graph.inputs)
      if (in.role == Role::kData) names.push_back(program_.graph.value(in.value).name);
    KILN_CHECK(data.size() == names.size(), "the step takes {} inputs ({}), {} given", names.size(),
               fmt::join(names, ", "), data.size());
    std::vector<Tensor> out;
    for (size_t i = 0; i < data.size(); ++i) out.push_back(from_array(data[i], fmt::format("input '{}'", names[i])));
    return out;
  }

  Program program_;
  SessionOptions options_;
  std::shared_ptr<ProcessGroup> group_;  // sharded: before the trainer, which uses it until it goes
  std::unique_ptr<train::TrainingSession> session_;
  train::Trainer* trainer_ = nullptr;  // the session's
  std::vector<nb::object> adopted_;  // the Python owners of adopted tensors
  double compile_seconds_ = 0;
};

}  // namespace
}  // namespace kiln::python

NB_MODULE(_kiln, m) {
  using namespace kiln;
  using namespace kiln::python;
  m.doc() = "kiln's C++ core (the package `kiln` wraps it: docs/python.md)";
  m.attr("version") = KILN_VERSION;
  nb::exception<Error>(m, "Error");

  m.def("onnx_available", &onnx::onnx_available);
  // CPU process groups (shard= on the CPU) need Gloo, which a build may lack (the GPU machines).
  m.def("gloo_available", [] {
#ifdef KILN_HAVE_GLOO
    return true;
#else
    return false;
#endif
  });
  m.def("cuda_device_count", [] { return device_availability(Device::kCuda).count; });
  // The zero-copy bridge both ways: an array -> a kiln Tensor -> an array, over the same bytes.
  m.def("dlpack_view", [](const Array& array) { return to_array(from_array(array, "the array")); }, "array"_a.noconvert());
  // The same bytes as another dtype of their size, kept alive by `owner` (bool <-> u8: tensors.h).
  m.def("view_as",
        [](const Array& array, const std::string& dtype, const std::string& what, nb::handle owner) {
          const std::optional<DType> d = parse_dtype(dtype);
          KILN_CHECK(d.has_value(), "view_as: '{}' is no kiln dtype", dtype);
          return viewed_as(array, *d, what, owner);
        },
        "array"_a.noconvert(), "dtype"_a, "what"_a, "owner"_a);
  m.def("dtype_of", [](const Array& array) { return std::string(dtype_name(from_array(array, "the array").dtype())); },
        "array"_a.noconvert());

  // The optimizer registry (ops/optimizer/optimizers.h), from which python/kiln/optim.py makes
  // its classes: per optimizer its name, help, hyperparameters (name, default, boolean, help)
  // and state slots.
  m.def("optimizers", [] {
    nb::list out;
    for (const optim::OptimizerDef& def : optim::optimizers()) {
      nb::list hyper, slots;
      for (const optim::HyperSpec& spec : def.hyper)
        hyper.append(nb::make_tuple(spec.name, spec.default_value, spec.boolean, spec.help));
      for (const optim::StateSlot& slot : def.slots) slots.append(slot.name);
      out.append(nb::make_tuple(def.name, def.help, hyper, slots));
    }
    return out;
  });
  nb::class_<ParamGroup>(m, "ParamGroup")
      .def(nb::init<>())
      .def_rw("params", &ParamGroup::params)
      .def_rw("lr", &ParamGroup::lr)
      .def_rw("hyper", &ParamGroup::hyper);
  nb::class_<OptimizerConfig>(m, "OptimizerConfig")
      .def(nb::init<>())
      .def_rw("name", &OptimizerConfig::name)
      .def_rw("lr", &OptimizerConfig::lr)
      .def_rw("hyper", &OptimizerConfig::hyper)
      .def_rw("groups", &OptimizerConfig::groups)
      .def_rw("decay_biases_norms_embeddings", &OptimizerConfig::decay_biases_norms_embeddings)
      .def_rw("grad_clip", &OptimizerConfig::grad_clip)
      .def_rw("warmup_steps", &OptimizerConfig::warmup_steps)
      .def_rw("decay_steps", &OptimizerConfig::decay_steps)
      .def_rw("min_lr_ratio", &OptimizerConfig::min_lr_ratio)
      .def_rw("amp", &OptimizerConfig::amp);

  nb::class_<Program>(m, "Program")
      .def_prop_ro("inputs", &Program::inputs)
      .def_prop_ro("onnx_names", [](const Program& p) { return p.onnx_names; })
      .def_prop_ro("ir", [](const Program& p) { return print(p.graph); })
      .def_prop_ro("name", [](const Program& p) { return p.graph.name; });
  m.def("import_onnx", &import_program, "data"_a, "source"_a, "freeze"_a, "loss"_a, "labels"_a);
  m.def("parse_program", &parse_program, "text"_a);

  nb::class_<Group>(m, "Group")
      .def_prop_ro("rank", [](const Group& g) { return g.group->rank(); })
      .def_prop_ro("world_size", [](const Group& g) { return g.group->world_size(); })
      .def_prop_ro("local_rank", [](const Group& g) { return g.group->env().local_rank; })
      .def_prop_ro("engine", [](const Group& g) { return g.group->communicator()->engine(); })
      .def("barrier", [](Group& g) {
        nb::gil_scoped_release release;
        g.group->barrier();
      });
  m.def("join_group", &join_group, "device"_a);

  nb::class_<SessionOptions>(m, "SessionOptions")
      .def(nb::init<>())
      .def_rw("device", &SessionOptions::device)
      .def_rw("device_index", &SessionOptions::device_index)
      .def_rw("shard", &SessionOptions::shard)
      .def_rw("memory_budget", &SessionOptions::memory_budget)
      .def_rw("disabled_passes", &SessionOptions::disabled_passes)
      .def_rw("dialects", &SessionOptions::dialects);

  nb::class_<Session>(m, "Session")
      .def("__init__",
           [](Session* self, const Program& program, const OptimizerConfig& config, const SessionOptions& options,
              const Group* group) {
             nb::gil_scoped_release release;
             new (self) Session(program, config, options, group);
           },
           "program"_a, "config"_a, "options"_a, "group"_a.none() = nb::none())
      .def("step", &Session::step, "data"_a.noconvert(), "loss_out"_a.noconvert() = nb::none())
      .def("evaluate", &Session::evaluate, "data"_a.noconvert(), "outputs_out"_a.noconvert() = nb::none())
      .def_prop_ro("output_types", &Session::output_types)
      .def_prop_ro("sharded", &Session::sharded)
      .def_prop_ro("shard", &Session::shard)
      .def_prop_ro("rank", &Session::rank)
      .def_prop_ro("world_size", &Session::world_size)
      .def("take_losses", &Session::take_losses)
      .def("synchronize", &Session::synchronize)
      .def("tensors", &Session::tensors, "model_only"_a)
      .def("copy_into", &Session::copy_into, "name"_a, "value"_a.noconvert())
      .def("adopt", &Session::adopt, "name"_a, "value"_a.noconvert(), "owner"_a)
      .def("save", &Session::save, "path"_a, "metadata"_a)
      .def("load", &Session::load, "path"_a)
      .def("report", &Session::report, "what"_a)
      .def_prop_ro("program", &Session::program, nb::rv_policy::reference_internal)
      .def_prop_ro("stream", &Session::stream)
      .def_prop_ro("loss_dtype", &Session::loss_dtype)
      .def_prop_ro("steps_done", [](const Session& s) { return s.trainer().steps_done(); })
      .def_prop_ro("lr", [](const Session& s) { return s.trainer().current_lr(); })
      .def_prop_ro("compile_seconds", &Session::compile_seconds);
}
