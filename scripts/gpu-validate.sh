#!/usr/bin/env bash
# One call on the GPU machine: build everything but the benches (16 cores), then the CPU
# ctest (the Python tests under that machine's torch) beside the GPU suite; carry .carry/onnx-debs
# (bash scripts/gpu-check.sh --fetch-onnx). GPU_T / CPU_T: timeouts (s).
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF -DKILN_BUILD_TESTS=ON "${onnx_flags[@]}" >"$out/build.log" 2>&1 &&
  cmake --build build-gpu -j16 >>"$out/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
[ $rc -ne 0 ] && { grep -E "error|FAILED" "$out/build.log" | head -30; exit 1; }
( timeout ${GPU_T:-330} ./build-gpu/tests/kiln_gpu_tests --gtest_brief=1 >"$out/gpu_tests.log" 2>&1; echo "gpu tests rc=$? at $(( $(date +%s) - t0 )) s" >"$out/gpu_rc" ) &
gpu=$!
OMP_NUM_THREADS=1 timeout ${CPU_T:-330} ctest --test-dir build-gpu -j12 -E "kiln_gpu_tests|debian-torch|frontend/torch_step" --timeout 300 >"$out/ctest.log" 2>&1
echo "ctest rc=$? at $(( $(date +%s) - t0 )) s"
wait $gpu; cat "$out/gpu_rc"
grep -E "tests passed|FAILED|\(Failed\)|\(Timeout\)" "$out/ctest.log" | head -20
grep -E "Failure|^\[  FAILED|^\[  PASSED|ONNX node" "$out/gpu_tests.log" | head -30
grep -E "^(FAILED|ERROR)|passed|failed" build-gpu/Testing/Temporary/LastTest.log 2>/dev/null | grep -E "python" | head -5
