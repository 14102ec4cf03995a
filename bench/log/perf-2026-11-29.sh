#!/usr/bin/env bash
# One H200 call: main before this session (.carry/base) against main now on GPT-2 B=32 and
# llama-1b B=4 (issue 36's must-not-regress), torch.compile on both (issue 37's ratios), and
# kiln train's steady state against kiln bench at the same batch (issue 37 item 1).
set -uo pipefail
source scripts/gpu-env.sh
t0=$(date +%s)
build() { cmake -S "$1" -B "$2" -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF -DKILN_BUILD_TESTS=OFF "${onnx_flags[@]}" >"$out/$3.log" 2>&1 &&
  cmake --build "$2" -j16 --target kiln-cli >>"$out/$3.log" 2>&1; }
build . build-gpu new || { grep -E "error|FAILED" "$out/new.log" | head -20; exit 1; }
echo "new built at $(( $(date +%s) - t0 )) s"
build .carry/base build-base base || { grep -E "error|FAILED" "$out/base.log" | head -20; exit 1; }
echo "base built at $(( $(date +%s) - t0 )) s"
: > "$out/rows.txt"
for m in "gpt2 32 1024" "llama-1b 4 2048"; do set -- $m
  for who in base new base new; do
    bin=./build-gpu/kiln; [ $who = base ] && bin=./build-base/kiln
    line=$($bin bench --model $1 --batch $2 --seq $3 --amp bf16 --steps 25 --json 2>>"$out/bench.err" | tail -1)
    echo "$1 $who $(echo "$line" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["ms_per_step"], r["peak_gib"])' 2>&1)" | tee -a "$out/rows.txt"
  done
done
echo "benches at $(( $(date +%s) - t0 )) s"
K=./build-gpu/kiln
for m in "gpt2 16 1024 400 50" "llama-1b 4 2048 150 25"; do set -- $m
  $K bench --model $1 --batch $2 --seq $3 --amp bf16 --steps 100 --json 2>/dev/null | tail -1 | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('$1 bench B=$2', r['ms_per_step'], 'ms/step')"
  $K train --model $1 --batch $2 --seq $3 --steps $4 --log-every $5 --eval-every 0 --data .carry/text.txt > "$out/train-$1.log" 2>&1
  grep "wall time" "$out/train-$1.log"
done
echo "train at $(( $(date +%s) - t0 )) s"
timeout 200 python3 .carry/torch_gpt2.py gpt2:compile:32 > "$out/torch.jsonl" 2>"$out/torch.err"
timeout 150 python3 .carry/torch_llama.py llama-1b:compile:4:2048 >> "$out/torch.jsonl" 2>>"$out/torch.err"
echo "torch at $(( $(date +%s) - t0 )) s"; cat "$out/torch.jsonl" | cut -c1-400
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader)"; cat "$out/rows.txt"
