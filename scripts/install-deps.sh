#!/usr/bin/env bash
# Installs what kiln needs on Debian 12 / Ubuntu, skipping what is already present.
# Debian packages by name through apt-get; Python test helpers by name through pip.
# --cli: only what configuring, building and running the command-line tool needs (the README's
# first command: no ONNX, Gloo, Python package or PyTorch, which are most of the download).
set -euo pipefail

cli_only=false
[[ "${1:-}" == "--cli" ]] && cli_only=true

# What configuring (GoogleTest and python3 are required there), building the library and the
# CLI, and `kiln train`'s default dataset need.
packages=(
  cmake ninja-build g++ pkg-config
  libgtest-dev libgmock-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  libopenblas-dev zlib1g-dev
  dataset-fashion-mnist
  python3
)
$cli_only || packages+=(
  libbenchmark-dev python3-pip
  # The ONNX front end (optional in CMake), its conformance data, and the PyTorch reference of
  # tests/frontend/torch_step_test.py.
  libonnx-dev libprotobuf-dev libonnx-testdata python3-onnx python3-torch
  # The Python package (python/, docs/python.md): its tests and its progress bar.
  python3-dev python3-venv python3-pytest python3-tqdm
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if $cli_only; then
  echo "install-deps: ok (--cli: the command-line tool's dependencies)"
  exit 0
fi

# Gloo (the CPU collectives of distributed jobs): optional, since older releases lack the package
# (kiln then builds without CPU collectives and says so).
if [[ "$(dpkg-query -W -f='${Status}' libgloo-dev 2>/dev/null || true)" != "install ok installed" ]]; then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  echo "install-deps: installing libgloo-dev"
  { $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends libgloo-dev >/dev/null; } ||
    echo "install-deps: warning: could not install libgloo-dev; CPU collectives are left out"
fi

# Python packages used only by tests that compare against other implementations.
python_packages=(safetensors numpy)
need_pip=()
for p in "${python_packages[@]}"; do
  python3 -c "import $p" 2>/dev/null || need_pip+=("$p")
done
if ((${#need_pip[@]})); then
  echo "install-deps: pip installing ${need_pip[*]}"
  python3 -m pip install -q "${need_pip[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${need_pip[@]}" ||
    echo "install-deps: warning: could not pip install ${need_pip[*]}; the interop tests will skip"
fi
# The Python package's build (nanobind, and scikit-build-core for `pip install .`), for Debian's
# python3: the interpreter python3-torch serves, which need not be the python3 first on PATH.
if [[ -x /usr/bin/python3 ]] && ! /usr/bin/python3 -c "import nanobind, scikit_build_core" 2>/dev/null; then
  echo "install-deps: pip installing nanobind scikit-build-core for /usr/bin/python3"
  /usr/bin/python3 -m pip install -q nanobind scikit-build-core 2>/dev/null ||
    /usr/bin/python3 -m pip install -q --break-system-packages nanobind scikit-build-core ||
    echo "install-deps: warning: could not pip install nanobind; the Python package is not built"
fi
# Hugging Face transformers, for Debian's python3 (its torch is 1.13; transformers 4.45 runs on
# it), only for tests that build its models from configs (no weights are downloaded): the GPT-2
# of tests/frontend/torch_step_test.py and tests/python. Without it those models are skipped,
# each saying so. About 20 MB from PyPI (with tokenizers, huggingface-hub, safetensors, regex),
# 20 s here.
if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c "import torch" 2>/dev/null &&
  ! /usr/bin/python3 -c "import transformers" 2>/dev/null; then
  echo "install-deps: pip installing transformers for /usr/bin/python3"
  /usr/bin/python3 -m pip install -q "transformers==4.45.*" 2>/dev/null ||
    /usr/bin/python3 -m pip install -q --break-system-packages "transformers==4.45.*" ||
    echo "install-deps: warning: could not pip install transformers; the tests of its models skip"
fi
# The cuDNN frontend (header-only C++ graph API over cuDNN) for the "cudnn" attention dialect:
# its pip package installs the headers under <site-packages>/include; CMake asks python3 where.
# Presence is checked through the distribution's metadata: `import cudnn` would load the GPU
# library.
if ! python3 -c "import importlib.metadata as m; m.distribution('nvidia-cudnn-frontend')" 2>/dev/null; then
  echo "install-deps: pip installing nvidia-cudnn-frontend"
  python3 -m pip install -q nvidia-cudnn-frontend 2>/dev/null ||
    python3 -m pip install -q --break-system-packages nvidia-cudnn-frontend ||
    echo "install-deps: warning: could not pip install nvidia-cudnn-frontend; the cudnn dialect is left out"
fi
# PyTorch 2.x for the Python package (kiln.compile's torch.export capture) and its tests, in a
# virtual environment of Debian's python3 (/usr/bin/python3: the same interpreter, so one build of
# kiln._kiln serves both; --system-site-packages keeps Debian's numpy, onnx, pytest and
# nanobind). PyPI's torch is a CUDA build: without a GPU it needs only the CUDA libraries it links,
# which the CUDA 13.0 toolkit in /usr/local/cuda has except three and a new enough NCCL, installed as wheels by name
# (--no-deps: the rest of its dependencies, cuDNN, cuBLAS and triton among them, are GPU-only or
# the toolkit's). torch 2.14.1 is the release built against CUDA 13.0, and torchvision 0.29.2 its
# match. About 1.1 GB to download, 1.9 GB on disk, 1-2 minutes here (docs/python.md).
# transformers (Hugging Face) is for the model tests only. pip then warns that the GPU wheels
# torch names are missing: they are left out on purpose.
KILN_VENV=${KILN_VENV:-/opt/kiln-venv}
torch_check="import torch, torchvision, transformers; assert torch.__version__.startswith('2.14.1'); assert transformers.__version__ >= '5'"
if [[ -x /usr/bin/python3 ]] && ! "$KILN_VENV/bin/python" -c "$torch_check" 2>/dev/null; then
  echo "install-deps: PyTorch 2.14.1 into $KILN_VENV (about 1.1 GB from PyPI)"
  { /usr/bin/python3 -m venv --system-site-packages "$KILN_VENV" &&
    "$KILN_VENV/bin/python" -m pip install -q --no-deps torch==2.14.1 torchvision==0.29.2 \
      nvidia-nccl-cu13==2.30.7 nvidia-cusparselt-cu13==0.8.1 nvidia-nvshmem-cu13==3.4.5 "nvidia-cufile==1.15.1.6.*" &&
    "$KILN_VENV/bin/python" -m pip install -q "typing-extensions>=4.10" "setuptools>=77.0.3" "sympy>=1.13.3" \
      "networkx>=2.5.1" "fsspec>=0.8.5" jinja2 filelock pillow "transformers>=5,<6" &&
    "$KILN_VENV/bin/python" -c "$torch_check"; } ||
    echo "install-deps: warning: could not install PyTorch 2.14.1 into $KILN_VENV; the Python tests use Debian's torch 1.13 (ONNX path only)"
fi
echo "install-deps: ok"
