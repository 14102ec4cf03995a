#!/usr/bin/env bash
# One call on the GPU machine: configure for sm_90a, build, run the GPU test suite, benchmark
# kiln's GPT-2 training step and PyTorch's (eager and torch.compile) side by side, and print a
# short table last. Full logs go to $OUT (the device tool brings them back) or ./gpu-out.
#
#   bash scripts/gpu-check.sh [--no-tests | --tests GTEST_FILTER] [--no-torch]
#                             [--bench "[NAME=value ...] ARGS"] ... [--base DIR] [--rounds N]
#                             [--llama] [--torch-llama "CFG:MODE:B:T ..."] [--python]
#
# --base DIR: a second source tree (e.g. `git archive <commit>` unpacked under .carry/) built the
# same way and benchmarked on the same lines, alternating with this tree's runs (--rounds times,
# default 2), so that a change is measured against its baseline in one call on one GPU.
#
# The PyTorch reference is ../shared/bench/torch_gpt2.py; only the repository travels to the GPU
# machine, so copy it to .carry/torch_gpt2.py (ignored by git) and carry .carry along.
# --llama adds the LLaMA targets of issue 24 next to GPT-2's: kiln's llama-160m (16 x 2048) and
# llama-1b (4 x 2048) and ../shared/bench/torch_llama.py's torch.compile runs of both (copy it to
# .carry/torch_llama.py), all in the same table; --torch-llama replaces those torch runs.
# --python builds the Python package's module too (python3 there has nanobind) and runs its
# tests (tests/python, pytest) against the GPU build.
#
# The ONNX front end needs Debian's libonnx and libprotobuf, which the GPU machine lacks: run
# `bash scripts/gpu-check.sh --fetch-onnx` here once (it downloads the packages and ONNX's node
# tests into .carry/onnx-debs); on the GPU machine they are unpacked into /tmp/onnx-root and the
# build finds them there (and the GPU suite runs the node tests on CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-onnx" ]; then
  mkdir -p .carry/onnx-debs && cd .carry/onnx-debs &&
    apt-get download libonnx-dev libonnx1 libonnxifi libprotobuf-dev libprotobuf32 libprotobuf-lite32 libonnx-testdata &&
    ls && exit 0
  exit 1
fi
out="${OUT:-gpu-out}"; mkdir -p "$out"
tests=1; torch=1; test_filter='*'; base=""; rounds=1; python=0
benches=("--model gpt2 --batch 32 --seq 1024 --amp bf16")
torch_runs="gpt2:eager:32 gpt2:compile:32"
llama_torch_runs=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-tests) tests=0 ;;
    --tests) shift; test_filter="$1" ;;
    --no-torch) torch=0 ;;
    --python) python=1 ;;
    --bench) shift; benches+=("$1") ;;
    --only-bench) shift; benches=("$1") ;;
    --torch) shift; torch_runs="$1" ;;
    --llama)
      benches+=("--model llama-160m --batch 16 --seq 2048 --amp bf16" "--model llama-1b --batch 4 --seq 2048 --amp bf16")
      llama_torch_runs="llama-160m:compile:16:2048 llama-1b:compile:4:2048" ;;
    --torch-llama) shift; llama_torch_runs="$1" ;;
    --base) shift; base="$1"; rounds=2 ;;
    --rounds) shift; rounds="$1" ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s)
# The cuDNN frontend's headers (for the cudnn attention dialect) are not installed there: carry a
# copy in .carry/cudnn_frontend_include (pip nvidia-cudnn-frontend's include/ folder).
frontend=()
[ -d .carry/cudnn_frontend_include ] && frontend=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
if ls .carry/onnx-debs/*.deb >/dev/null 2>&1; then
  root=/tmp/onnx-root lib=/tmp/onnx-root/usr/lib/x86_64-linux-gnu
  for f in .carry/onnx-debs/*.deb; do dpkg -x "$f" "$root"; done
  frontend+=(-DProtobuf_INCLUDE_DIR=$root/usr/include -DProtobuf_LIBRARY=$lib/libprotobuf.so -DONNX_DIR=$lib/cmake/ONNX)
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export KILN_ONNX_NODE_TESTS=$root/usr/share/libonnx-testdata/data/node
fi
build_tree() {  # SOURCE BUILD_DIR LOG TARGET...
  local source="$1" dir="$2" log="$3"; shift 3
  cmake -S "$source" -B "$dir" -G Ninja -DKILN_CUDA=ON -DKILN_BUILD_BENCH=OFF "${frontend[@]}" >"$log" 2>&1 &&
    cmake --build "$dir" -j16 --target "$@" >>"$log" 2>&1
}
targets=(kiln-cli)
[ $tests = 1 ] && targets+=(kiln_gpu_tests)
[ $python = 1 ] && targets+=(_kiln)
build_tree . build-gpu "$out/build.log" "${targets[@]}"
build_rc=$?
echo "build: rc=$build_rc in $(( $(date +%s) - start )) s"
if [ $build_rc -ne 0 ]; then grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; fi
if [ -n "$base" ]; then
  build_tree "$base" build-base "$out/build-base.log" kiln-cli ||
    { echo "base build failed"; grep -E "error|FAILED" "$out/build-base.log" | head -20; exit 1; }
  echo "base build: done in $(( $(date +%s) - start )) s"
fi

test_summary="not run"
if [ $tests = 1 ]; then
  ./build-gpu/tests/kiln_gpu_tests --gtest_brief=1 --gtest_filter="$test_filter" >"$out/gpu_tests.log" 2>&1
  test_summary=$(grep -E "^\[  (PASSED|FAILED)|tests? ran" "$out/gpu_tests.log" | tr '\n' ' ')
  grep -E "^\[  FAILED|Failure|error" "$out/gpu_tests.log" | head -30
fi

python_summary="not run"
if [ $python = 1 ]; then
  PYTHONPATH="$PWD/build-gpu/python" python3 -m pytest tests/python -v -p no:cacheprovider >"$out/python_tests.log" 2>&1
  python_summary=$(tail -1 "$out/python_tests.log")
  grep -E "^(FAILED|ERROR)" "$out/python_tests.log" | head -20
fi

: >"$out/bench.jsonl"
bench_one() {  # WHO BINARY "LINE"
  local who="$1" bin="$2" b="$3"
  # The whole report (and a --profile table) to bench.log; the JSON line, with the arguments, to
  # bench.jsonl for the table below.
  # Leading NAME=value words are environment settings for the run (e.g. KILN_GEMM_AUTOTUNE=1).
  envs=(); args=()
  for w in $b; do
    if [ ${#args[@]} -eq 0 ] && [[ "$w" == [A-Z]*=* ]]; then envs+=("$w"); else args+=("$w"); fi
  done
  line=$(env "${envs[@]}" "$bin" bench "${args[@]}" --device cuda --json 2>>"$out/bench.err" | tee -a "$out/bench.log" | tail -1)
  if [ "${line:0:1}" = "{" ]; then
    python3 -c 'import json, sys; r = json.loads(sys.argv[3]); r["args"] = sys.argv[2]; r["who"] = sys.argv[1]; print(json.dumps(r))' \
      "$who" "$b" "$line" >>"$out/bench.jsonl"
  else
    echo "{\"who\": \"$who\", \"args\": \"$b\", \"error\": \"$(tail -1 "$out/bench.err")\"}" >>"$out/bench.jsonl"
  fi
}
for b in "${benches[@]}"; do
  for ((r = 0; r < rounds; ++r)); do
    [ -n "$base" ] && bench_one base ./build-base/kiln "$b"
    bench_one kiln ./build-gpu/kiln "$b"
  done
done
if [ $torch = 1 ] && [ -f .carry/torch_gpt2.py ]; then
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 .carry/torch_gpt2.py $torch_runs >"$out/torch.jsonl" 2>"$out/torch.err"
fi
if [ $torch = 1 ] && [ -n "$llama_torch_runs" ] && [ -f .carry/torch_llama.py ]; then
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 .carry/torch_llama.py $llama_torch_runs >>"$out/torch.jsonl" 2>>"$out/torch.err"
fi

echo; echo "== $(cat "$out/gpu.txt")"
echo "GPU tests: $test_summary"
echo "Python tests: $python_summary"
python3 - "$out/bench.jsonl" "$out/torch.jsonl" <<'PY'
import json, sys, os
rows = []
for path, default_who in ((sys.argv[1], "kiln"), (sys.argv[2], "torch")):
    if not os.path.exists(path): continue
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"): continue
        r = json.loads(line)
        who = r.get("who", default_who)
        if "error" in r: rows.append((who, r.get("args", "?"), "error: " + r["error"][:90])); continue
        if r.get("oom"): rows.append((who, f'{r["cfg"]} {r["mode"]} B={r["B"]}', "out of memory")); continue
        name = r.get("args") or f'{r.get("cfg", r.get("model"))} {r.get("mode", r.get("amp", ""))} B={r.get("B", r.get("batch"))}'
        rows.append((who, name, f'{r.get("ms", r.get("ms_per_step"))} ms  {r.get("tok_s", r.get("tokens_per_s"))} tok/s  '
                     f'MFU {r.get("mfu_vs_989", r.get("mfu"))}  peak {r.get("peak_gib")} GiB  '
                     f'first step {r.get("warm_s", r.get("first_step_s"))} s'))
width = max([28] + [len(name) for _, name, _ in rows])
print(f'{"":6} {"run":{width}} result')
for who, name, res in rows: print(f"{who:6} {name:{width}} {res}")
PY
