#!/usr/bin/env bash
# Stop 43's last device call, on nvidia-h200-x2 (kept as the record of what ran):
#   GPU 1, in the background: fp8 loss after the fast-accumulation fix (kiln train, GPT-2 and
#     llama-160m, bf16 against fp8 with --fp8-grad e4m3 and e5m2, 300 steps on Python's stdlib
#     sources, as scripts/gpu-fp8.sh FP8_LOSS=1), then llama-1b's bench in bf16 and fp8;
#   GPU 0: scripts/gpu-offload-capture.sh (captured offloaded steps against uncaptured);
#   both GPUs, last: llama-8b (32 layers) zero3 on 2 GPUs, its first step.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out}; mkdir -p "$out"
t0=$(date +%s); since() { echo "$(( $(date +%s) - t0 )) s"; }
frontend=()
[ -f .carry/cudnn_frontend_include/cudnn_frontend.h ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
{ cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" &&
  cmake --build build-gpu -j"$(nproc)" --target kiln-cli kiln_gpu_tests; } >"$out/build.log" 2>&1
rc=$?; echo "build rc=$rc at $(since)"
[ $rc -ne 0 ] && { grep -E "error|FAILED" "$out/build.log" | head -30; exit 1; }
K=./build-gpu/kiln
(
  export CUDA_VISIBLE_DEVICES=1
  corpus=/tmp/corpus.txt
  python3 - "$corpus" <<'PY'
import pathlib, sys, sysconfig
out, total = open(sys.argv[1], "w", encoding="utf-8"), 0
for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
    if total > 6_000_000: break
    try: text = p.read_text(encoding="utf-8")
    except Exception: continue
    out.write(text); total += len(text)
PY
  for m in gpt2 llama-160m; do
    for run in bf16 e4m3 e5m2; do
      if [ $run = bf16 ]; then flags="--amp bf16"; else flags="--amp fp8 --fp8-every-linear --fp8-grad $run"; fi
      timeout 60 $K train --model $m --batch 8 --seq 1024 --steps 300 --log-every 100 --eval-every 0 $flags --lr 6e-4 \
        --data $corpus --metrics "$out/loss-$m-$run.jsonl" > "$out/train-$m-$run.log" 2>&1 || tail -2 "$out/train-$m-$run.log"
    done
    for grad in e4m3 e5m2; do
      python3 - "$out/loss-$m-bf16.jsonl" "$out/loss-$m-$grad.jsonl" "$m fp8 (grad $grad)" <<'PY'
import json, sys
def losses(p): return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l]
b, f = losses(sys.argv[1]), losses(sys.argv[2])
gaps = [(sum(f[i:i+30]) - sum(b[i:i+30])) / sum(b[i:i+30]) for i in range(0, min(len(b), len(f)) - 29, 30)]
print(f"loss {sys.argv[3]} vs bf16: windows " + " ".join(f"{100*g:+.2f}%" for g in gaps) +
      f"; worst {100*max(map(abs, gaps)):.2f}% over {min(len(b), len(f))} steps")
PY
    done
  done
  for amp in bf16 fp8; do
    timeout 90 $K bench --model llama-1b --batch 4 --seq 2048 --amp $amp --steps 20 2>&1 | grep -E "ms/step|fp8:" | sed "s/^/llama-1b $amp: /"
  done
) > "$out/fp8.txt" 2>&1 &
fp8=$!
CUDA_VISIBLE_DEVICES=0 BUDGET=${OFFCAP_BUDGET:-300} OUT="$out/offcap" bash scripts/gpu-offload-capture.sh > "$out/offcap.txt" 2>&1
echo "offload capture done at $(since)"
wait $fp8; echo "fp8 done at $(since)"
timeout 120 $K launch -n 2 -- bench --model llama-8b --layers 32 --seq 2048 --batch 8 --amp bf16 --shard zero3 \
  --steps 3 --untimed-steps 1 > "$out/llama8b.txt" 2>&1
echo "llama-8b done at $(since)"
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
grep -E "ms/step|first step|setup:|kernels prepared" "$out/llama8b.txt" | head -6
cat "$out/fp8.txt"
tail -25 "$out/offcap.txt"
