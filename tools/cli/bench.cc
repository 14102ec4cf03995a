// `kiln bench`: training steps of a model on random data, timed (train/bench.h run_benchmark).
#include "options.h"
#include "train/bench.h"

namespace kiln::cli {

void add_bench_command(CLI::App& app) {
  CLI::App* command =
      app.add_subcommand("bench", "Time training steps of a model on random data: ms/step, tokens/s, MFU, memory");
  auto o = std::make_shared<train::BenchOptions>();
  auto peak_tflops = std::make_shared<double>(0);
  auto file = std::make_shared<std::string>();
  command->add_option("MODEL", *file, "An ONNX model (.onnx) to benchmark instead of --model (random inputs)");
  add_model_option(command, o->model, "gpt2");
  add_onnx_options(command, o->onnx);
  add_batch_options(command, o->batch, 32, o->seq);
  add_shard_option(command, o->shard);
  add_model_size_options(command, o->sizes);
  add_optimizer_options(command, o->optimizer);
  add_amp_option(command, o->amp, "Mixed precision: off | bf16 | f16 | fp8 (bf16, linear layers in FP8) | auto (bf16 where the device has it)",
                 /*with_auto=*/true);
  add_fp8_options(command, o->optimizer);
  add_device_choice_option(command, o->device, "cuda | cpu | auto (cuda when present, else cpu)");
  command->add_option("--steps", o->steps, "Timed steps")->default_val(20);
  command->add_option("--untimed-steps", o->untimed_steps,
                      "Untimed steps first (on cuda the first three run, tune GEMMs and capture the step)")
      ->default_val(5);
  command->add_option("--peak-tflops", *peak_tflops,
                      "The device's peak TFLOP/s for MFU (default: known GPUs' dense bf16/tf32 peak)");
  command->add_flag(
      "--no-gemm-tuning", [o](int64_t) { o->tune_gemms = false; },
      "Keep cuBLASLt's first-choice algorithms (by default the second step times the candidates of every product and "
      "keeps the fastest)");
  command->add_flag(
      "--no-cuda-graphs", [o](int64_t) { o->cuda_graphs = false; },
      "Launch every kernel each step instead of replaying a captured CUDA graph");
  command->add_flag("--json", o->json, "Also print the numbers as one JSON line, last");
  add_pass_options(command, o->passes);
  command->add_option("--profile", o->profile_path,
                      "After the timed steps, profile one step (CUDA events around every kernel): print a per-kernel "
                      "table and write a Chrome trace-event JSON to this file");
  command->add_option("--timeline", o->timeline_path,
                      "After the timed steps, trace graph-replayed steps as the GPU ran them (CUPTI): print each "
                      "step's span, busy and idle time, its largest gaps and a per-node table, and write a Chrome "
                      "trace-event JSON of them to this file (under kiln launch: rank 0's, its communication "
                      "stream's kernels beside the compute)");
  command->add_option("--timeline-steps", o->timeline_steps, "Steps --timeline traces (default 10)");
  command->callback([o, peak_tflops, file] {
    o->peak_flops = *peak_tflops * 1e12;
    if (!file->empty()) o->model = *file;
    train::run_benchmark(*o);
  });
}

}  // namespace kiln::cli
