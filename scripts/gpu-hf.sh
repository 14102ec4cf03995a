#!/usr/bin/env bash
# One call on the GPU machine: build kiln-cli and the Python module, time kiln's zoo GPT-2 and
# llama-160m (kiln bench), the Hugging Face modules of torch_hf.py through kiln.compile
# (bench/kiln_hf.py: ms/step, peak, the compile report to $OUT/dump, and with PROF=N the N
# kernels with most time), and with TORCH="NAME:MODE:B:T ..." torch_hf.py's runs of the same
# modules, all in one table's worth of JSON lines ($OUT/rows.jsonl, printed last).
#   cp ../shared/bench/torch_hf.py .carry/; bash scripts/gpu-check.sh --fetch-onnx (once), then
#   device: PROF=0 TORCH="hf-gpt2:compile:8:1024 ..." bash scripts/gpu-hf.sh   (carry .carry)
# Environment: HF (the kiln runs, default the three modules), ZOO=0 (skip the zoo models),
# GPU_TESTS=FILTER (build and run those GPU tests first), KILN_T / TORCH_T (timeouts, s).
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
t0=$(date +%s)
tests_flag=OFF; [ -n "${GPU_TESTS:-}" ] && tests_flag=ON
cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF -DKILN_BUILD_TESTS=$tests_flag "${onnx_flags[@]}" >"$out/build.log" 2>&1 &&
  cmake --build build-gpu -j16 --target kiln-cli _kiln ${GPU_TESTS:+kiln_gpu_tests} >>"$out/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
[ $rc -ne 0 ] && { grep -E "error|FAILED" "$out/build.log" | head -30; tail -5 "$out/build.log"; exit 1; }
mkdir -p "$out/dump"
if [ -n "${GPU_TESTS:-}" ]; then
  ./build-gpu/tests/kiln_gpu_tests --gtest_brief=1 --gtest_filter="$GPU_TESTS" >"$out/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "Failure|^\[  FAILED|^\[  PASSED" "$out/gpu_tests.log" | head -20
fi
: > "$out/rows.jsonl"
if [ "${ZOO:-1}" = 1 ]; then
  for b in "gpt2 8 1024" "llama-160m 8 2048"; do set -- $b
    ./build-gpu/kiln bench --model $1 --batch $2 --seq $3 --amp bf16 --device cuda --json ${ZOO_PROFILE:+--profile /tmp/$1.trace.json} \
      >"$out/zoo-$1.log" 2>&1; tail -1 "$out/zoo-$1.log" >> "$out/rows.jsonl"
  done
fi
PYTHONPATH=$PWD/build-gpu/python timeout ${KILN_T:-300} python3 bench/kiln_hf.py --torch-hf .carry/torch_hf.py --profile ${PROF:-25} \
  --dump "$out/dump" ${HF:-hf-gpt2:8:1024 hf-llama-160m:8:2048 hf-bert-base:16:512} >>"$out/rows.jsonl" 2>"$out/kiln_hf.err"
echo "kiln_hf rc=$? at $(( $(date +%s) - t0 )) s"
if [ -n "${TORCH:-}" ]; then
  timeout ${TORCH_T:-300} python3 .carry/torch_hf.py $TORCH >>"$out/rows.jsonl" 2>"$out/torch.err"
  echo "torch rc=$? at $(( $(date +%s) - t0 )) s"
fi
grep -A30 "^profile" "$out"/zoo-*.log | head -80
grep -B2 -A32 "== hf" "$out/kiln_hf.err" | cut -c1-200 | head -120
tail -5 "$out/kiln_hf.err"
echo "== rows"; cat "$out/rows.jsonl"
