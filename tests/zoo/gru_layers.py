"""Stacked GRUs as separate modules (an nn.GRU per layer in a ModuleList), no dropout: under tp only the head is
sharded, and the GRUs run replicated on plain tensors, the ModuleList (an empty-graph module once unflattened from
torch.export) holding them never called."""
import torch
import torch.nn as nn

VOCAB, D, SEQ, NL = 128, 64, 16, 3


class GRULM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(nn.GRU(D, D, batch_first=True) for _ in range(NL))
        self.out = nn.Linear(D, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)[0]
        return self.out(h)


def build_model():
    return GRULM()


def sample_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]
