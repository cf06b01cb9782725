"""What the planner's trace and the executor both do to a model before training it (`planner.model_file`):
a model built in 16 bits (`.to(torch.bfloat16)`) is held as fp32 master weights with fp32 Adam state, the precision
every plan prices (`hold_fp32`), its 16-bit batch tensors widened with it; a Hugging Face model's KV cache is
turned off (`prepare_for_training`); a model that cannot be built on meta is built on the CPU (`build`)."""
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
    assert len(graph.build_notes) == 1 and "bfloat16" in graph.build_notes[0]
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


ITEM_IN_INIT = """
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0, 0.1, 2)]  # a stochastic-depth schedule, as timm's ViTs
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2's head

    def forward(self, x):
        return self.head(torch.relu(self.emb(x)))

def build_model():
    return Net()

def sample_batch(batch_size):
    x = torch.randint(0, 32, (batch_size, 8))
    return x, x
"""


def test_a_model_that_cannot_be_built_on_meta_is_built_on_the_cpu(tmp_path, capsys):
    """Before: 'build_model() raised RuntimeError: Tensor.item() cannot be called on meta tensors', exit 2."""
    from planner.cli import main
    from planner.model_file import build
    path = tmp_path / "item_init.py"
    path.write_text(ITEM_IN_INIT)
    mf = load_model_file(str(path))
    model = build(mf, "meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.head.weight is model.emb.weight  # still tied (.to("meta") unties a CPU model's weights)
    again = build(mf, "meta")  # a copy of the first: the weights are not loaded again
    assert again is not model and again.head.weight is again.emb.weight and again.head.weight.device.type == "meta"
    out = tmp_path / "plan.json"
    assert main([str(path), "--cluster", "cpu-local", "--batch-size", "4", "-o", str(out)]) == 0 and out.exists()
    assert "note: build_model() fails on the meta device" in capsys.readouterr().out
    broken = tmp_path / "broken.py"  # a build that fails on the CPU too keeps its own one-line error
    broken.write_text(ITEM_IN_INIT.replace("return Net()", "raise ValueError('no config\\nsecond line')"))
    assert main([str(broken), "--cluster", "cpu-local", "--batch-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "build_model() raised ValueError: no config (line" in err[0], err


def test_a_hugging_face_model_with_its_kv_cache_on_is_traced_and_trained_without_it(tmp_path):
    """LlamaConfig's default use_cache=True (every from_pretrained checkpoint's): its training forward returns a
    DynamicCache, which torch.export refused ('cannot trace the model (torch.export: RuntimeError: Found <class
    'transformers.cache_utils.DynamicCache'> in output ...'), a message about control flow."""
    import pytest
    transformers = pytest.importorskip("transformers")
    from planner.trace import trace_model
    path = tmp_path / "hf_cache.py"
    path.write_text("""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def build_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))

def sample_batch(n):
    x = torch.randint(0, 64, (n, 9))
    return x[:, :-1], x[:, 1:]
""")
    mf = load_model_file(str(path))
    assert mf.build_model().config.use_cache is True
    graph = trace_model(mf, batch_size=2, progress=False)
    assert any("use_cache was on" in n for n in graph.build_notes)
    from executor import apply_plan
    from planner.plan import Mesh, Plan
    plan = Plan(mesh=Mesh(), global_batch_size=2, microbatch_size=2, num_microbatches=1, precision="fp32")
    started = not dist.is_initialized()
    try:
        model = mf.build_model()
        runner = apply_plan(model, plan, loss_fn=mf.loss_fn)
        loss = runner.step(*mf.sample_batch(2))
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
    assert model.config.use_cache is False and loss > 0
    assert any("use_cache was on" in n for n in runner.notes)
