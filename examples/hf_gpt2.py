"""Hugging Face GPT-2 built from a small config (no weight download); needs `pip install 'shardwise[hf]'`.

transformers models do not trace with torch.fx (transformers 5 removed `transformers.utils.fx`), so the planner
falls back to torch.export. Model-file convention: `build_model()` and `sample_batch(batch_size)`; the model returns
a `CausalLMOutput` whose `.logits` the default cross-entropy loss reads.
"""
from __future__ import annotations

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as e:  # the planner reports this as one line
    raise ImportError("this example needs Hugging Face transformers: pip install 'shardwise[hf]' "
                      "(or pip install transformers)") from e

CONFIG = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512, bos_token_id=0,
                    eos_token_id=0, use_cache=False, attn_implementation="sdpa")
"""A small GPT-2; raise the sizes for a real model (e.g. n_layer=12, n_embd=768, n_head=12 for GPT-2 small)."""
SEQ_LEN = 64
"""Tokens per sample."""


def build_model() -> torch.nn.Module:
    """GPT-2 with a language-model head, randomly initialised."""
    return GPT2LMHeadModel(CONFIG)


def sample_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`{"input_ids": ...}` and next-token targets, both (batch_size, SEQ_LEN)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN + 1))
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]
