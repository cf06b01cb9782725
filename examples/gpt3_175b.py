"""GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048), built from gpt.py.

The vocabulary is 51200 (GPT-2's 50257 padded to a multiple of 1024, as Megatron-LM does). Only meant to be traced:
the planner builds it on the meta device, so no 700 GB of fp32 weights are allocated.
"""
from __future__ import annotations

import torch

import gpt
from gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=96, n_embd=12288, n_head=96, block_size=2048, vocab_size=51200)
"""GPT-3 175B."""


def build_model() -> GPT:
    """The GPT-3 175B model (the planner builds it on the meta device)."""
    return gpt.build_model(CONFIG)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets of shape (batch_size, 2048)."""
    return gpt.sample_batch(batch_size, CONFIG)
