"""Shared helpers for the search benchmarks: GPT configurations from the literature, traced on the meta device."""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt import GPT, GPTConfig  # noqa: E402
from planner.model_file import ModelFile, default_loss  # noqa: E402
from planner.trace import trace_model  # noqa: E402

# name: (layers, hidden, heads, GPUs, global batch) -- Narayanan et al. 2021 ("Efficient Large-Scale Language Model
# Training on GPU Clusters Using Megatron-LM"), Table 1; sequence 2048, vocabulary 51200 as in that paper.
MEGATRON_TABLE1 = {
    "1.7B": (24, 2304, 24, 32, 512), "3.6B": (30, 3072, 32, 64, 512), "7.5B": (36, 4096, 32, 128, 512),
    "18B": (40, 6144, 48, 256, 1024), "39B": (48, 8192, 64, 512, 1536), "76B": (60, 10240, 80, 1024, 1792),
    "145B": (80, 12288, 96, 1536, 2304), "310B": (96, 16384, 128, 1920, 2160),
    "530B": (105, 20480, 128, 2520, 2520), "1T": (128, 25600, 160, 3072, 3072),
}


def gpt_graph(layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 51200):
    """Trace a GPT (examples/gpt.py) of this shape with batch 1 on the meta device."""
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, block_size=seq)

    def sample(b: int):
        tokens = torch.zeros(b, seq + 1, dtype=torch.long)
        return tokens[:, :-1], tokens[:, 1:]
    mf = ModelFile(path=f"gpt-{layers}x{hidden}", build_model=lambda: GPT(cfg), sample_batch=sample,
                   loss_fn=default_loss)
    return trace_model(mf, progress=False)
