"""A model built in 16 bits (`.to(torch.bfloat16)`) is planned and trained as fp32 master weights with fp32 Adam
state, the precision every plan prices (`planner.model_file.hold_fp32`): the trace, the dry run and the executor
widen it alike, its 16-bit batch tensors with it."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.model_file import hold_fp32, load_model_file, widen_floats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

CNN = """
import torch, torch.nn as nn

def build_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).to(torch.bfloat16)

def sample_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, 8, 8, generator=g).bfloat16(), torch.randint(0, 10, (batch_size,), generator=g)
"""


def test_16_bit_parameters_and_buffers_become_fp32_ties_and_flags_kept():
    from gpt import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)).to(torch.bfloat16)
    model.register_buffer("table", torch.ones(4, dtype=torch.float16))
    model.register_buffer("counts", torch.zeros(2, dtype=torch.int64))
    model.register_buffer("exact", torch.zeros(2, dtype=torch.float64))
    model.wpe.weight.requires_grad_(False)
    note = hold_fp32(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight  # still tied
    assert not model.wpe.weight.requires_grad and model.wte.weight.requires_grad
    assert model.table.dtype == torch.float32
    assert model.counts.dtype == torch.int64 and model.exact.dtype == torch.float64
    elems = sum(p.numel() for p in model.parameters())
    assert note.startswith(f"the model holds {elems / 1e6:.3g}M bfloat16 parameters") and "fp32 master" in note
    assert hold_fp32(model) is None  # nothing left to widen
    x = {"img": torch.ones(2, dtype=torch.bfloat16), "ids": torch.ones(2, dtype=torch.int64), "p": 0.5}
    out = widen_floats(x)
    assert out["img"].dtype == torch.float32 and out["ids"].dtype == torch.int64 and out["p"] == 0.5


def test_a_bf16_built_model_with_bf16_inputs_traces_and_is_noted(tmp_path, capsys):
    """Before, tracing a bf16-built CNN fed bf16 images failed ("Input type (c10::BFloat16) and bias type (float)")
    once its parameters were widened, and before that the plan priced fp32 weights the executor never held."""
    from planner.cli import main
    from planner.trace import trace_model
    path = tmp_path / "bf16_cnn.py"
    path.write_text(CNN)
    graph = trace_model(load_model_file(str(path)), batch_size=2, progress=False)
    assert {p.dtype for p in graph.parameters} == {"float32"}
    assert [t.dtype for t in graph.inputs] == ["float32"]
    assert graph.widened and "bfloat16" in graph.widened
    out = tmp_path / "plan.json"
    code = main([str(path), "--cluster", "cpu-local", "--batch-size", "4", "-o", str(out), "--force", "dp=1,pp=1",
                 "--precision", "fp32"])
    assert code == 0 and out.exists()
    said = capsys.readouterr().out
    assert "note: the model holds" in said and "fp32 master weights" in said
    assert "every tensor in fp32 (no autocast)" in said and "under fp32 autocast" not in said  # (it said that)


def test_the_executor_holds_what_the_plan_priced():
    """One process: the bf16-built GPT trains with fp32 parameters and Adam state, its measured peak that of the
    same GPT built in fp32 (before: half of it, every category, against the plan's prediction)."""
    from executor import apply_plan
    from gpt import GPT, GPTConfig, sample_batch
    from planner.plan import Mesh, Plan
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    plan = Plan(mesh=Mesh(), global_batch_size=4, microbatch_size=4, num_microbatches=1, precision="fp32")
    started = not dist.is_initialized()
    peaks, runners, losses = {}, {}, {}
    try:
        for built in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            runner = runners[built] = apply_plan(GPT(cfg).to(built), plan,
                                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
            torch.manual_seed(1)
            losses[built] = [runner.step(*sample_batch(4, cfg)) for _ in range(4)]
            peaks[built] = runner.measurement(warmup=1)["memory_bytes"]
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
    wide = runners[torch.bfloat16]
    model = wide.parts[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s.dtype == torch.float32 for st in wide.optimizer.state.values() for s in st.values() if s.dim())
    for cat in ("peak", "parameters", "optimizer_state"):
        assert peaks[torch.bfloat16][cat] == peaks[torch.float32][cat], (cat, peaks)
    assert any("bfloat16 parameters" in n for n in wide.notes) and not runners[torch.float32].notes
    assert all(isinstance(v, float) for v in losses[torch.bfloat16])
