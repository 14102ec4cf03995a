#!/usr/bin/env bash
# Issue 37 item 2 on one GPU: the GPU tests of the update stream, then kiln bench with the
# updates beside the backward (default) and after it (--disable-pass overlap-updates),
# alternating, and one timeline of llama-1b.
set -uo pipefail
source scripts/gpu-env.sh
t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF -DKILN_BUILD_TESTS=ON "${onnx_flags[@]}" >"$out/build.log" 2>&1 &&
  cmake --build build-gpu -j16 --target kiln-cli kiln_gpu_tests >>"$out/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - t0 )) s"; [ $rc -ne 0 ] && { grep -E "error|FAILED" "$out/build.log" | head -30; exit 1; }
grep -i "cudnn" "$out/build.log" | head -3
./build-gpu/tests/kiln_gpu_tests --gtest_brief=1 --gtest_filter="${GPU_TESTS:-CudaTrainer.*:CudaExecutor*:CudaMultiTensor*:*Replay*}" >"$out/gpu_tests.log" 2>&1
echo "gpu tests rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "Failure|FAILED|PASSED|Expected|Which is|differ" "$out/gpu_tests.log" | head -30
K=./build-gpu/kiln
: > "$out/rows.txt"
for r in 1 2; do
  for m in "gpt2 32 1024" "llama-1b 4 2048" "llama-160m 16 2048"; do set -- $m
    for mode in on off; do
      flag=""; [ $mode = off ] && flag="--disable-pass overlap-updates"
      line=$($K bench --model $1 --batch $2 --seq $3 --amp bf16 --steps 30 $flag --json 2>>"$out/bench.err" | tail -1)
      echo "$1 $mode $(echo "$line" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["ms_per_step"], r["peak_gib"])' 2>&1)" | tee -a "$out/rows.txt"
    done
  done
done
$K bench --model llama-1b --batch 4 --seq 2048 --amp bf16 --steps 10 --timeline "$out/tl-l1b.json" > "$out/tl-l1b.log" 2>&1
grep -E "overlap-updates|step span|busy|idle|between" "$out/tl-l1b.log" | head
grep -A14 "^kernel time" "$out/tl-l1b.log" | head -16
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader)"
python3 - "$out/rows.txt" <<'PY'
import sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p = line.split()
    try: rows[(p[0], p[1])].append((float(p[2]), float(p[3])))
    except Exception: print("bad row:", line.strip())
print(f"{'model':12} {'beside ms':>10} {'after ms':>10} {'gain':>7} {'peak GiB beside/after':>22}")
for m in ("gpt2", "llama-1b", "llama-160m"):
    on, off = rows.get((m, "on")), rows.get((m, "off"))
    if not on or not off: continue
    a = min(x[0] for x in on); b = min(x[0] for x in off)
    print(f"{m:12} {a:10.2f} {b:10.2f} {100*(b-a)/b:6.2f}% {on[0][1]:10.2f} / {off[0][1]:.2f}")
PY
