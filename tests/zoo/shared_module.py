"""A transformer whose last block reuses the first block's MLP module (parameters shared by two non-adjacent
blocks, as in weight-shared or "looped" layers): FSDP2 manages a parameter in one unit only, so such blocks are
wrapped together."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, SEQ, LAYERS = 64, 32, 4, 16, 4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, mlp=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.k = nn.Linear(HIDDEN, HIDDEN)
        self.v = nn.Linear(HIDDEN, HIDDEN)
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = mlp if mlp is not None else MLP()

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, t, HEADS, c // HEADS).transpose(1, 2)
        k = self.k(h).view(b, t, HEADS, c // HEADS).transpose(1, 2)
        v = self.v(h).view(b, t, HEADS, c // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        first = Block()
        self.blocks = nn.ModuleList([first] + [Block() for _ in range(LAYERS - 2)] + [Block(mlp=first.mlp)])
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model():
    return Model()


def sample_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]
