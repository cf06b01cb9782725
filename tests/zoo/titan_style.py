"""A Llama written the torchtitan way: heads inferred with `view(bs, seqlen, -1, self.head_dim)`, complex RoPE
(`view_as_complex` times a complex64 `freqs_cis` buffer), grouped-query attention (2 key/value heads for 4 query
heads) with `repeat_kv` by unsqueeze/expand/reshape, `nn.RMSNorm`, layers in an `nn.ModuleDict`."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, N_HEADS, N_KV_HEADS, SEQ, N_LAYERS = 64, 32, 4, 2, 16, 2
MULTIPLE_OF, NORM_EPS, ROPE_THETA = 16, 1e-5, 10000.0


def precompute_freqs_cis(dim, end, theta=ROPE_THETA):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)  # complex64, (end, dim // 2)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    seqlen = xq_.shape[1]
    freqs_cis = freqs_cis[0:seqlen].view(1, seqlen, 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads = N_HEADS, N_KV_HEADS
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1, not n_heads: the local head count once tensor parallelism has sharded the projections
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        output = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = MULTIPLE_OF * ((hidden_dim + MULTIPLE_OF - 1) // MULTIPLE_OF)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward(DIM, 4 * DIM)
        self.attention_norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.ffn_norm = nn.RMSNorm(DIM, eps=NORM_EPS)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // N_HEADS, SEQ), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(N_LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def build_model():
    return Transformer()


def sample_batch(batch_size):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]
