#!/usr/bin/env bash
# Stop 44's last call on 2 x H200, on the merged tree: llama-tiny on 2 GPUs equal to one (every
# shard mode, NCCL), 2 nodes x 1 GPU and the torchrun / Slurm starts; GPT-2 medium's scaling
# from 1 to 2 GPUs; llama-8b zero3 against FSDP2 + compile (alternating, one round each);
# kiln train's start on llama-8b zero3 (params drawn beside the compile). Table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-gpu-out}"; mkdir -p "$out"; tmp=$(mktemp -d)
start=$(date +%s); elapsed() { echo $(( $(date +%s) - start )); }
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | tee "$out/gpu.txt"
frontend=()
[ -f .carry/cudnn_frontend_include/cudnn_frontend.h ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
{ cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" &&
  cmake --build build-gpu -j"$(nproc)" --target kiln-cli; } >"$tmp/build.log" 2>&1 || { grep -E "error|FAILED" "$tmp/build.log" | head; exit 1; }
echo "build done at $(elapsed) s"
kiln=./build-gpu/kiln
timeout 150 python3 tests/distributed/train_ranks_test.py --kiln $kiln --device cuda --ranks "$gpus" \
  --models llama-tiny --checks match --amp off --tolerance 3e-4 >"$out/match.log" 2>&1
KILN_GEMM_CANDIDATES=1 timeout 150 python3 tests/distributed/train_ranks_test.py --kiln $kiln --device cuda \
  --checks nodes,launchers --per-node $(( gpus / 2 )) --amp off --tolerance 3e-4 >"$out/nodes.log" 2>&1
echo "checks at $(elapsed) s"; grep -hE "^(ok|FAIL|skip)|passed|FAILED" "$out/match.log" "$out/nodes.log"
: >"$out/runs.jsonl"
bench() {  # NAME ARGS... (kiln bench under kiln launch when ARGS start with launch)
  local name=$1; shift
  line=$(timeout 150 "$@" --json 2>>"$tmp/$name.err" | tee "$tmp/$name.log" | grep '^{' | tail -1)
  [ "${line:0:1}" = "{" ] && echo "{\"name\": \"$name\", \"r\": $line}" >>"$out/runs.jsonl" || { echo "$name failed"; tail -3 "$tmp/$name.err"; }
}
g=(--model gpt2-medium --seq 1024 --amp bf16 --steps 20 --untimed-steps 3)
bench "gpt2-medium 1 GPU" $kiln bench "${g[@]}" --batch 16
for mode in dp zero3; do bench "gpt2-medium $gpus GPUs $mode" $kiln launch -n "$gpus" -- bench "${g[@]}" --batch $(( 16 * gpus )) --shard $mode; done
echo "gpt2-medium at $(elapsed) s"
bench "llama-8b kiln zero3" $kiln launch -n "$gpus" -- bench --model llama-8b --batch $(( 4 * gpus )) --seq 2048 --amp bf16 \
  --shard zero3 --steps 10 --untimed-steps 3
echo "llama-8b kiln at $(elapsed) s"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 torchrun --standalone --nproc_per_node="$gpus" \
  bench/torch_fsdp_llama.py --model llama-8b --seq 2048 --batch 4 --steps 10 --warmup 3 --compile >"$tmp/torch.log" 2>&1
grep '^{' "$tmp/torch.log" | tail -1 | sed 's/^/{"name": "llama-8b torch FSDP2 + compile", "r": /; s/$/}/' >>"$out/runs.jsonl"
echo "llama-8b torch at $(elapsed) s"
# kiln train's start: the first step's line and the startup phases (3 steps, llama-8b zero3).
timeout 120 $kiln launch -n "$gpus" -- train --model llama-8b --batch $(( 4 * gpus )) --seq 2048 --amp bf16 --shard zero3 \
  --steps 3 --log-every 1 --eval-every 0 --eval-batches 1 --data .carry/text.txt >"$tmp/train.log" 2>&1; echo "kiln train rc $? at $(elapsed) s"
grep -iE "step +1/|first step|params|compil|s after" "$tmp/train.log" | head -8 | tee "$out/train.txt"
python3 - "$out" "$gpus" <<'PY'
import json, os, sys
out, gpus = sys.argv[1], int(sys.argv[2])
runs = {}
for l in open(os.path.join(out, "runs.jsonl")):
    if l.startswith("{"):
        d = json.loads(l); runs[d["name"]] = d["r"]
print(f"GPU: {open(os.path.join(out, 'gpu.txt')).read().strip()} x {gpus}")
one = runs.get("gpt2-medium 1 GPU")
for name, r in runs.items():
    if name.startswith("gpt2"):
        x = r["tokens_per_s"] / one["tokens_per_s"] if one else float("nan")
        print(f"{name:28} {r['ms_per_step']:8.1f} ms {r['tokens_per_s']:9.0f} tok/s {x:5.2f}x one GPU, peak {r.get('max_peak_gib', r['peak_gib']):.2f} GiB")
k, t = runs.get("llama-8b kiln zero3"), runs.get("llama-8b torch FSDP2 + compile")
if k: print(f"llama-8b kiln zero3           {k['ms_per_step']:8.1f} ms {k['tokens_per_s']:9.0f} tok/s MFU {k['mfu']:.3f} peak {k['max_peak_gib']:.2f} GiB used {k['used_delta_gib']:.2f} first step {k['first_step_s']:.1f} s")
if t: print(f"llama-8b FSDP2 + compile      {t['ms']:8.1f} ms {t['tok_s']:9.0f} tok/s MFU {t['mfu_vs_989']:.3f} peak {t['peak_gib']:.2f} GiB reserved {t['reserved_gib']:.2f} first step {t['first_step_s']:.1f} s")
if k and t: print(f"kiln / FSDP2 + compile: tokens/s {k['tokens_per_s'] / t['tok_s']:.3f}x, peak {k['max_peak_gib'] / t['peak_gib']:.2f}x")
PY
