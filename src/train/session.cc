#include "train/session.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>

#include <nlohmann/json.hpp>

#include "distributed/process_group.h"
#include "support/bytes.h"
#include "support/error.h"
#include "passes/fp8_linear.h"
#include "train/checkpoint/reshard.h"
#include "train/data/loader.h"
#include "train/placement.h"
#include "train/trainer.h"

namespace kiln::train {

Model model_from_values(Graph forward, const std::map<std::string, Tensor>& values) {
  Model model;
  for (const GraphInput& in : forward.inputs) {
    const Value& v = forward.value(in.value);
    auto it = values.find(v.name);
    if (in.role == Role::kParam) model.params.push_back(it != values.end() ? it->second : Tensor(v.type));
    if (in.role == Role::kState && it != values.end()) model.initial_state[v.name] = it->second;
  }
  model.forward = std::move(forward);
  return model;
}

TrainingSession::TrainingSession(Model model, SessionOptions options, ProcessGroup* group)
    : options_(std::move(options)) {
  validate(options_.optimizer);
  runtime_ = runtime_of(options_.device);
  if (group)
    KILN_CHECK(group->device() == runtime_->device(), "the process group runs on {}, the step on {}",
               device_name(group->device()), device_name(runtime_->device()));
  int64_t param_count = 0;  // from the graph: a zero3 rank's params may be its shards alone
  for (const GraphInput& in : model.forward.inputs)
    if (in.role == Role::kParam) param_count += model.forward.type(in.value).numel();
  const int world = group ? group->world_size() : 1;
  shard_ = choose_shard_mode(options_.shard, world, param_count, options_.optimizer.name, shard_budget_bytes(*runtime_),
                             &shard_note_);
  const ShardingOptions sharding{parse_shard_mode(shard_), world};
  group_ = sharding.enabled() ? group : nullptr;  // "auto" may choose none: the group is not used
  if (options_.on_placed) options_.on_placed(shard_, shard_note_);

  const Stopwatch building;
  ExecutorOptions executor = options_.executor;
  executor.device = runtime_->device();
  executor.communicator = group_ ? group_->communicator().get() : nullptr;
  PassOptions passes = passes_for(options_.passes, group_, *runtime_);
  if (model.draw_params) {
    // Drawn while the step compiles, which needs no param values: the draw is Box-Muller math,
    // ~20 ns a value on a core (llama-8b's 4e9 values a zero3 rank took 9 s of 16 cores). Started
    // after passes_for, whose measurement of the group's collectives the draw's threads would
    // disturb. A zero3 rank draws only its shards.
    const bool zero3 = sharding.mode == ShardMode::kZero3;
    const int shards = zero3 ? world : 1, rank = zero3 ? group_->rank() : 0;
    std::shared_future<std::vector<Tensor>> params =
        std::async(std::launch::async, std::move(model.draw_params), shards, rank).share();
    trainer_ = std::make_unique<Trainer>(model.forward, options_.optimizer, std::move(params), executor,
                                         std::move(passes), sharding);
    params_drawn_ = true;
  } else {
    trainer_ = std::make_unique<Trainer>(model.forward, options_.optimizer, std::move(model.params), executor,
                                         std::move(passes), sharding);
  }
  for (const auto& [name, value] : model.initial_state) trainer_->set_initial_value(name, value);
  // Every rank compiled the same step (same model, batch, options and build), or none goes on.
  if (group_)
    group_->check_agreement("the compiled step (model, batch, options, build)",
                            step_fingerprint(*trainer_, options_.agreement));
  build_seconds_ = building.seconds();
}

// Here, where Trainer is complete.
TrainingSession::~TrainingSession() = default;

void TrainingSession::save_consolidated(const std::string& path,
                                        const std::map<std::string, std::string>& metadata) const {
  trainer_->save_consolidated(path, metadata);
  if (group_) group_->barrier();
}

std::map<std::string, std::string> TrainingSession::load(const std::vector<std::string>& paths) {
  return trainer_->load(paths);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s / 60) % 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

namespace {

// Where this rank appends its metrics: rank 0 to the file asked for, another rank to its own
// FILE.rank<R> when every rank's are asked for, else nowhere (every rank appending to one file
// interleaves their lines and repeats each step as many times as there are ranks).
std::string metrics_file_of_rank(const LoopOptions& loop, int rank) {
  if (loop.metrics_path.empty() || rank == 0) return loop.metrics_path;
  return loop.metrics_all_ranks ? fmt::format("{}.rank{}", loop.metrics_path, rank) : "";
}

}  // namespace

TrainResult TrainingSession::train(const TrainingData& data, const LoopOptions& loop) {
  Trainer& trainer = *trainer_;
  const int rank = trainer.rank(), world = trainer.world_size();
  std::FILE* out = loop.out;
  const bool tty = isatty(fileno(out)) != 0;
  const bool on_cuda = runtime_->device() == Device::kCuda;
  KILN_CHECK(loop.steps > 0, "--steps must be > 0, got {}", loop.steps);
  TrainResult result;
  result.device = options_.device;
  result.amp = options_.optimizer.amp;
  result.world_size = world;
  result.shard = shard_;
  result.setup_seconds = loop.setup_seconds;
  const Stopwatch resuming;
  // Checkpoints: one file alone; in a group one per rank (its shards), named for the group's
  // size, and on request a consolidated one. A group of any size and mode resumes from any of
  // them (checkpoint/reshard.h).
  const CheckpointOptions& c = loop.checkpoints;
  const std::string checkpoint = c.dir.empty() ? "" : checkpoint_path(c.dir, rank, world);
  const std::string consolidated = c.dir.empty() ? "" : consolidated_path(c.dir);
  KILN_CHECK(!c.consolidate || !c.dir.empty(), "--consolidate needs --checkpoint-dir");
  if (!checkpoint.empty()) std::filesystem::create_directories(c.dir);
  KILN_CHECK(!c.resume || !checkpoint.empty(), "--resume needs --checkpoint-dir");
  // A group that its launcher restarted after a failure (kiln launch --max-restarts, torchrun)
  // resumes from its last checkpoint, if it wrote one before it failed.
  const int restart = restart_count();
  if (c.resume || (restart > 0 && !checkpoint.empty())) {
    const std::optional<CheckpointFiles> from = find_checkpoint(c.dir, world);
    KILN_CHECK(from || !c.resume, "--resume: no checkpoint in '{}' (last.safetensors, last.rank*-of-N.safetensors or "
               "consolidated.safetensors)", c.dir);
    if (from) {
      auto metadata = trainer.load(from->paths);
      auto model = c.metadata.find("kiln.model");
      if (model != c.metadata.end())
        KILN_CHECK(metadata["kiln.model"] == model->second, "checkpoint '{}' is of model '{}', not '{}'", from->paths[0],
                   metadata["kiln.model"], model->second);
      fmt::print(out, "  {}resumed from {} at step {} (written by {} rank{}, shard {})\n",
                 restart > 0 ? fmt::format("restart {}: ", restart) : "",
                 from->world_size == 1 ? from->paths[0] : fmt::format("{} rank files", from->world_size),
                 from->steps_done, from->world_size, from->world_size == 1 ? "" : "s", from->shard);
    } else {
      fmt::print(out, "  restart {}: no checkpoint in '{}' yet: starting over\n", restart, c.dir);
    }
  }
  result.compile_seconds = build_seconds_ + resuming.seconds();
  for (const auto& [phase, seconds] : trainer.build_seconds())
    if (phase == "params wait") result.params_wait_seconds = seconds;
  // Where the params were drawn beside the compile, the compile's time includes its wait for them.
  const std::string params_wait =
      params_drawn_ ? fmt::format(" incl. params wait {:.2f} s", result.params_wait_seconds) : "";
  // Wall time since the run started: the face's setup, then the session's.
  auto run_seconds = [&] { return loop.setup_seconds + since_made_.seconds(); };
  std::ofstream metrics;
  if (const std::string path = metrics_file_of_rank(loop, rank); !path.empty()) {
    metrics.open(path, std::ios::app);
    KILN_CHECK(metrics.good(), "cannot open metrics file '{}'", path);
  }
  auto save = [&] {
    if (checkpoint.empty()) return;
    const Stopwatch saving;
    keep_previous_checkpoint(c.dir, rank, world);
    trainer.save(checkpoint, c.metadata);
    if (c.consolidate) save_consolidated(consolidated, c.metadata);
    result.checkpoint_seconds += saving.seconds();
  };

  fmt::print(out, "  {}\n  {} steps of batch {}, {} lr {}, seed {}{}\n", data.description, loop.steps,
             data.global_batch, options_.optimizer.name, options_.optimizer.lr, data.seed,
             trainer.steps_done() > 0 ? fmt::format(", resumed at step {}", trainer.steps_done()) : "");
  if (on_cuda)
    fmt::print(out, "  {}: params and state {}, step arena and outputs {}\n", runtime_->name(),
               format_bytes(trainer.param_and_state_bytes()), format_bytes(trainer.step_executor().device_bytes()));
  if (options_.optimizer.amp == "fp8") fmt::print(out, "  {}\n", fp8_summary(trainer.step_executor().graph()));
  std::fflush(out);

  const int64_t first = trainer.steps_done();
  KILN_CHECK(first < loop.steps, "the checkpoint is already at step {}; ask for more --steps than that", first);
  Prefetcher<std::vector<Tensor>> prefetcher([&](int64_t i) { return data.batch(first + i); }, loop.steps - first);
  const Stopwatch loop_time;
  double ema_loss = NAN;
  std::string eval_note;
  // On CUDA the loss is read only at the progress interval (and at evaluations and the end), so
  // the host issues steps ahead of the device in between; the CPU reads every step.
  std::vector<double> unread_lrs;
  const int64_t interval = std::max<int64_t>(loop.log_every, 1);
  // The steps' own time at the progress points (where the losses were read, so the device had
  // run them): the rates shown are since the last interval's point, and the steady state is
  // timed from the first point after the warm-up steps (on CUDA an executor's first three runs
  // launch directly, tune the GEMMs and capture the step: ~1.5 s of a GPT-2 run that
  // measuring from the start folded into its ms/step).
  const int64_t warm_steps = on_cuda ? 3 : 1;
  auto step_time = [&] { return loop_time.seconds() - result.eval_seconds - result.checkpoint_seconds; };
  int64_t window_done = first, steady_done = -1;
  double window_time = 0, steady_time = 0;
  for (int64_t step = first; step < loop.steps; ++step) {
    std::optional<std::vector<Tensor>> batch = prefetcher.next();
    KILN_CHECK(batch.has_value(), "the data loader ended early at step {}", step);
    unread_lrs.push_back(trainer.current_lr());
    trainer.step(*batch);
    const int64_t done = step + 1;
    const bool eval_now = data.evaluate && (done == loop.steps || (loop.eval_every > 0 && done % loop.eval_every == 0));
    const bool last = done == loop.steps;
    if (on_cuda && !eval_now && !last && done != first + 1 && done % interval != 0) continue;

    std::vector<double> losses = trainer.take_losses();
    KILN_CHECK(losses.size() == unread_lrs.size(), "internal: {} losses for {} steps", losses.size(), unread_lrs.size());
    if (done == first + 1) {
      // take_losses() waited for it: the step has run.
      result.first_step_seconds = run_seconds();
      fmt::print(out, "  first step done {:.2f} s after start (setup {:.2f} s, compile {:.2f} s{}, the step {:.2f} s)\n",
                 result.first_step_seconds, result.setup_seconds, result.compile_seconds, params_wait,
                 loop_time.seconds());
    }
    const double elapsed = loop_time.seconds();
    const double now = step_time();
    const double rate = static_cast<double>((done - window_done) * data.items_per_step) / std::max(now - window_time, 1e-9);
    if (done % interval == 0) {
      window_done = done;
      window_time = now;
    }
    if (steady_done < 0 && done >= first + warm_steps) {
      steady_done = done;
      steady_time = now;
    }
    const double eta = elapsed / static_cast<double>(done - first) * static_cast<double>(loop.steps - done);
    std::vector<nlohmann::json> records;
    for (size_t k = 0; k < losses.size(); ++k) {
      const int64_t number = done - static_cast<int64_t>(losses.size() - k) + 1;
      const double loss = losses[k];
      if (!std::isfinite(loss)) {
        if (tty) fmt::print(out, "\n");
        fail("loss is {} at step {}; stopped{}", loss, number,
             checkpoint.empty() ? "" : fmt::format(" (last good checkpoint: '{}')", checkpoint));
      }
      ema_loss = std::isnan(ema_loss) ? loss : 0.9 * ema_loss + 0.1 * loss;
      result.final_loss = loss;
      result.losses.push_back(loss);
      records.push_back(nlohmann::json{{"step", number}, {"loss", loss}, {"lr", unread_lrs[k]}, {data.item_name + "_per_s", rate}});
    }
    unread_lrs.clear();
    if (eval_now) {
      const Stopwatch evaluating;
      const Evaluation e = data.evaluate(trainer);
      result.eval_seconds += evaluating.seconds();
      ++result.evaluations;
      result.eval_name = e.name;
      result.eval_metric = e.value;
      result.eval_batches = e.batches;
      records.back()["eval_" + e.name] = e.value;
      eval_note = e.name == "accuracy"     ? fmt::format("  test acc {:.2f}%", 100 * e.value)
                  : e.name == "perplexity" ? fmt::format("  eval ppl {:.2f}", e.value)
                                           : fmt::format("  eval {} {:.4f}", e.name, e.value);
    }
    // Without an evaluation the checkpoint is written where the evaluation would have been.
    if (eval_now || (!data.evaluate && (last || (loop.eval_every > 0 && done % loop.eval_every == 0)))) save();
    if (metrics.is_open())
      for (const nlohmann::json& record : records) metrics << record.dump() << "\n" << std::flush;
    std::string line = fmt::format("step {:>{}}/{}  loss {:.4f}{}  {:.0f} {}/s  eta {}", done,
                                   std::to_string(loop.steps).size(), loop.steps, ema_loss, eval_note, rate,
                                   data.item_name, format_duration(eta));
    if (tty) fmt::print(out, "\r{:<100}", line);
    else if (done % interval == 0 || eval_now || last || done == first + 1) fmt::print(out, "{}\n", line);
    std::fflush(out);
  }
  if (tty) fmt::print(out, "\n");
  result.steps_done = trainer.steps_done();
  result.step_seconds = loop_time.seconds() - result.eval_seconds - result.checkpoint_seconds;
  if (steady_done >= 0 && trainer.steps_done() > steady_done)
    result.steady_step_seconds = (result.step_seconds - steady_time) / static_cast<double>(trainer.steps_done() - steady_done);
  const std::string steady =
      result.steady_step_seconds > 0
          ? fmt::format("; {:.1f} after step {}, in steady state", 1e3 * result.steady_step_seconds, steady_done)
          : "";
  result.seconds = run_seconds();
  fmt::print(out, "done: {} steps in {}, final loss {:.4f}{}\n", result.steps_done, format_duration(result.seconds),
             result.final_loss,
             result.evaluations == 0 ? ""
             : fmt::format(", test {} {}, evaluation {:.2f} s", result.eval_name,
                           result.eval_name == "accuracy" ? fmt::format("{:.2f}%", 100 * result.eval_metric)
                                                          : fmt::format("{:.2f}", result.eval_metric),
                           result.eval_seconds));
  fmt::print(out,
             "  wall time {:.2f} s: setup {:.2f} s, compile {:.2f} s{}, steps {:.2f} s ({:.1f} ms/step{}), evaluation "
             "{:.2f} s ({} x {} batches, compile {:.2f} s), checkpoints {:.2f} s\n",
             result.seconds, result.setup_seconds, result.compile_seconds, params_wait, result.step_seconds,
             1e3 * result.step_seconds / static_cast<double>(loop.steps - first), steady, result.eval_seconds, result.evaluations,
             result.eval_batches, trainer.eval_compile_seconds(), result.checkpoint_seconds);
  if (!checkpoint.empty())
    fmt::print(out, "checkpoint: {}{}\n",
               world == 1 ? checkpoint
                          : (std::filesystem::path(c.dir) / fmt::format("last.rank*-of-{}.safetensors", world)).string(),
               c.consolidate ? fmt::format(" and {}", consolidated) : "");
  return result;
}

}  // namespace kiln::train
