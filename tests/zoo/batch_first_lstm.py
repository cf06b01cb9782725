"""A word-level LSTM language model as PyTorch's examples write it, batch first: the LSTM's output is a transposed
view (not contiguous), and under pp=2 it is what the first stage sends (gloo sends only contiguous tensors)."""
import torch
import torch.nn as nn

VOCAB, D, SEQ = 1024, 32, 8  # the head outweighs the LSTM: pp=2 cuts between them


class RNNLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, D)
        self.rnn = nn.LSTM(D, D, num_layers=2, batch_first=True)
        self.decoder = nn.Linear(D, VOCAB)

    def forward(self, x):
        out, _ = self.rnn(self.encoder(x))
        return self.decoder(out)


def build_model():
    return RNNLM()


def sample_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]
