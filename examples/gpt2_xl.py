"""GPT-2 XL, 1.5B parameters (Radford et al. 2019, Table 2: 48 layers, d_model 1600; 25 heads of 64 as in the
released checkpoint; context 1024; vocabulary 50257), built from gpt.py.

The README's first command plans it on a DGX A100 node. The planner builds it on the meta device, so tracing
allocates no weights.
"""
from __future__ import annotations

import torch

import gpt
from gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=48, n_embd=1600, n_head=25, block_size=1024, vocab_size=50257)
"""GPT-2 XL."""


def build_model() -> GPT:
    """The GPT-2 XL model (the planner builds it on the meta device)."""
    return gpt.build_model(CONFIG)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets of shape (batch_size, 1024)."""
    return gpt.sample_batch(batch_size, CONFIG)
