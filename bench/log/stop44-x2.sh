#!/usr/bin/env bash
# Stop 44's first call on 2 x H200: the multi-node launch on GPUs (2 nodes x 1 process against 2
# processes of one node, NCCL), torchrun and Slurm-style starts on GPUs, GPT-2 medium's scaling
# from 1 to 2 GPUs, and llama-8b zero3's timeline (where the step's time goes on rank 0).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-gpu-out}"; mkdir -p "$out"
start=$(date +%s); elapsed() { echo $(( $(date +%s) - start )); }
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
frontend=()
[ -f .carry/cudnn_frontend_include/cudnn_frontend.h ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
{ cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" &&
  cmake --build build-gpu -j"$(nproc)" --target kiln-cli; } >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head; exit 1; }
echo "build done at $(elapsed) s"
kiln=./build-gpu/kiln
KILN_GEMM_CANDIDATES=1 timeout 200 python3 tests/distributed/train_ranks_test.py --kiln $kiln --device cuda \
  --checks nodes,launchers --per-node $(( gpus / 2 )) --amp off --tolerance 3e-4 >"$out/nodes.log" 2>&1
echo "== nodes, launchers at $(elapsed) s =="; grep -E "^(ok|FAIL|skip)|passed|FAILED" "$out/nodes.log"
: >"$out/scaling.jsonl"
timeout 120 $kiln bench --model gpt2-medium --batch 16 --seq 1024 --amp bf16 --steps 20 --untimed-steps 3 --json \
  2>>"$out/bench.err" | tee -a "$out/scaling.log" | grep '^{' | tail -1 >>"$out/scaling.jsonl"
for mode in dp zero1; do
  timeout 120 $kiln launch -n "$gpus" -- bench --model gpt2-medium --batch $(( 16 * gpus )) --seq 1024 --amp bf16 \
    --shard $mode --steps 20 --untimed-steps 3 --json 2>>"$out/bench.err" | tee -a "$out/scaling.log" | grep '^{' | tail -1 >>"$out/scaling.jsonl"
done
echo "scaling at $(elapsed) s"
timeout 200 $kiln launch -n "$gpus" -- bench --model llama-8b --batch $(( 4 * gpus )) --seq 2048 --amp bf16 --shard zero3 \
  --steps 8 --untimed-steps 3 --timeline "$out/llama8b-timeline.json" --timeline-steps 3 >"$out/llama8b.log" 2>"$out/llama8b.err"
echo "llama-8b timeline at $(elapsed) s (rc $?)"
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = [json.loads(l) for l in open(os.path.join(out, "scaling.jsonl")) if l.startswith("{")]
base = next((r for r in runs if r.get("world_size", 1) == 1), None)
print("gpt2-medium, 16 x 1024 tokens per GPU, bf16")
for r in runs:
    n = r.get("world_size", 1)
    x = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    print(f"  {n} GPU {r.get('shard', '') if n > 1 else '':6} {r['ms_per_step']:8.1f} ms {r['tokens_per_s']:9.0f} tok/s "
          f"{x:5.2f}x one GPU ({x / n:.3f} a GPU)")
PY
echo "== llama-8b zero3 timeline (rank 0) =="; sed -n '/timeline/,$p' "$out/llama8b.log" | head -120
tail -5 "$out/llama8b.err"
