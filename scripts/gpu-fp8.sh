#!/usr/bin/env bash
# One call on an FP8 GPU (H100/H200): `--amp fp8` built and checked, then measured against bf16
# and against torch.compile (bf16, and with torchao's float8 training) on the same models.
#   1. build kiln-cli and the GPU tests; run the fp8 and cuBLASLt GPU tests;
#   2. the fp8 products against bf16 at LLaMA-1B's and GPT-2's layers (bench/gpu_gemm_bench fp8;
#      FP8_GEMMS=0 skips), then kiln bench in bf16, fp8 and fp8 on every linear layer, for each of
#      FP8_MODELS ("name:batch:seq", default llama-1b:4:2048);
#   3. PyTorch: bench/torch_float8.py, compile and float8 modes, the same models (torchao from a
#      wheel carried in .carry/wheels; the model files from .carry: ../shared/bench's);
#   4. FP8_LOSS=1: the loss of FP8_LOSS_STEPS (300) steps of kiln train on real text (Python's
#      standard library sources), bf16 and fp8 on every linear layer with each gradient format
#      of FP8_LOSS_GRADS ("e4m3 e5m2"), GPT-2 and llama-160m, compared per 30-step window;
#   5. FP8_PROFILE=1: kiln bench --profile of the first model in fp8 (the per-kernel table).
# FP8_TORCH=0 skips step 3; FP8_TORCH_BENCH=0 its speed runs only (the loss runs stay).
# Prints a short table last.
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 )) s"; }
cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=ON -DKILN_BUILD_TESTS=ON "${onnx_flags[@]}" >"$out/build.log" 2>&1 &&
  cmake --build build-gpu -j16 --target kiln-cli kiln_gpu_tests gpu_gemm_bench >>"$out/build.log" 2>&1
rc=$?; echo "build rc=$rc at $(since)"
[ $rc -ne 0 ] && { grep -E "error|FAILED" "$out/build.log" | head -30; exit 1; }
timeout ${FP8_TEST_T:-240} ./build-gpu/tests/kiln_gpu_tests --gtest_brief=1 --gtest_filter="${FP8_TESTS:-Fp8Gpu*:CublasLt*}" >"$out/gpu_tests.log" 2>&1
echo "gpu tests rc=$? at $(since)"
grep -E "Failure|Expected|Which is|^\[  FAILED|^\[  PASSED|error" "$out/gpu_tests.log" | head -30
if [ "${FP8_GEMMS:-1}" = 1 ]; then
  timeout 120 ./build-gpu/bench/gpu_gemm_bench fp8 2>&1 | tee "$out/gemm-fp8.txt" | grep -v "^ *$"
fi
K=./build-gpu/kiln
: > "$out/rows.txt"
for m in ${FP8_MODELS:-llama-1b:4:2048}; do IFS=: read -r name batch seq <<<"$m"
  for amp in bf16 fp8 "fp8 --fp8-every-linear"; do
    line=$($K bench --model $name --batch $batch --seq $seq --amp $amp --steps ${FP8_STEPS:-25} --json 2>>"$out/bench.err" | tail -1)
    echo "kiln $name B=$batch $amp $(echo "$line" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["ms_per_step"], "ms", r["peak_gib"], "GiB")' 2>&1 | tail -1)" | tee -a "$out/rows.txt"
  done
done
echo "kiln benches at $(since)"; tail -5 "$out/bench.err"
if [ "${FP8_PROFILE:-0}" = 1 ]; then IFS=: read -r name batch seq <<<"${FP8_MODELS%% *}"
  $K bench --model $name --batch $batch --seq $seq --amp fp8 --steps 10 --profile "$out/fp8-profile.json" > "$out/fp8-profile.txt" 2>&1
  grep -v "^ *$" "$out/fp8-profile.txt" | head -45
fi
if [ "${FP8_LOSS:-0}" = 1 ]; then
  # Real text, more of it than .carry/text.txt's 36 KB: the Python standard library's sources
  # (~6 MB), the same corpus for every run.
  corpus=/tmp/corpus.txt
  python3 - "$corpus" <<'EOF2'
import pathlib, sys, sysconfig
out, total = open(sys.argv[1], "w", encoding="utf-8"), 0
for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
    if total > 6_000_000: break
    try: text = p.read_text(encoding="utf-8")
    except Exception: continue
    out.write(text); total += len(text)
EOF2
  ls -la $corpus
  for m in "gpt2 8 1024" "llama-160m 8 1024"; do set -- $m
    for amp in bf16 ${FP8_LOSS_GRADS:-e4m3 e5m2}; do  # bf16, then fp8 with each gradient format
      if [ $amp = bf16 ]; then flags="--amp bf16"; else flags="--amp fp8 --fp8-every-linear --fp8-grad $amp"; fi
      $K train --model $1 --batch $2 --seq $3 --steps ${FP8_LOSS_STEPS:-300} --log-every 100 --eval-every 0 $flags --lr 6e-4 \
        --data $corpus --metrics "$out/loss-$1-$amp.jsonl" > "$out/train-$1-$amp.log" 2>&1 || tail -3 "$out/train-$1-$amp.log"
    done
    for grad in ${FP8_LOSS_GRADS:-e4m3 e5m2}; do
    python3 - "$out/loss-$1-bf16.jsonl" "$out/loss-$1-$grad.jsonl" "$1 fp8 (grad $grad)" <<'EOF' | tee -a "$out/rows.txt"
import json, sys
def losses(p): return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l]
b, f = losses(sys.argv[1]), losses(sys.argv[2])
worst = 0.0
for w in range(0, min(len(b), len(f)) // 30):
    mb, mf = sum(b[30*w:30*w+30]) / 30, sum(f[30*w:30*w+30]) / 30
    worst = max(worst, abs(mf - mb) / mb)
    print(f"loss {sys.argv[3]} steps {30*w+1}-{30*w+30}: bf16 {mb:.4f} fp8 {mf:.4f} ({100*(mf-mb)/mb:+.2f}%)")
print(f"loss {sys.argv[3]}: worst 30-step window {100*worst:.2f}% over {min(len(b), len(f))} steps")
EOF
    done
  done
  echo "loss curves at $(since)"
fi
[ "${FP8_TORCH:-1}" = 0 ] && { echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader)"; cat "$out/rows.txt"; exit 0; }
ao=/tmp/ao; rm -rf $ao
for w in .carry/wheels/torchao-*.whl; do
  pip install --quiet --no-deps --target $ao "$w" >/dev/null 2>&1 &&
    PYTHONPATH=$ao python3 -c "from torchao.float8 import convert_to_float8_training" 2>/dev/null && { echo "torchao: $w"; break; }
  rm -rf $ao
done
runs=""; for m in ${FP8_TORCH_MODELS:-${FP8_MODELS:-llama-1b:4:2048}}; do IFS=: read -r name batch seq <<<"$m"
  runs="$runs $name:compile:$batch:$seq $name:float8:$batch:$seq"; done
: > "$out/torch.jsonl"
[ "${FP8_TORCH_BENCH:-1}" = 1 ] &&
  PYTHONPATH=$ao timeout ${FP8_TORCH_T:-300} python3 bench/torch_float8.py --models .carry $runs > "$out/torch.jsonl" 2>"$out/torch.err"
echo "torch at $(since)"; tail -3 "$out/torch.err"
if [ "${FP8_LOSS:-0}" = 1 ]; then  # torchao's own fp8-vs-bf16 loss gap on the same text (bytes as tokens)
  PYTHONPATH=$ao timeout ${FP8_TORCH_LOSS_T:-300} python3 bench/torch_float8.py --models .carry --data /tmp/corpus.txt \
    --loss-steps ${FP8_LOSS_STEPS:-300} gpt2:compile:8:1024 gpt2:float8:8:1024 llama-160m:compile:8:1024 \
    llama-160m:float8:8:1024 > "$out/torch-loss.jsonl" 2>>"$out/torch.err"
  python3 - "$out/torch-loss.jsonl" <<'EOF' | tee -a "$out/rows.txt"
import json, sys
runs = {(r["cfg"], r["mode"]): r.get("losses") for r in map(json.loads, open(sys.argv[1]))}
for cfg in ("gpt2", "llama-160m"):
    b, f = runs.get((cfg, "compile")), runs.get((cfg, "float8"))
    if not b or not f: print(f"torch loss {cfg}: missing"); continue
    gaps = [(sum(f[i:i+30]) - sum(b[i:i+30])) / sum(b[i:i+30]) for i in range(0, min(len(b), len(f)) - 29, 30)]
    print(f"torch loss {cfg} float8 vs bf16: windows " + " ".join(f"{100*g:+.2f}%" for g in gaps) +
          f"; worst {100*max(map(abs, gaps)):.2f}%")
EOF
fi
python3 - "$out/torch.jsonl" <<'EOF' | tee -a "$out/rows.txt"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"torch {r['cfg']} B={r['B']} {r['mode']}", r.get("ms", r.get("error", "oom")), "ms", r.get("peak_gib", ""), "GiB")
EOF
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader)"; cat "$out/rows.txt"
