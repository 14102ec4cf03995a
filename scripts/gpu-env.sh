# Sourced by the GPU-machine scripts (gpu-hf.sh, gpu-validate.sh): $out for the results, NCCL's
# multicast off, the carried ONNX packages (.carry/onnx-debs, from `bash scripts/gpu-check.sh
# --fetch-onnx`) unpacked into $root, and $onnx_flags: the CMake flags that find them (and the
# carried cuDNN frontend).
out=${OUT:-gpu-out}; mkdir -p "$out"; export NCCL_NVLS_ENABLE=0
root=/tmp/onnx-root; lib=$root/usr/lib/x86_64-linux-gnu
for f in .carry/onnx-debs/*.deb; do dpkg -x "$f" "$root"; done
export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
onnx_flags=(-DProtobuf_INCLUDE_DIR=$root/usr/include -DProtobuf_LIBRARY=$lib/libprotobuf.so -DONNX_DIR=$lib/cmake/ONNX)
# The cuDNN frontend's headers (the cudnn attention dialect) are not installed there either:
# without .carry/cudnn_frontend_include (pip nvidia-cudnn-frontend's include/ folder) kiln builds
# without that dialect and times its own attention kernels instead.
if [ -f .carry/cudnn_frontend_include/cudnn_frontend.h ]; then
  onnx_flags+=(-DKILN_CUDNN_FRONTEND_DIR="$PWD/.carry/cudnn_frontend_include")
else
  echo "gpu-env: no .carry/cudnn_frontend_include: no cudnn attention dialect in this build" >&2
fi
nvidia-smi --query-gpu=name --format=csv,noheader
