// `kiln train`: a training job (train/job.h: a task trained in a session) with progress,
// evaluation and checkpoints.
#include "options.h"
#include "train/job.h"

namespace kiln::cli {

void add_train_command(CLI::App& app) {
  CLI::App* command = app.add_subcommand("train", "Train a model on a CUDA GPU when there is one, else the CPU, printing progress");
  auto job = std::make_shared<train::JobOptions>();
  auto file = std::make_shared<std::string>();
  command->add_option("MODEL", *file,
                      "An ONNX model (.onnx) to train instead of --model: its inputs bind to --data by their shapes");
  add_model_option(command, job->model, "mlp");
  add_onnx_options(command, job->onnx);
  command->add_option("--data", job->data,
                      "fashion-mnist (mlp, cnn) or a text / .tok file (gpt2*, llama*); default: fashion-mnist, or a GPL "
                      "text for gpt2* and llama*. An ONNX model: fashion-mnist (images f32 (B, 1, 28, 28), (B, 28, 28) "
                      "or (B, 784) and labels i64 (B,)), a text (token ids i64 (B, T), then their next tokens), or "
                      "random (random inputs of any shapes); default: the dataset its inputs fit");
  command->add_option("--data-dir", job->data_dir, "Fashion-MNIST directory (default: Debian's dataset-fashion-mnist)");
  command->add_option("--steps", job->steps, "Total training steps")->default_val(3000);
  add_batch_options(command, job->batch, 64, job->seq);  // an ONNX model: the file's batch, unless given
  CLI::Option* batch = command->get_option("--batch");
  add_model_size_options(command, job->sizes);
  add_optimizer_options(command, job->optimizer);
  command->add_option("--grad-clip", job->optimizer.grad_clip, "Clip the global gradient norm to this (0 = off)")
      ->default_val(0.0);
  command->add_option("--warmup", job->optimizer.warmup_steps, "Linear learning-rate warmup steps")->default_val(0);
  command->add_option("--decay-steps", job->optimizer.decay_steps,
                      "Cosine decay to 0.1 x lr by this step (0 = constant lr; -1 = --steps)")
      ->default_val(-1);
  job->optimizer.amp = "auto";
  add_amp_option(command, job->optimizer.amp,
                 "Mixed precision: auto (bf16 on a GPU that has it, sm_80 on; off on the CPU) | off | bf16 | f16 (f16 "
                 "with dynamic loss scaling) | fp8 (bf16 with the linear layers' GEMMs in FP8, per-tensor scales; sm_89 or newer)",
                 /*with_auto=*/true);
  add_fp8_options(command, job->optimizer);
  command->add_option("--seed", job->seed, "Seed for init and data order")->default_val(0);
  job->device = "auto";
  add_device_choice_option(command, job->device,
                           "auto (cuda when the build has it and a GPU is present, else cpu; the first line says "
                           "which and why) | cpu | cuda");
  add_shard_option(command, job->shard);
  command->add_option("--checkpoint-dir", job->checkpoint_dir,
                      "Write DIR/last.safetensors at each evaluation (under kiln launch: DIR/last.rankR-of-N.safetensors, "
                      "each rank its shards)");
  command->add_flag("--consolidate", job->consolidate,
                    "Under kiln launch, also write DIR/consolidated.safetensors: every tensor whole, readable by any "
                    "safetensors reader, and resumable on any number of ranks");
  command->add_flag("--resume", job->resume,
                    "Continue from --checkpoint-dir's newest checkpoint, written by any number of ranks in any --shard "
                    "mode (a group restarted by kiln launch --max-restarts resumes by itself)");
  command->add_option("--init", job->init_from,
                      "Start from the params in this safetensors file, by name (kiln import-hf writes one)");
  command->add_option("--eval-every", job->eval_every, "Evaluate (and checkpoint) every N steps (0 = at the end)")
      ->default_val(500);
  command->add_option("--eval-batches", job->eval_batches,
                      "Batches per evaluation: gpt2* held-out windows (0 = 10); mlp, cnn the first N batches of the "
                      "test set (0 = all of it)")
      ->default_val(0);
  command->add_option("--log-every", job->log_every, "Log line interval when not on a terminal")->default_val(100);
  CLI::Option* metrics = command->add_option("--metrics", job->metrics_path,
                      "Append metrics as JSON lines to FILE (under kiln launch: rank 0's; every rank's loss is the "
                      "group's mean)");
  // Without --metrics there is no FILE to add ranks' files beside: an error, not a silent no-op.
  command->add_flag("--metrics-all-ranks", job->metrics_all_ranks,
                    "Under kiln launch, every other rank R also appends its own metrics to FILE.rank<R>")
      ->needs(metrics);
  add_pass_options(command, job->passes);
  command->callback([job, file, batch] {
    if (!file->empty()) {
      job->model = *file;
      if (batch->count() == 0) job->batch = 0;  // the file's
    }
    if (job->optimizer.decay_steps < 0) job->optimizer.decay_steps = job->steps;
    train::run_training_job(*job);
  });
}

}  // namespace kiln::cli
