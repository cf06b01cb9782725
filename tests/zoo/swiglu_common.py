"""A small GPT-style model for the tensor-parallel correctness tests: attention with separate q/k/v/o Linears and
a SwiGLU MLP written either the Phi-3 way (`gate, up = self.gate_up(x).chunk(2, dim=-1)`) or with separate `gate`
and `up` Linears. Imported by swiglu_fused.py and swiglu_separate.py (the model files)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, SEQ, LAYERS = 128, 64, 4, 32, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head = HEADS
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up = nn.Linear(HIDDEN, 8 * HIDDEN, bias=False)
        else:
            self.gate = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
            self.up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = MLP(fused)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.h = nn.ModuleList(Block(fused) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def sample_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
