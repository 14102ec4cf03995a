#!/usr/bin/env bash
# Stop 44's third call on 2 x H200: llama-8b zero3 with the reductions' readers deferred (the new
# default), NCCL's protocol left to NCCL, Simple, or LL128; each run's timeline analysed by
# bench/timeline_overlap.py (exposed communication per collective).
# KILN_OVERLAP_DEFER and KILN_GEMM_SM_CARVEOUT existed only for these measurements: the deferral is
# now always on, and the carveout (slower at 8 and 16 SMs) was removed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-gpu-out}"; mkdir -p "$out"; tmp=$(mktemp -d)
start=$(date +%s); elapsed() { echo $(( $(date +%s) - start )); }
gpus=$(nvidia-smi -L | wc -l)
frontend=()
[ -f .carry/cudnn_frontend_include/cudnn_frontend.h ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
{ cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" &&
  cmake --build build-gpu -j"$(nproc)" --target kiln-cli; } >"$tmp/build.log" 2>&1 || { grep -E "error|FAILED" "$tmp/build.log" | head; exit 1; }
echo "build done at $(elapsed) s"
kiln=./build-gpu/kiln
run() {  # NAME ENV...
  local name=$1; shift
  env "$@" timeout 100 $kiln launch -n "$gpus" -- bench --model llama-8b --batch $(( 4 * gpus )) --seq 2048 --amp bf16 \
    --shard zero3 --steps 10 --untimed-steps 3 --timeline "$tmp/tl-$name.json" --timeline-steps 3 --json \
    >"$tmp/$name.log" 2>"$tmp/$name.err"
  { echo "== $name ($*) at $(elapsed) s"; grep -E 'ms/step|device memory' "$tmp/$name.log"; tail -2 "$tmp/$name.err"
    python3 bench/timeline_overlap.py "$tmp/tl-$name.json" --windows 10; } | tee -a "$out/summary.txt"
}
run defer KILN_OVERLAP_DEFER=1
run simple KILN_OVERLAP_DEFER=1 NCCL_PROTO=Simple
run ll128 KILN_OVERLAP_DEFER=1 NCCL_PROTO=LL128
