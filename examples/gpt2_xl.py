"""GPT-2 XL, 1.5B parameters (Radford et al. 2019, Table 2: 48 layers, d_model 1600; 25 heads of 64 as in the
released checkpoint; context 1024; vocabulary 50257), built from gpt.py.

The README's first command plans it on a DGX A100 node. The planner builds it on the meta device, so tracing
allocates no weights.
"""
from __future__ import annotations

import torch

from gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=48, n_embd=1600, n_head=25, block_size=1024, vocab_size=50257)
"""GPT-2 XL."""


def build_model() -> GPT:
    """The 1.5B-parameter GPT-2 XL."""
    return GPT(CONFIG)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets of shape (batch_size, 1024)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]
