"""Hugging Face Llama built from a small config (no weight download); needs `pip install 'shardwise[hf]'`.

Grouped-query attention (4 query heads, 2 key/value heads), RMSNorm, RoPE and SwiGLU, as transformers implements
them. torch.fx cannot trace it, so the planner uses torch.export. Model-file convention: `build_model()` and
`sample_batch(batch_size)`; the default cross-entropy loss reads the output's `.logits`.
"""
from __future__ import annotations

import torch

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # the planner reports this as one line
    raise ImportError("this example needs Hugging Face transformers: pip install 'shardwise[hf]' "
                      "(or pip install transformers)") from e

CONFIG = LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, use_cache=False,
                     attn_implementation="sdpa")
"""A small Llama; scale the sizes up for a real model."""
SEQ_LEN = 64
"""Tokens per sample."""


def build_model() -> torch.nn.Module:
    """Llama with a language-model head, randomly initialised."""
    return LlamaForCausalLM(CONFIG)


def sample_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`{"input_ids": ...}` and next-token targets, both (batch_size, SEQ_LEN)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN + 1))
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]
