#!/usr/bin/env bash
# One call on a multi-GPU machine, every visible GPU: LLaMA 8B-class sharded (kiln zero3 against
# PyTorch FSDP2 + per-block torch.compile on the same model, alternating), and checks: an
# offloaded step captured into a CUDA graph equal to one run uncaptured, a restart after a killed
# rank, llama-tiny on N GPUs equal to one (NCCL, every --shard mode), 2 nodes x N/2 GPUs equal to
# one node of N (and torchrun's and Slurm's starts equal to kiln launch's), llama-1b's offloaded step
# time uncaptured and captured. Prints one table last.
# Logs go to $OUT (or ./gpu-out). Run from the repository root:
#
#   bash scripts/gpu-scale.sh [--layers 32] [--per-gpu 4] [--seq 2048] [--rounds 1] [--steps 10]
#                             [--no-torch] [--no-bench] [--no-checks] [--no-offload]
#
# Env LAYERS, PER_GPU, ROUNDS: the same as the flags; BUDGET: seconds for the whole call (540:
# later phases are cut to fit a 10-minute call; the build takes ~150 s of it). The torch side is
# bench/torch_fsdp_llama.py (kiln's zoo llama in PyTorch); NVLink multicast stays off in every
# process.
#
# Memory per GPU, llama-8b at L layers on W GPUs, 4 x 2048 tokens per GPU (bf16 compute, f32
# master weights): N = 218.1M L + 1050.7M params (embedding and untied head 525.3M each).
#   sharded f32 params + f32 grads + AdamW m, v: 16 N / W bytes        L=32, W=2: 64.2 GB
#   activations kept for the backward, ~17 d + 3 ffn bf16 values per token per layer
#     (x, norms' outputs, q, k, v, attention out, w1, w3, silu * w3): 139 kB x 8192 tokens
#     = 1.14 GB a layer (kiln recomputes SwiGLU's product in the backward: ~0.9 GB)    36.5 GB
#   logits 8192 x 128256: bf16 2.1 GB, f32 log-softmax 4.2 GB, its gradient 4.2 GB (FSDP2;
#     kiln's classifier chunks hold a slice of them)                                  ~10 GB
#   gathered bf16 weights: the root group (embedding, head, kept through the step) 2.1 GB,
#     a block 0.44 GB (FSDP2: this one and the prefetched next), its grads before the
#     reduce-scatter (f32: 0.87 GB), the root's unsharded grads at the end               ~5 GB
#   FSDP2 at L=32, W=2: ~116 GB (108 GiB) of an H200's 141 GB; kiln ~105 GB. So the full 32
#   layers are the default on 2 x H200 (on 80 GB GPUs, W=2: --layers 12; W=4: --layers 24).
# The torch runs set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's setting),
# so that its allocator's fragmentation does not decide the comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-gpu-out}"; mkdir -p "$out"
layers=${LAYERS:-32}; per_gpu=${PER_GPU:-4}; seq=2048; rounds=${ROUNDS:-1}; steps=10
torch=1; bench=1; checks=1; offload=1
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) shift; layers="$1" ;;
    --per-gpu) shift; per_gpu="$1" ;;
    --seq) shift; seq="$1" ;;
    --rounds) shift; rounds="$1" ;;
    --steps) shift; steps="$1" ;;
    --no-torch) torch=0 ;;
    --no-bench) bench=0 ;;
    --no-checks) checks=0 ;;
    --no-offload) offload=0 ;;
    *) echo "gpu-scale: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
start=$(date +%s)
budget=${BUDGET:-540}  # seconds for the whole call: a later phase is cut short (or skipped) to fit
elapsed() { echo $(( $(date +%s) - start )); }
# A phase's timeout: its own limit, or what is left of the budget if less (0: skip it).
limit() { local left=$(( budget - $(elapsed) )); [ "$left" -lt 30 ] && { echo 0; return; }; echo $(( left < $1 ? left : $1 )); }
# run_for SECONDS COMMAND...: the command under timeout $(limit SECONDS), or skipped (exit 124).
run_for() { local t; t=$(limit "$1"); shift; [ "$t" = 0 ] && { echo "skipped (budget): $1 $2" >&2; return 124; }; timeout "$t" "$@"; }
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
[ "$gpus" -ge 1 ] || { echo "gpu-scale: no GPU"; exit 1; }

frontend=()
[ -f .carry/cudnn_frontend_include/cudnn_frontend.h ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
targets=(kiln-cli)
[ $offload = 1 ] && targets+=(kiln_gpu_tests)
{ cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" &&
  cmake --build build-gpu -j"$(nproc)" --target "${targets[@]}"; } >"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc in $(elapsed) s"
[ $rc -ne 0 ] && { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
kiln=./build-gpu/kiln

# Offloaded optimizer state: the step captured into a CUDA graph (the default) against
# the same step uncaptured, bit for bit (tests/cuda/train_test.cc; a few seconds, so first).
offload_summary="not run"
if [ $offload = 1 ]; then
  run_for 90 ./build-gpu/tests/kiln_gpu_tests --gtest_filter='CudaTrainer.Offload*' >"$out/offload_test.log" 2>&1
  offload_summary="gpu test: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$out/offload_test.log" | tr '\n' ' ')"
  echo "offload tests at $(elapsed) s: $offload_summary"
  grep -E "Failure|differ|^\[  FAILED" "$out/offload_test.log" | head -10
fi

# (a), (b): kiln zero3 and FSDP2 + compile on the same config, alternating.
: >"$out/scale.jsonl"
sizes=(--model llama-8b --layers "$layers" --seq "$seq")
if [ $bench = 1 ]; then
  for r in $(seq 1 "$rounds"); do
    t=$(limit 240); [ "$t" = 0 ] && { echo "kiln round $r: skipped (budget)"; break; }
    line=$(timeout "$t" $kiln launch -n "$gpus" -- bench "${sizes[@]}" --batch $(( per_gpu * gpus )) --amp bf16 \
             --shard zero3 --steps "$steps" --untimed-steps 3 --json 2>>"$out/kiln.err" | tee -a "$out/kiln.log" | tail -1)
    if [ "${line:0:1}" = "{" ]; then echo "{\"who\": \"kiln zero3\", \"round\": $r, \"r\": $line}" >>"$out/scale.jsonl"
    else echo "kiln zero3 round $r: failed (kiln.err):"; tail -5 "$out/kiln.err"; fi
    echo "kiln round $r done at $(elapsed) s"
    t=$(limit 300)
    if [ $torch = 1 ] && [ "$t" = 0 ]; then echo "torch round $r: skipped (budget)"
    elif [ $torch = 1 ]; then
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$t" torchrun --standalone --nproc_per_node="$gpus" \
        bench/torch_fsdp_llama.py "${sizes[@]}" --batch "$per_gpu" --steps "$steps" --warmup 3 --compile \
        >"$out/torch_$r.log" 2>&1
      line=$(grep '^{' "$out/torch_$r.log" | tail -1)
      if [ "${line:0:1}" = "{" ]; then echo "{\"who\": \"torch FSDP2 + compile\", \"round\": $r, \"r\": $line}" >>"$out/scale.jsonl"
      else echo "torch round $r: failed (torch_$r.log):"; grep -E "Error|error" "$out/torch_$r.log" | tail -5; fi
      echo "torch round $r done at $(elapsed) s"
    fi
  done
fi

# (c), (d): on NCCL, f32 (--amp off, no TF32): the restart (rank 1 killed, the group restarted
# from its checkpoint, against the run never interrupted; KILN_GEMM_CANDIDATES=1: the restarted
# processes keep the GEMM algorithms the uninterrupted one had, so the bits can agree); then
# llama-tiny on every GPU equal to one process in every shard mode.
check_summary="not run"
if [ $checks = 1 ] && [ "$gpus" -lt 2 ]; then
  check_summary="not run: one GPU"
elif [ $checks = 1 ]; then
  run_for 180 env KILN_GEMM_CANDIDATES=1 python3 tests/distributed/train_ranks_test.py --kiln $kiln \
    --device cuda --checks restart --restart-steps 600 --show-log --amp off --tolerance 3e-4 >"$out/restart.log" 2>&1
  # The whole logs are in $out/restart.log; here the launcher's lines and the verdicts.
  echo "== restart (2 GPUs, rank 1 killed) at $(elapsed) s =="
  grep -E "^---- log|kiln launch:|restart 1:|rank 1 was lost|^done:|^(ok|FAIL)|passed|FAILED|SKIP" "$out/restart.log"
  run_for 120 python3 tests/distributed/train_ranks_test.py --kiln $kiln --device cuda --ranks "$gpus" \
    --models llama-tiny --checks match --amp off --tolerance 3e-4 >"$out/match.log" 2>&1
  echo "== llama-tiny, $gpus GPUs against one (NCCL) at $(elapsed) s =="; grep -E "^(ok|FAIL)|passed|FAILED|SKIP" "$out/match.log"
  # 2 nodes of half the GPUs each (kiln launch --nnodes 2 twice on this machine) against one node
  # of all; the same run started by torchrun and as Slurm starts tasks (deterministic GEMMs: the
  # launchers' runs are compared bit for bit).
  run_for 150 env KILN_GEMM_CANDIDATES=1 python3 tests/distributed/train_ranks_test.py --kiln $kiln --device cuda \
    --checks nodes,launchers --per-node $(( gpus / 2 )) --amp off --tolerance 3e-4 >"$out/nodes.log" 2>&1
  echo "== 2 nodes x $(( gpus / 2 )) GPUs, torchrun, srun at $(elapsed) s =="; grep -E "^(ok|FAIL|skip)|passed|FAILED|SKIP" "$out/nodes.log"
  check_summary="restart: $(tail -1 "$out/restart.log"); match: $(tail -1 "$out/match.log"); nodes: $(tail -1 "$out/nodes.log")"
fi

# llama-1b's step with offloaded state, uncaptured and captured: its time both ways.
if [ $offload = 1 ]; then
  : >"$out/offload.jsonl"
  for capture in 0 1; do
    t=$(limit 90); [ "$t" = 0 ] && { echo "offload bench: skipped (budget)"; break; }
    KILN_CAPTURE_OFFLOAD=$capture timeout "$t" $kiln bench --model llama-1b --batch 4 --seq 2048 --amp bf16 --offload all \
      --steps 10 --untimed-steps 4 --json 2>>"$out/offload.err" | tee -a "$out/offload.log" | grep '^{' | tail -1 |
      sed "s/^{/{\"capture\": $capture, /" >>"$out/offload.jsonl"
  done
  grep -E "CUDA graph replays" "$out/offload.log"  # the captured run's replays, the other's none
fi

echo
echo "GPU: $(head -1 "$out/gpu.txt") x $gpus; $(elapsed) s in all"
echo "checks: $check_summary"
echo "offload: $offload_summary"
python3 - "$out" "$gpus" "$layers" "$per_gpu" "$seq" <<'EOF'
import json, os, sys
out, gpus, layers, per_gpu, seq = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
off = [json.loads(l) for l in open(os.path.join(out, "offload.jsonl"))] if os.path.exists(os.path.join(out, "offload.jsonl")) else []
for r in off:
    if "ms_per_step" in r:
        print(f"llama-1b 4 x 2048, --offload all, {'captured (the default)' if r['capture'] else 'uncaptured (KILN_CAPTURE_OFFLOAD=0)'}: "
              f"{r['ms_per_step']:.1f} ms/step, peak {r['peak_gib']:.2f} GiB, {r['host_state_gib']:.2f} GiB of state "
              f"in host memory, loss {r['final_loss']:.4f}")
runs = [json.loads(l) for l in open(os.path.join(out, "scale.jsonl"))]
print(f"llama-8b, {layers} layers (d 4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256), {per_gpu} x {seq} tokens "
      f"per GPU, bf16, {gpus} GPUs")
print(f"{'':30} {'ms/step':>8} {'tok/s':>8} {'tok/s/GPU':>9} {'MFU/GPU':>7} {'peak GiB':>8} {'GPU GiB':>8} {'1st step s':>10}")
print("(peak: kiln's allocator / torch max_memory_allocated, the most of any rank; GPU GiB: kiln cudaMemGetInfo "
      "delta / torch max_memory_reserved; 1st step: seconds from process start, compile included)")
best = {}
for run in runs:
    who, r = run["who"], run["r"]
    name = f"{who} #{run['round']}"
    if r.get("oom"):
        print(f"{name:30} out of memory"); continue
    if who.startswith("kiln"):
        row = (r["ms_per_step"], r["tokens_per_s"], r["mfu"], r["max_peak_gib"], r["used_delta_gib"], r["first_step_s"])
    else:
        row = (r["ms"], r["tok_s"], r["mfu_vs_989"], r["peak_gib"], r["reserved_gib"], r["first_step_s"])
    ms, tps, mfu, peak, used, first = row
    print(f"{name:30} {ms:8.1f} {tps:8.0f} {tps / gpus:9.0f} {mfu:7.3f} {peak:8.2f} {used:8.2f} {first:10.1f}")
    key = "kiln" if who.startswith("kiln") else "torch"
    if key not in best or tps > best[key][1]:
        best[key] = row
if "kiln" in best and "torch" in best:
    k, t = best["kiln"], best["torch"]
    print(f"kiln / FSDP2+compile (best rounds): tokens/s {k[1] / t[1]:.2f}x, peak {k[3] / t[3]:.2f}x, "
          f"first step {k[5]:.1f} vs {t[5]:.1f} s")
EOF
