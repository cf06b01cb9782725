"""planner.exporting: a constant causal SDPA mask becomes is_causal=True in the exported graph (the graph both the
planner traces and the executor runs); every other mask stays, and the program computes what the model does."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.exporting import export_training

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class Attn(nn.Module):
    """One attention call over a mask built the way `kind` says."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        causal = i[None, :] <= i[:, None]  # as transformers builds it: key index <= query index
        if self.kind == "bool":
            mask = causal[None, None].expand(b, 1, s, s)
        elif self.kind == "float":
            mask = torch.zeros(s, s, device=x.device).masked_fill(~causal, float("-inf"))
        elif self.kind == "window":
            mask = causal & (i[:, None] - i[None, :] < 4)
        elif self.kind == "padding":
            mask = causal[None, None] & pad[:, None, None, :].bool()
        else:
            mask = causal.T  # anti-causal: the upper triangle
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2).reshape(b, s, 32)


def _sdpa(ep: torch.export.ExportedProgram) -> torch.fx.Node:
    return next(n for n in ep.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_constant_causal_mask_becomes_is_causal_and_its_construction_goes(kind):
    torch.manual_seed(0)
    model, x = Attn(kind), torch.randn(2, 16, 32)
    ep = export_training(model, (x,), {})
    sdpa = _sdpa(ep)
    assert sdpa.args[3] is None and sdpa.args[5] is True
    assert not any(n.target is torch.ops.aten.arange.default for n in ep.graph.nodes)  # the mask's ops erased
    torch.testing.assert_close(ep.module()(x), model(x))


@pytest.mark.parametrize("kind", ["window", "upper", "padding"])
def test_a_mask_that_is_not_plain_causal_or_reads_an_input_stays(kind):
    torch.manual_seed(0)
    model, x = Attn(kind), torch.randn(2, 16, 32)
    pad = torch.ones(2, 16, dtype=torch.long)
    args = (x, pad) if kind == "padding" else (x,)
    ep = export_training(model, args, {})
    sdpa = _sdpa(ep)
    assert isinstance(sdpa.args[3], torch.fx.Node) and not (len(sdpa.args) > 5 and sdpa.args[5])
    torch.testing.assert_close(ep.module()(*args), model(*args))


def test_the_rewrite_evaluates_masks_inside_fake_tensor_mode():
    # the dry run exports under a fake tensor mode: the mask is still evaluated on real tensors
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = Attn("bool")
        ep = export_training(model, (mode.from_tensor(torch.randn(2, 16, 32)),), {})
    assert _sdpa(ep).args[5] is True


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_transformers_models_export_the_attention_eager_runs(name):
    # transformers builds the causal mask under torch.export but passes is_causal=True in eager; the exported graph
    # (which tp and pp plans run, and which the planner prices) now makes the same call, bit for bit the same output
    pytest.importorskip("transformers")
    sys.path.insert(0, EXAMPLES)
    try:
        example = __import__(name)
    finally:
        sys.path.remove(EXAMPLES)
    model = example.build_model()
    inputs, _ = example.sample_batch(2)
    ep = export_training(model, (), inputs)
    sdpa = [n for n in ep.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa and all(n.args[3] is None and n.args[5] is True for n in sdpa)
    torch.manual_seed(0)
    want = model(**inputs).logits
    torch.manual_seed(0)
    got = ep.module()(**inputs)
    torch.testing.assert_close(getattr(got, "logits", got), want, rtol=0, atol=0)
