"""cost_model.ops: the layout-free graph facts the cost model prices by. The LM head is the linear the loss reads
(whatever the model's structure); selective recomputation's kept ops, read off the graph's op order, are the ones
the executor's SAC policy (executor.parallel.selective_context) keeps when the block actually runs."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cost_model.ops import lm_head, sac_class, sac_kept, vocab_embedding
from planner.model_file import ModelFile, default_loss, load_model_file
from planner.trace import trace_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, T, HEADS = 16, 8, 2


class Block(nn.Module):
    """Every pattern the policy tells apart: linears (addmm), a bias-free linear (mm), a hand-written attention
    (batched score matmuls, softmax), SDPA, a folding `x @ W` matmul with a parameter, and a full `max`."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H)
        self.proj = nn.Linear(H, H, bias=False)
        self.w = nn.Parameter(torch.randn(H, 2 * H) / H)
        self.out = nn.Linear(2 * H, H)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).split(H, dim=-1)
        heads = lambda t: t.view(t.shape[0], T, HEADS, H // HEADS).transpose(1, 2)  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        eager = torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = (eager + fused).transpose(1, 2).reshape(x.shape[0], T, H)
        x = x + self.proj(y)
        return x + self.out(torch.relu(x @ self.w)) / x.max()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(H, 5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model_file() -> ModelFile:
    return ModelFile(path=os.path.join(ROOT, "tests", "test_cost_ops.py"), build_model=Model,
                     sample_batch=lambda n: (torch.randn(n, T, H), torch.randint(0, 5, (n, T))),
                     loss_fn=default_loss)


def _policy_decisions(block: nn.Module, x: torch.Tensor) -> list[tuple[str, bool]]:
    """(kind, kept) for every op the executor's selective policy counts or always saves, in the order it sees them
    when the block runs checkpointed: "mm" for mm/addmm, "save" for the always-kept kernels."""
    from torch.utils import checkpoint as ckpt

    from executor import parallel
    seen: list[tuple[str, bool]] = []
    matmuls, saved = parallel._aten_ops(parallel.SAC_MATMUL_OPS), parallel._aten_ops(parallel.SAC_SAVED_OPS)
    make = ckpt.create_selective_checkpoint_contexts

    def spying(policy):
        def spy(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute and (op in matmuls or op in saved):
                seen.append(("mm" if op in matmuls else "save", decision == ckpt.CheckpointPolicy.MUST_SAVE))
            return decision
        return make(spy)
    ckpt.create_selective_checkpoint_contexts = spying
    try:
        out = ckpt.checkpoint(block, x, use_reentrant=False, context_fn=parallel.selective_context)
    finally:
        ckpt.create_selective_checkpoint_contexts = make
    out.sum().backward()
    return seen


def test_sac_kept_is_what_the_executor_policy_keeps():
    graph = trace_model(_model_file(), batch_size=2, progress=False)
    block = next(l for l in graph.layers() if l.block_type is not None)
    kept = sac_kept(graph, block.ops)
    predicted = [(sac_class(graph.ops[i]), i in kept) for i in block.ops if sac_class(graph.ops[i])]
    torch.manual_seed(0)
    actual = _policy_decisions(Block(), torch.randn(2, T, H, requires_grad=True))
    assert predicted == actual
    # qkv, proj, x @ w, out: four mm/addmm, the 1st and 3rd kept; the batched score matmuls are neither
    assert [c for c, _ in predicted].count("mm") == 4 and ("save", True) in predicted


def test_lm_head_is_the_linear_the_loss_reads():
    graph = trace_model(_model_file(), batch_size=2, progress=False)
    assert graph.op(lm_head(graph)).module_path == "head"
    mlp = trace_model(load_model_file(os.path.join(ROOT, "examples", "mlp.py")), batch_size=2, progress=False)
    assert mlp.op(lm_head(mlp)).module_path == "4"  # no blocks: the classifier's last Linear all the same
    assert vocab_embedding(mlp) is None


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_examples_lm_head_and_vocabulary(example):
    graph = trace_model(load_model_file(os.path.join(ROOT, "examples", example)), batch_size=2, progress=False)
    head = graph.op(lm_head(graph))
    vocab = graph.op(vocab_embedding(graph))
    assert head.kind == "linear" and head.block is None
    assert head.output_meta[0].shape[-1] == vocab.params[0].shape[0]  # logits over the embedding's vocabulary
