"""A language model whose head is the root's own `F.linear(x, self.wte.weight)`: no module owns the head, so the
embedding weight is read by the root's code in the last pipeline stage (tied across stages through the stage
graph's own read), and under tp by DTensor code there (its gradient arrives as a DTensor on a plain parameter)."""
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ, LAYERS = 64, 32, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def build_model():
    return Model()


def sample_batch(batch_size):
    import torch
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]
