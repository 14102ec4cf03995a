#!/usr/bin/env bash
# Stop 44's second call on 2 x H200: llama-8b zero3 with the reductions' readers deferred past
# their waits (KILN_OVERLAP_DEFER), with and without SMs left to NCCL (KILN_GEMM_SM_CARVEOUT and
# NCCL_MAX_CTAS), each with a 2-step timeline, against FSDP2 + compile in the same call.
# KILN_OVERLAP_DEFER and KILN_GEMM_SM_CARVEOUT existed only for these measurements: the deferral is
# now always on, and the carveout (slower at 8 and 16 SMs) was removed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-gpu-out}"; mkdir -p "$out"
start=$(date +%s); elapsed() { echo $(( $(date +%s) - start )); }
gpus=$(nvidia-smi -L | wc -l)
frontend=()
[ -f .carry/cudnn_frontend_include/cudnn_frontend.h ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
{ cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" &&
  cmake --build build-gpu -j"$(nproc)" --target kiln-cli; } >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head; exit 1; }
echo "build done at $(elapsed) s"
kiln=./build-gpu/kiln
: >"$out/runs.jsonl"
run() {  # NAME ENV...
  local name=$1; shift
  line=$(env "$@" timeout 100 $kiln launch -n "$gpus" -- bench --model llama-8b --batch $(( 4 * gpus )) --seq 2048 --amp bf16 \
    --shard zero3 --steps 10 --untimed-steps 3 --timeline "$out/tl-$name.json" --timeline-steps 2 --json \
    2>"$out/$name.err" | tee "$out/$name.log" | grep '^{' | tail -1)
  [ "${line:0:1}" = "{" ] && echo "{\"name\": \"$name\", \"r\": $line}" >>"$out/runs.jsonl" || { echo "$name failed"; tail -3 "$out/$name.err"; }
  echo "$name at $(elapsed) s: $(grep -E 'ms/step|device memory' "$out/$name.log" | tr -s ' ' | tr '\n' ' ')"
}
run base KILN_OVERLAP_DEFER=0
run defer KILN_OVERLAP_DEFER=1
run defer-sm8 KILN_OVERLAP_DEFER=1 KILN_GEMM_SM_CARVEOUT=8 NCCL_MAX_CTAS=8
run defer-sm16 KILN_OVERLAP_DEFER=1 KILN_GEMM_SM_CARVEOUT=16 NCCL_MAX_CTAS=16
run base-sm16 KILN_OVERLAP_DEFER=0 KILN_GEMM_SM_CARVEOUT=16 NCCL_MAX_CTAS=16
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 torchrun --standalone --nproc_per_node="$gpus" \
  bench/torch_fsdp_llama.py --model llama-8b --seq 2048 --batch 4 --steps 10 --warmup 3 --compile >"$out/torch.log" 2>&1
echo "torch at $(elapsed) s: $(grep '^{' "$out/torch.log" | tail -1)"
