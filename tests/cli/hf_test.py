#!/usr/bin/env python3
"""`kiln export-hf` and `kiln import-hf` (tools/cli/hf.cc) as a user runs them: a llama-tiny run's
checkpoint (one process; 2 ranks' consolidated file, and their rank files) exported to a LlamaForCausalLM directory
and imported back gives the checkpoint's params bit for bit; `kiln train --init` starts from
them; transformers loads the directory (when a Python with transformers is found); what cannot
be exported is refused in one line; a transformers model with Llama 3's rope_theta imports, trains
with the flags import-hf prints and exports them back; llama-8b cut down by the size flags exports
Llama 3's rope_theta. (tests/train/hf_llama_test.cc compares the logits.)

  python3 tests/cli/hf_test.py PATH/TO/kiln      (ctest: cli/hf)
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from safetensors.numpy import load_file
except ImportError:  # pragma: no cover
    print("SKIP: numpy or safetensors missing")
    sys.exit(0)

KILN = None
TRAIN = ["train", "--model", "llama-tiny", "--seq", "32", "--steps", "3", "--batch", "4", "--eval-every", "3",
         "--eval-batches", "1", "--device", "cpu", "--amp", "off"]


def kiln(*args, ok=True):
    result = subprocess.run([KILN, *args], capture_output=True, text=True, timeout=300)
    if ok and result.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result




def check_round_trip(checkpoint_arg, checkpoint_file, d):
    kiln("export-hf", checkpoint_arg, os.path.join(d, "hf"))
    hf = load_file(os.path.join(d, "hf", "model.safetensors"))
    want = load_file(checkpoint_file)  # the params and the optimizer's state
    assert np.array_equal(hf["lm_head.weight"], want["head.weight"].T), "lm_head is head.weight transposed"
    assert np.array_equal(hf["model.layers.1.self_attn.k_proj.weight"], want["h1.k.weight"].T)
    assert np.array_equal(hf["model.embed_tokens.weight"], want["emb.weight"])
    out = kiln("import-hf", os.path.join(d, "hf"), os.path.join(d, "init.safetensors")).stdout
    back = load_file(os.path.join(d, "init.safetensors"))
    assert len(back) == 3 + 9 * 2, sorted(back)  # emb, norm, head and 9 a layer
    for name, value in back.items():
        assert np.array_equal(value, want[name]), name
    # The command import-hf prints trains from the imported params.
    command = out.splitlines()[-1].split()
    assert command[:2] == ["kiln", "train"], out
    result = kiln(*command[1:], "--steps", "1", "--batch", "4", "--device", "cpu", "--eval-batches", "1")
    assert "step 1/1" in result.stdout, result.stdout


def python_with_transformers():
    for python in ("/opt/kiln-venv/bin/python3", "python3"):
        probe = subprocess.run([python, "-c", "import transformers, torch"], capture_output=True)
        if probe.returncode == 0:
            return python
    return None


def check_transformers_loads(directory):
    python = python_with_transformers()
    if python is None:
        print("  (no Python with transformers: from_pretrained not tried)")
        return
    script = ("import sys, torch; from transformers import LlamaForCausalLM; "
              "m = LlamaForCausalLM.from_pretrained(sys.argv[1]); "
              "print(sum(p.numel() for p in m.parameters()), m(torch.zeros(1, 4, dtype=torch.long)).logits.shape)")
    result = subprocess.run([python, "-c", script, directory], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # llama-tiny: d_model 64, 4 heads of 16 (2 for keys and values), hidden 128, vocab 256, 2 layers.
    per_layer = 2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert result.stdout.split()[0] == str(2 * 256 * 64 + 64 + 2 * per_layer), result.stdout


def check_llama3_import(d, python):
    """A LlamaForCausalLM made by transformers with Llama 3's rotary base and another RMSNorm
    epsilon: import-hf prints the flags that train it, the file refuses a model without them,
    its checkpoint exports them back; Llama 3.1's rope scaling is refused in one line.
    (tests/train/hf_llama_test.cc compares such a model's logits with transformers'.)"""
    from safetensors.numpy import save_file
    hf, init = os.path.join(d, "made"), os.path.join(d, "init.safetensors")
    save_file({"idx": np.zeros((1, 4), dtype=np.int64)}, os.path.join(d, "idx.safetensors"))
    check = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train", "hf_llama_check.py")
    made = subprocess.run([python, check, "make", hf, os.path.join(d, "idx.safetensors"), os.path.join(d, "out.safetensors"),
                           "500000", "1e-6"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    out = kiln("import-hf", hf, init).stdout
    command = out.splitlines()[-1].split()
    assert command[command.index("--rope-theta") + 1] == "500000", out
    assert float(command[command.index("--rms-eps") + 1]) == 1e-6, out
    # Its vocabulary is 96: a text of bytes below 96.
    text = os.path.join(d, "upper.txt")
    with open(text, "w") as f:
        f.write("THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG; 0123456789.\n" * 400)
    common = ["--steps", "2", "--batch", "4", "--device", "cpu", "--eval-batches", "1", "--eval-every", "2",
              "--data", text, "--amp", "off"]
    kiln(*command[1:], *common, "--checkpoint-dir", os.path.join(d, "ck"))
    kiln("export-hf", os.path.join(d, "ck"), os.path.join(d, "back"))
    with open(os.path.join(d, "back", "config.json")) as f:
        config = json.load(f)
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6, config
    without = command[1:]
    del without[without.index("--rope-theta"):without.index("--rope-theta") + 2]
    result = kiln(*without, *common, ok=False)
    assert result.returncode != 0 and "give --rope-theta 500000" in result.stderr and \
        len(result.stderr.strip().splitlines()) == 1, result.stderr
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config["rope_scaling"] = config["rope_parameters"] = scaling
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f)
    result = kiln("import-hf", hf, init, ok=False)
    assert result.returncode != 0 and "rope type 'llama3'" in result.stderr and \
        len(result.stderr.strip().splitlines()) == 1, result.stderr


def check_llama_8b_sizes(d):
    """llama-8b (Llama 3 8B's sizes and rotary base) cut down by the size flags, under kiln launch
    with zero3, as scripts/gpu-scale.sh runs it whole: its checkpoint exports with Llama 3's
    rope_theta and the flags' sizes."""
    sizes = ["--layers", "1", "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--hidden", "96", "--vocab", "200"]
    train = [a if a != "llama-tiny" else "llama-8b" for a in TRAIN]
    kiln("launch", "-n", "2", "--", *train, *sizes, "--shard", "zero3", "--checkpoint-dir", os.path.join(d, "ck"))
    kiln("export-hf", os.path.join(d, "ck"), os.path.join(d, "hf8b"))
    with open(os.path.join(d, "hf8b", "config.json")) as f:
        config = json.load(f)
    want = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=200, rope_theta=500000.0, rms_norm_eps=1e-5)
    got = {k: config[k] for k in want}
    assert got == want, got
    assert config["rope_parameters"]["rope_theta"] == 500000.0, config


def main():
    global KILN
    KILN = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as d:
        kiln(*TRAIN, "--checkpoint-dir", os.path.join(d, "ck"))
        check_round_trip(os.path.join(d, "ck"), os.path.join(d, "ck", "last.safetensors"), d)
        check_transformers_loads(os.path.join(d, "hf"))
        print("ok  one process: export-hf, import-hf, train --init")
    with tempfile.TemporaryDirectory() as d:
        kiln("launch", "-n", "2", "--", *TRAIN, "--shard", "zero3", "--checkpoint-dir", os.path.join(d, "ck"),
             "--consolidate")
        check_round_trip(os.path.join(d, "ck"), os.path.join(d, "ck", "consolidated.safetensors"), d)
        print("ok  2 ranks (zero3), consolidated")
    with tempfile.TemporaryDirectory() as d:
        # Rank files alone (no --consolidate): export gathers the shards; the same weights as the
        # consolidated file of the same run.
        ck = os.path.join(d, "ck")
        kiln("launch", "-n", "2", "--", *TRAIN, "--shard", "zero3", "--checkpoint-dir", ck, "--consolidate")
        os.rename(os.path.join(ck, "consolidated.safetensors"), os.path.join(d, "whole.safetensors"))
        check_round_trip(ck, os.path.join(d, "whole.safetensors"), d)
        result = kiln("export-hf", os.path.join(ck, "last.rank0-of-2.safetensors"), os.path.join(d, "hf1"), ok=False)
        assert result.returncode != 0 and "in rank 1's file, not given" in result.stderr and \
            len(result.stderr.splitlines()) == 1, result.stderr
        result = kiln(*TRAIN, "--init", os.path.join(ck, "last.rank0-of-2.safetensors"), ok=False)
        assert result.returncode != 0 and "'emb.weight' is f32[8192], model llama-tiny needs f32[256,64]" in \
            result.stderr, result.stderr
        print("ok  2 ranks (zero3), rank files; one rank's file alone refused in one line (export-hf, train --init)")
    python = python_with_transformers()
    if python is None:
        print("  (no Python with transformers: a Llama 3-style import not tried)")
    else:
        with tempfile.TemporaryDirectory() as d:
            check_llama3_import(d, python)
            print("ok  a transformers model with rope_theta 500000, rms_norm_eps 1e-6: import-hf, train with its flags "
                  "(refused without), export-hf; rope scaling llama3 refused in one line")
    with tempfile.TemporaryDirectory() as d:
        check_llama_8b_sizes(d)
        print("ok  llama-8b cut to 1 layer of 64 by the size flags: 2 ranks (zero3), exported with rope_theta 500000")


if __name__ == "__main__":
    main()
