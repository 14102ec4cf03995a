#!/usr/bin/env bash
# Final call: main before this session (51cfb56, .carry/base) against merged main now, GPT-2 B=32
# and llama-1b B=4 bf16 (issue 36's must-not-regress), alternating; then the GPU suite.
set -uo pipefail
source scripts/gpu-env.sh
t0=$(date +%s); since() { echo "$(( $(date +%s) - t0 )) s"; }
cfg() { cmake -S "$1" -B "$2" -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF -DKILN_BUILD_TESTS=$3 "${onnx_flags[@]}" >"$out/$4.log" 2>&1; }
( cfg .carry/base build-base OFF base && cmake --build build-base -j8 --target kiln-cli >>"$out/base.log" 2>&1; echo "base rc=$?" ) &
cfg . build-gpu ON new && cmake --build build-gpu -j12 --target kiln-cli kiln_gpu_tests >>"$out/new.log" 2>&1; echo "new rc=$? at $(since)"
wait; echo "both built at $(since)"
grep -E "error|FAILED" "$out/new.log" | head -10
: > "$out/rows.txt"
for m in "gpt2 32 1024" "llama-1b 4 2048"; do set -- $m
  for who in base new base new; do
    bin=./build-gpu/kiln; [ $who = base ] && bin=./build-base/kiln
    line=$($bin bench --model $1 --batch $2 --seq $3 --amp bf16 --steps 25 --json 2>>"$out/bench.err" | tail -1)
    echo "$1 $who $(echo "$line" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["ms_per_step"], r["peak_gib"])' 2>&1 | tail -1)" | tee -a "$out/rows.txt"
  done
done
echo "benches at $(since)"
timeout ${GPU_T:-200} ./build-gpu/tests/kiln_gpu_tests --gtest_brief=1 --gtest_filter="${GPU_FILTER:--CudaOnnxConformance.*}" >"$out/gpu_tests.log" 2>&1; echo "gpu tests rc=$? at $(since)"
grep -E "^\[  FAILED|^\[  PASSED|tests ran" "$out/gpu_tests.log" | head -20
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader)"; cat "$out/rows.txt"
