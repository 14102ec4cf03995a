#!/usr/bin/env bash
# Stop 44's A/B on 2 x H200: GPT-2 medium dp and zero3 with the overlap pass's deferral of the
# updates on and off (KILN_OVERLAP_DEFER=0 existed only for this call), alternating, in one call;
# llama-tiny on 2 GPUs equal to one (every mode) and llama-8b zero3 on the merged tree (the
# compile-time changes).
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
timeout 100 python3 tests/distributed/train_ranks_test.py --kiln $kiln --device cuda --ranks "$gpus" \
  --models llama-tiny --checks match --amp off --tolerance 3e-4 >"$out/match.log" 2>&1
echo "match at $(elapsed) s"; grep -hE "^(ok|FAIL)|passed|FAILED" "$out/match.log"
g=(--model gpt2-medium --seq 1024 --amp bf16 --steps 30 --untimed-steps 3)
ms() { grep -E "^  ms/step" | awk '{print $2}'; }
echo "gpt2-medium 1 GPU: $(timeout 60 $kiln bench "${g[@]}" --batch 16 2>/dev/null | ms) ms"
for round in 1 2; do
  for defer in 0 1; do
    echo "round $round dp defer=$defer: $(KILN_OVERLAP_DEFER=$defer timeout 60 $kiln launch -n "$gpus" -- bench "${g[@]}" --batch $(( 16 * gpus )) --shard dp 2>/dev/null | ms) ms"
  done
done
for defer in 0 1; do
  echo "zero3 defer=$defer: $(KILN_OVERLAP_DEFER=$defer timeout 60 $kiln launch -n "$gpus" -- bench "${g[@]}" --batch $(( 16 * gpus )) --shard zero3 2>/dev/null | ms) ms"
done
timeout 90 $kiln launch -n "$gpus" -- bench --model llama-8b --batch $(( 4 * gpus )) --seq 2048 --amp bf16 --shard zero3 \
  --steps 10 --untimed-steps 3 2>&1 | grep -E "ms/step|device memory|first step|setup:" 
echo "done at $(elapsed) s"
