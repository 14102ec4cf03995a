#!/usr/bin/env python3
"""transformers' side of tests/train/hf_llama_test.cc (LlamaForCausalLM on the CPU, float32):

  hf_llama_check.py logits DIR IDX OUT   load DIR with from_pretrained; the logits of the token
                                         ids IDX["idx"] (B, T) into OUT["logits"]
  hf_llama_check.py make DIR IDX OUT [ROPE_THETA RMS_EPS]
                                         a LlamaForCausalLM with random weights (norm gains too)
                                         of the config below (rotary base and norm epsilon as
                                         given, else 10000 and 1e-5), save_pretrained into DIR,
                                         and its logits on IDX into OUT
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

logging.disable_progress_bar()  # the test's output stays its own


def logits_of(model, idx_path, out_path):
    idx = load_file(idx_path)["idx"]
    with torch.no_grad():
        logits = model(input_ids=idx).logits
    save_file({"logits": logits.float().contiguous()}, out_path)


def main():
    mode, directory, idx_path, out_path = sys.argv[1:5]
    rope_theta, rms_eps = (float(sys.argv[5]), float(sys.argv[6])) if len(sys.argv) > 6 else (10000.0, 1e-5)
    torch.set_num_threads(1)
    if mode == "logits":
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    else:
        torch.manual_seed(5)
        config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
                             rms_norm_eps=rms_eps, rope_theta=rope_theta, tie_word_embeddings=False,
                             attn_implementation="eager")
        model = LlamaForCausalLM(config).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0.0, 0.1)
        model.save_pretrained(directory, safe_serialization=True)
    model.eval()
    logits_of(model, idx_path, out_path)


if __name__ == "__main__":
    main()
