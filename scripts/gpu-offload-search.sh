#!/usr/bin/env bash
# Issue 22's offload target on a multi-GPU machine: the largest GPT that trains on every GPU of
# the machine without offloading, against the largest with `--offload auto`. The model is GPT-2
# XL's architecture at width 4096 (32 heads), 1 x 1024 tokens per GPU, bf16, zero3, the number of
# layers what varies (~201M params a layer). Each run is `kiln launch -- bench` with a few steps;
# a run that does not fit ends with kiln's out-of-memory error, shown in the table.
#
#   bash scripts/gpu-offload-search.sh [--kiln build-gpu/kiln] --off "88 96" --auto "136 144" [--steps 2]
#
# Pick the layer counts from the memory plan first (no GPU needed):
#   kiln compile --model gpt2-xl --d-model 4096 --heads 32 --layers L --batch 1 --seq 1024 \
#     --shard zero3 --world-size 4 --device cuda --amp bf16 --offload off|all --report
# Logs go to $OUT (or ./gpu-out). NVLink multicast stays off in every process.
set -u
kiln=./build-gpu/kiln off_layers="" auto_layers="" steps=2
while [ $# -gt 0 ]; do
  case "$1" in
    --kiln) shift; kiln="$1" ;;
    --off) shift; off_layers="$1" ;;
    --auto) shift; auto_layers="$1" ;;
    --steps) shift; steps="$1" ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
export NCCL_NVLS_ENABLE=0
out=${OUT:-./gpu-out}
mkdir -p "$out"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
: >"$out/offload.jsonl"
run() {  # layers, offload mode
  local log="$out/offload_$2_$1.log" start=$(date +%s)
  $kiln launch -n "$gpus" -- bench --model gpt2-xl --d-model 4096 --heads 32 --layers "$1" --batch "$gpus" --seq 1024 \
    --amp bf16 --shard zero3 --offload "$2" --steps "$steps" --untimed-steps 1 --json >"$log" 2>&1
  local line=$(grep '^{' "$log" | tail -1)
  if [ -n "$line" ]; then
    echo "$line" | python3 -c "import json,sys; r=json.load(sys.stdin); r.update(layers=$1, offload='$2', wall_s=$(( $(date +%s) - start ))); print(json.dumps(r))" >>"$out/offload.jsonl"
  else
    local why=$(grep -iE "out of memory|error" "$log" | head -1 | cut -c1-160)
    python3 -c "import json,sys; print(json.dumps(dict(layers=$1, offload='$2', failed=sys.argv[1], wall_s=$(( $(date +%s) - start )))))" \
      "${why:-no result (see $log)}" >>"$out/offload.jsonl"
  fi
  tail -1 "$out/offload.jsonl"
}
for l in $off_layers; do run "$l" off; done
for l in $auto_layers; do run "$l" auto; done
echo
echo "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) x $gpus"
python3 - "$out/offload.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("zero3, width 4096, 1 x 1024 tokens per GPU, bf16")
print(f"{'layers':>6} {'params':>8} {'offload':>8} {'ms/step':>9} {'tok/s':>8} {'peak GiB/GPU':>12} {'host GiB/rank':>13} {'1st step s':>10}  result")
fits = {}
for r in rows:
    params = r.get("params", r["layers"] * 12 * 4096 * 4096 + 50257 * 4096 + 1024 * 4096)
    if "failed" in r:
        print(f"{r['layers']:>6} {params / 1e9:7.2f}B {r['offload']:>8} {'':>9} {'':>8} {'':>12} {'':>13} {'':>10}  {r['failed']}")
        continue
    fits.setdefault(r["offload"], []).append(params)
    print(f"{r['layers']:>6} {params / 1e9:7.2f}B {r['offload']:>8} {r['ms_per_step']:9.1f} {r['tokens_per_s']:8.0f} "
          f"{r['max_peak_gib']:12.2f} {r.get('host_state_gib', 0):13.2f} {r['first_step_s']:10.1f}  trained")
if fits.get("off") and fits.get("auto"):
    print(f"largest trained with --offload auto / without: {max(fits['auto']) / max(fits['off']):.2f}x the params")
EOF
