#!/usr/bin/env python3
"""Interop checks between kiln's safetensors code and Hugging Face's `safetensors` package,
run by tests/train/safetensors_interop_test.cc (needs: pip install safetensors numpy).

  check_safetensors.py check FILE EXPECTED   FILE was written by kiln: load it with
                                             safetensors and compare with EXPECTED
  check_safetensors.py write FILE EXPECTED   write FILE with safetensors (numpy dtypes) and,
                                             when this safetensors has TensorSpec, FILE.bf16
                                             with a BF16 tensor; describe both in EXPECTED
                                             (and EXPECTED.bf16) for kiln to check

EXPECTED is text, one record per line, fields separated by single spaces, no spaces inside:
  tensor NAME DTYPE RANK D0 ... D(RANK-1) V0 V1 ...    (DTYPE as in safetensors: F32, BF16, ...)
  meta KEY VALUE
Values are Python reprs of floats (exact), integers, or 0/1 for BOOL.
Exit status 0 when everything matches; otherwise the differences are printed.
"""
import sys

import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import save_file


def parse_expected(path):
    tensors, metadata = {}, {}
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split(" ")
            if fields[0] == "meta":
                metadata[fields[1]] = fields[2] if len(fields) > 2 else ""
            elif fields[0] == "tensor":
                name, dtype, rank = fields[1], fields[2], int(fields[3])
                shape = [int(d) for d in fields[4:4 + rank]]
                tensors[name] = (dtype, shape, fields[4 + rank:])
    return tensors, metadata


def bf16_to_float32(raw):
    return (np.frombuffer(bytes(raw), dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def check(path, expected_path):
    expected, expected_metadata = parse_expected(expected_path)
    problems = []
    with open(path, "rb") as f:
        data = f.read()
    # deserialize runs safetensors' own (Rust) validation of the whole file.
    raw = dict(safetensors.deserialize(data))
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
        if metadata != expected_metadata:
            problems.append(f"metadata {metadata} != expected {expected_metadata}")
        if sorted(raw) != sorted(expected):
            problems.append(f"names {sorted(raw)} != expected {sorted(expected)}")
        for name, (dtype, shape, values) in expected.items():
            if name not in raw:
                continue
            entry = raw[name]
            if entry["dtype"] != dtype or list(entry["shape"]) != shape:
                problems.append(f"{name}: {entry['dtype']} {entry['shape']} != {dtype} {shape}")
                continue
            if dtype == "BF16":
                actual = bf16_to_float32(entry["data"]).astype(np.float64).ravel()
            else:
                actual = f.get_tensor(name).ravel()
            if dtype in ("I32", "I64", "U8"):
                want = np.array([int(v) for v in values], dtype=np.int64)
                same = actual.astype(np.int64).tolist() == want.tolist()
            elif dtype == "BOOL":
                same = actual.astype(np.int64).tolist() == [int(v) for v in values]
            else:
                same = actual.astype(np.float64).tolist() == [float(v) for v in values]
            if not same:
                problems.append(f"{name}: values {actual.tolist()[:8]} != {values[:8]}")
    for p in problems:
        print(p)
    print(f"checked {len(expected)} tensors: {'OK' if not problems else 'MISMATCH'}")
    return 0 if not problems else 1


def describe(out, name, dtype, array, values):
    shape = list(array.shape)
    fields = ["tensor", name, dtype, str(len(shape))] + [str(d) for d in shape] + values
    out.write(" ".join(fields) + "\n")


def float_values(array):
    return [repr(float(v)) for v in array.ravel()]


def write(path, expected_path):
    rng = np.random.default_rng(2024)
    tensors = {
        "f32": rng.uniform(-2, 2, size=(3, 4)).astype(np.float32),
        "f64": rng.uniform(-1e6, 1e6, size=(5,)),
        "f16": rng.uniform(-8, 8, size=(2, 3)).astype(np.float16),
        "i32": rng.integers(-(2**31), 2**31 - 1, size=(4,), dtype=np.int32),
        "i64": np.array([2**62 + 1, -(2**40) - 3, 7], dtype=np.int64),
        "u8": rng.integers(1, 256, size=(2, 2, 2), dtype=np.uint8),
        "mask": np.array([True, False, True, True, False]),
        "scalar": np.array(3.25, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    names = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16",
             np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8",
             np.dtype(np.bool_): "BOOL"}
    metadata = {"producer": "safetensors-python", "step": "42"}
    save_file(tensors, path, metadata=metadata)
    with open(expected_path, "w") as out:
        for key, value in metadata.items():
            out.write(f"meta {key} {value}\n")
        for name, array in tensors.items():
            dtype = names[array.dtype]
            if dtype in ("F32", "F64", "F16"):
                values = float_values(array)
            else:
                values = [str(int(v)) for v in array.ravel()]
            describe(out, name, dtype, array, values)

    if hasattr(safetensors, "TensorSpec") and hasattr(safetensors, "serialize_file"):
        bits = rng.integers(0, 2**16, size=(2, 5), dtype=np.uint16)
        bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # no inf/NaN: compare values exactly
        spec = safetensors.TensorSpec(dtype="bfloat16", shape=list(bits.shape),
                                      data_ptr=bits.ctypes.data, data_len=bits.nbytes)
        safetensors.serialize_file({"bf16": spec}, path + ".bf16", metadata=None)
        with open(expected_path + ".bf16", "w") as out:
            describe(out, "bf16", "BF16", bits, float_values(bf16_to_float32(bits.tobytes())))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("check", "write"):
        print(__doc__)
        sys.exit(2)
    sys.exit(check(sys.argv[2], sys.argv[3]) if sys.argv[1] == "check" else write(sys.argv[2], sys.argv[3]))
