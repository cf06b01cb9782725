"""A 1-D convolutional sequence tagger: Conv1d + GroupNorm + PReLU residual blocks over (batch, channels, time),
a per-step Linear head over the transposed features. Cut by pp=2 between its blocks, the first stage's output
gradient arrives in a buffer torch gives channels-last strides, which gloo cannot receive into."""
import torch
import torch.nn as nn

CH, T, CLASSES, LAYERS = 16, 16, 8, 3


class ResBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(CH, CH, 3, padding=1)
        self.norm = nn.GroupNorm(4, CH)
        self.act = nn.PReLU()

    def forward(self, x):
        return x + self.act(self.norm(self.conv(x)))


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Conv1d(4, CH, 1)
        self.blocks = nn.ModuleList([ResBlock() for _ in range(LAYERS)])
        self.out = nn.Linear(CH, CLASSES)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h.transpose(1, 2))


def build_model():
    return Tagger()


def sample_batch(batch_size):
    return torch.randn(batch_size, 4, T), torch.randint(0, CLASSES, (batch_size, T))
