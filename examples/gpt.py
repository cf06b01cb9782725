"""A GPT in the style of nanoGPT / GPT-2: learned positions, tied embeddings, pre-LayerNorm blocks.

Written the ordinary way on purpose — attention hard-codes its head count in `view(b, s, n_head, head_dim)` — so the
executor is tested on a model nobody rewrote for tensor parallelism. Other example files import `GPT` and
`GPTConfig` from here and set their own `CONFIG` (e.g. gpt3_175b.py).

Model-file convention: `build_model()` and `sample_batch(batch_size)`; cross-entropy over the vocabulary is the
default loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """GPT hyper-parameters."""

    n_layer: int = 4
    """Transformer blocks."""
    n_embd: int = 128
    """Hidden size h."""
    n_head: int = 4
    """Attention heads a."""
    vocab_size: int = 512
    """Vocabulary V."""
    block_size: int = 64
    """Sequence length s (and learned positions)."""
    dropout: float = 0.0
    """Dropout probability on the embeddings, the attention probabilities and each residual branch, as nanoGPT and
    Megatron-LM place it (0: no dropout ops in the graph)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        if self.dropout:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim)
        return _dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings, as in GPT-2
        # GPT-2's initialisation, as nanoGPT writes it: N(0, 0.02) weights and embeddings, zero biases, residual
        # projections N(0, 0.02 / sqrt(2 n_layer)). torch's N(0, 1) embedding tied to the head would give logits
        # of +-40: a third of the softmax gradient underflows to subnormal floats, which x86 CPUs multiply ~10x
        # slower (a data-dependent slow path no step-time prediction prices)
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        x = _dropout(self.wte(idx) + self.wpe(torch.arange(s, device=idx.device)), self.cfg.dropout, self.training)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout when the configuration has dropout; otherwise x itself (no op in the traced graph)."""
    return F.dropout(x, p, training) if p else x


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


CONFIG = GPTConfig()
"""The configuration `build_model` uses; other example files set their own."""


def build_model(cfg: GPTConfig | None = None) -> GPT:
    """The model, freshly initialised."""
    return GPT(cfg or CONFIG)


def sample_batch(batch_size: int, cfg: GPTConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets of shape (batch_size, block_size)."""
    cfg = cfg or CONFIG
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]
