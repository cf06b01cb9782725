"""A language model with an auxiliary loss, as mixture-of-experts code carries its balancing term: each block
returns (x, aux) with aux a 0-dim tensor, the model returns a dict of logits and aux, and the targets are a dict
(labels and a per-token weight) read by the file's own `loss_fn`. Under pipelining the aux crosses stage boundaries
beside x, and the schedule must neither concatenate the 0-dim outputs nor split the dict targets as a tensor. The
head is the root's own `F.linear(x, self.tok.weight)`: no module owns it, so the last stage's graph reads the
embedding weight itself (tied across stages), and under tp DTensor code reads a plain parameter (its gradient
arrives as a DTensor)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ, LAYERS = 64, 32, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x, aux):
        h = F.gelu(self.fc(self.ln(x)))
        return x + self.proj(h), aux + h.pow(2).mean()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, idx):
        x, aux = self.tok(idx), torch.zeros((), device=idx.device)
        for block in self.blocks:
            x, aux = block(x, aux)
        return {"logits": F.linear(self.ln_f(x), self.tok.weight), "aux": aux}


def build_model():
    return Model()


def sample_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], {"labels": ids[:, 1:], "weight": torch.rand(batch_size, SEQ)}


def loss_fn(outputs, targets):
    ce = F.cross_entropy(outputs["logits"].flatten(0, 1), targets["labels"].flatten(), reduction="none")
    return (ce * targets["weight"].flatten()).mean() + 0.01 * outputs["aux"]
