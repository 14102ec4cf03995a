#!/usr/bin/env bash
# One call on a multi-GPU machine: build with CUDA and NCCL, check that kiln trains the same on
# N GPUs as on one (every --shard mode, NCCL), that a killed rank ends the job, then benchmark
# the shard modes against PyTorch FSDP2 and print a table last. Logs go to $OUT (or ./gpu-out).
#
#   bash scripts/gpu-dist-check.sh [--no-tests] [--no-check] [--no-bench] [--ranks "2 4"]
#                                  [--model gpt2-xl] [--per-gpu 8] [--modes "dp zero1 zero2 zero3"]
#                                  [--no-torch] [--steps 10] [--scaling gpt2-medium]
#
# --scaling MODEL: also kiln alone on one GPU and on every GPU (16 x 1024 tokens per GPU, each
# --modes mode): the scaling table.
#
# FSDP2's reference is ../shared/bench/torch_fsdp_gpt2.py: copy it to .carry/ (only the
# repository travels) and carry .carry along. NVLink multicast stays off in every process.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-gpu-out}"; mkdir -p "$out"
tests=1; check=1; torch=1; bench=1; ranks_list="2 4"; model=gpt2-xl; per_gpu=8; modes="dp zero1 zero2 zero3"; steps=10
single_model=gpt2-medium; scaling=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-tests) tests=0 ;;
    --no-check) check=0 ;;
    --no-torch) torch=0 ;;
    --no-bench) bench=0 ;;
    --ranks) shift; ranks_list="$1" ;;
    --model) shift; model="$1" ;;
    --per-gpu) shift; per_gpu="$1" ;;
    --modes) shift; modes="$1" ;;
    --steps) shift; steps="$1" ;;
    --scaling) shift; scaling="$1" ;;
    *) echo "gpu-dist-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s)
frontend=()
[ -d .carry/cudnn_frontend_include ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
targets=(kiln-cli)
[ $tests = 1 ] && targets+=(kiln_gpu_tests)
{ cmake -S . -B build-gpu -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" &&
  cmake --build build-gpu -j32 --target "${targets[@]}"; } >"$out/build.log" 2>&1
rc=$?
echo "build: rc=$rc in $(( $(date +%s) - start )) s; $(grep -E 'kiln: (NCCL|Gloo)' "$out/build.log" | tr '\n' ' ')"
[ $rc -ne 0 ] && { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
kiln=./build-gpu/kiln

test_summary="not run"
if [ $tests = 1 ]; then
  ./build-gpu/tests/kiln_gpu_tests --gtest_brief=1 >"$out/gpu_tests.log" 2>&1
  test_summary=$(grep -E "^\[  (PASSED|FAILED)|tests? ran" "$out/gpu_tests.log" | tr '\n' ' ')
  grep -E "^\[  FAILED|Failure" "$out/gpu_tests.log" | head -20
fi

check_summary=""
if [ $check = 1 ]; then
  for n in $ranks_list; do
    [ "$n" -gt "$gpus" ] && continue
    # f32 steps (--amp off): bf16's rounding of a smaller batch's products would hide a wrong
    # reduction; TF32-free f32 products agree with one GPU to ~1e-5.
    checks=match; [ "$n" = 2 ] && checks=match,disagree,fault
    python3 tests/distributed/train_ranks_test.py --kiln $kiln --device cuda --ranks "$n" --models gpt2-tiny \
      --checks "$checks" --amp off --tolerance 3e-4 >"$out/check_$n.log" 2>&1
    echo "== $n GPUs (NCCL) =="; cat "$out/check_$n.log" | grep -E "^(ok|FAIL)|passed|FAILED"
    check_summary+="$n GPUs: $(tail -1 "$out/check_$n.log"); "
  done
fi

: >"$out/bench.jsonl"
batch=$(( per_gpu * gpus ))
[ $bench = 0 ] && modes=""
for mode in $modes; do
  line=$($kiln launch -n "$gpus" -- bench --model "$model" --batch "$batch" --seq 1024 --amp bf16 --shard "$mode" \
         --steps "$steps" --untimed-steps 3 --json 2>>"$out/bench.err" | tee -a "$out/bench.log" | tail -1)
  if [ "${line:0:1}" = "{" ]; then echo "$line" >>"$out/bench.jsonl"; else echo "kiln $mode: failed (bench.err)"; tail -3 "$out/bench.err"; fi
done
[ $bench = 1 ] && single=$($kiln bench --model "$single_model" --batch "$per_gpu" --seq 1024 --amp bf16 --steps "$steps" --untimed-steps 3 \
         --json 2>>"$out/bench.err" | tee -a "$out/bench.log" | tail -1)
[ $bench = 1 ] && [ "${single:0:1}" = "{" ] && echo "$single" >"$out/single.json"
if [ $bench = 1 ] && [ $torch = 1 ] && [ -f .carry/torch_fsdp_gpt2.py ]; then
  torchrun --standalone --nproc_per_node="$gpus" .carry/torch_fsdp_gpt2.py --model "$model" --batch "$per_gpu" \
    --seq 1024 --steps "$steps" >"$out/fsdp.log" 2>&1
  grep '^{' "$out/fsdp.log" | tail -1 >"$out/fsdp.json"
  torchrun --standalone --nproc_per_node="$gpus" .carry/torch_fsdp_gpt2.py --model "$model" --batch "$per_gpu" \
    --seq 1024 --steps "$steps" --compile >"$out/fsdp_compile.log" 2>&1
  grep '^{' "$out/fsdp_compile.log" | tail -1 >"$out/fsdp_compile.json"
fi

: >"$out/scaling.jsonl"
if [ -n "$scaling" ]; then
  $kiln bench --model "$scaling" --batch 16 --seq 1024 --amp bf16 --steps "$steps" --untimed-steps 3 --json \
    2>>"$out/bench.err" | tee -a "$out/scaling.log" | tail -1 >>"$out/scaling.jsonl"
  for mode in $modes; do
    $kiln launch -n "$gpus" -- bench --model "$scaling" --batch $(( 16 * gpus )) --seq 1024 --amp bf16 --shard "$mode" \
      --steps "$steps" --untimed-steps 3 --json 2>>"$out/bench.err" | tee -a "$out/scaling.log" | tail -1 >>"$out/scaling.jsonl"
  done
fi

echo
echo "GPU: $(head -1 "$out/gpu.txt") x $gpus; tests: $test_summary"
[ -n "$check_summary" ] && echo "checks: $check_summary"
python3 - "$out" "$model" "$per_gpu" "$gpus" <<'EOF'
import json, os, sys
out, model, per_gpu, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = []
for line in open(os.path.join(out, "bench.jsonl")):
    r = json.loads(line)
    rows.append((f"kiln {r['shard']}", r["ms_per_step"], r["tokens_per_s"], r["tokens_per_s"] / gpus, r["mfu"],
                 r.get("max_peak_gib", r["peak_gib"]), r["first_step_s"]))
def torch_row(name, path):
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    r = json.loads(open(path).read())
    get = lambda *keys: next((r[k] for k in keys if k in r), float("nan"))
    if r.get("oom"):
        print(f"{name}: out of memory")
        return
    tps = get("tok_s")
    rows.append((name, get("ms"), tps, tps / gpus, get("mfu_vs_989"), get("peak_gib"), get("warm_s")))
torch_row("torch FSDP2", os.path.join(out, "fsdp.json"))
torch_row("torch FSDP2 + compile", os.path.join(out, "fsdp_compile.json"))
print(f"{model}, {per_gpu} x 1024 tokens per GPU, bf16, {gpus} GPUs")
print(f"{'':24} {'ms/step':>8} {'tok/s':>9} {'tok/s/GPU':>10} {'MFU/GPU':>8} {'peak GiB/GPU':>12} {'1st step s':>10}")
print("(torch: peak = max_memory_allocated; 1st step = its warm-up steps' time, compile included)")
for n, ms, tps, tpg, mfu, mem, first in rows:
    print(f"{n:24} {ms:8.1f} {tps:9.0f} {tpg:10.0f} {mfu:8.3f} {mem:12.2f} {first:10.2f}")
single = os.path.join(out, "single.json")
if os.path.exists(single):
    r = json.loads(open(single).read())
    print(f"one GPU, {r['model']} batch {r['batch']}: {r['ms_per_step']:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
          f"MFU {r['mfu']:.3f}, peak {r['peak_gib']:.2f} GiB")
runs = [json.loads(l) for l in open(os.path.join(out, "scaling.jsonl")) if l.startswith("{")]
if runs:
    base = next((r for r in runs if r.get("world_size", 1) == 1), None)
    print(f"scaling: {runs[0]['model']}, 16 x 1024 tokens per GPU, bf16")
    print(f"{'':24} {'ms/step':>8} {'tok/s':>9} {'x 1 GPU':>8} {'peak GiB/GPU':>12}")
    for r in runs:
        name = f"kiln {r.get('world_size', 1)} GPU" + (f" {r['shard']}" if r.get("world_size", 1) > 1 else "")
        x = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        print(f"{name:24} {r['ms_per_step']:8.1f} {r['tokens_per_s']:9.0f} {x:8.2f} {r.get('max_peak_gib', r['peak_gib']):12.2f}")
EOF
