"""Tracing the bundled examples: parameters, FLOPs against a real CPU run, saved activations, repeated blocks,
and the torch.export fallback."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from planner.graph import TensorMeta
from planner.model_file import batch, build, load_model_file
from planner.trace import trace_model

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
aten = torch.ops.aten


def _example(name: str):
    return load_model_file(os.path.join(EXAMPLES, f"{name}.py"))


_GRAPHS: dict[tuple[str, int], object] = {}


def _graph(name: str, batch_size: int = 2):
    """Trace once per (example, batch) for the whole module."""
    key = (name, batch_size)
    if key not in _GRAPHS:
        _GRAPHS[key] = trace_model(_example(name), batch_size)
    return _GRAPHS[key]


def _cpu_sdpa_fwd(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, q, k, v)


# FlopCounterMode knows the CUDA flash kernel but not its CPU twin; count the CPU kernel with the same formulas.
CPU_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_bwd}


def _real_flops(name: str, batch_size: int) -> tuple[int, int, int]:
    """(fwd, bwd, unique parameter count) of one real forward+backward on CPU."""
    mf = _example(name)
    torch.manual_seed(0)
    model = build(mf, "cpu")
    model.train()
    inputs, targets = batch(mf, batch_size)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        if isinstance(inputs, dict):
            out = model(**inputs)
        elif isinstance(inputs, (tuple, list)):
            out = model(*inputs)
        else:
            out = model(inputs)
        loss = mf.loss_fn(out, targets)
        fwd = counter.get_total_flops()
        loss.backward()
        bwd = counter.get_total_flops() - fwd
    return fwd, bwd, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp", "resnet"])
def test_flops_and_parameters_match_a_real_run(name):
    graph = _graph(name)
    fwd, bwd, params = _real_flops(name, 2)
    assert graph.num_parameters == params
    assert sum(op.fwd_flops for op in graph.ops) == fwd
    assert sum(op.bwd_flops for op in graph.ops) == bwd
    assert fwd > 0 and bwd > fwd
    assert graph.flops_per_sample() == (fwd + bwd) / 2


def test_gpt3_175b_config_parameter_count():
    """The 175B file builds on meta: its unique parameter count equals the formula for GPT with tied embeddings."""
    mf = _example("gpt3_175b")
    model = build(mf, "meta")
    h, layers, vocab, seq = 12288, 96, 51200, 2048
    per_layer = 12 * h * h + 13 * h  # qkv+proj (4h^2+4h), mlp (8h^2+5h), two LayerNorms (4h)
    expected = layers * per_layer + vocab * h + seq * h + 2 * h
    assert sum(p.numel() for p in model.parameters()) == expected


def test_mlp_saved_activations_equal_hand_count():
    graph = _graph("mlp", 4)
    # fc1 saves x (64), relu1 its output (256, also fc2's input: once), relu2 its output (256, also fc3's input),
    # cross-entropy its log-softmax (10 classes) and the int64 targets; plus nll_loss's scalar total_weight.
    b = 4
    expected = b * (64 + 256 + 256 + 10) * 4 + b * 8 + 4
    assert sum(op.saved_bytes for op in graph.ops) == expected
    kinds = [op.kind for op in graph.ops]
    assert kinds == ["linear", "elementwise", "linear", "elementwise", "linear", "loss"]


def test_tensor_saved_by_several_ops_is_counted_once():
    graph = _graph("gpt")
    q, k, v = (graph.module_op(f"h.0.attn.{p}_proj") for p in "qkv")
    ln_out = graph.module_op("h.0.ln_1").output_meta[0]
    assert ln_out in q.saved  # the LayerNorm output is listed at its first reader ...
    assert k.saved == () and v.saved == ()  # ... and not again
    attn = graph.op("scaled_dot_product_attention")
    assert attn.kind == "attention"
    # flash attention keeps q, k, v (whole projection outputs), the output and the log-sum-exp, not s x s scores
    assert all(len(t.shape) < 4 or t.shape[-1] != t.shape[-2] for t in attn.saved)


def test_gpt_blocks_layers_and_tied_weights():
    graph = _graph("gpt")
    assert graph.tracer == "export"
    assert graph.block_types == {"h.*": ("h.0", "h.1", "h.2", "h.3")}
    layers = graph.layers()
    assert [layer.name for layer in layers] == ["pre", "h.0", "h.1", "h.2", "h.3", "post"]
    add = graph.op("add_1")  # the first residual add inside h.0 is a functional op, labelled by its module path
    assert (add.block, add.block_type, add.kind, add.module_path) == ("h.0", "h.*", "elementwise", "h.0")
    lm_head = graph.module_op("lm_head")
    assert [p.name for p in lm_head.params] == ["wte.weight"]
    assert [p.name for p in graph.module_op("wte").params] == ["wte.weight"]
    names = [p.name for p in graph.parameters]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names
    assert graph.ops[-1].kind == "loss" and graph.ops[-1].inputs == (lm_head.name,)
    assert {op.kind for op in graph.ops} >= {"embedding", "norm", "linear", "attention", "reshape", "loss"}


def test_gpt_dropout_as_megatron_places_it():
    """GPTConfig(dropout=p) adds dropout on the embeddings and both residual branches and passes it to SDPA (the
    unfused attention's dropout pass); dropout 0 adds no op."""
    import sys
    sys.path.insert(0, EXAMPLES)
    from cost_model.work import attention_dropout
    from gpt import GPT, GPTConfig, sample_batch
    from planner.model_file import ModelFile, default_loss

    def traced(p):
        cfg = GPTConfig(n_layer=2, dropout=p)
        return trace_model(ModelFile(path="gpt.py", build_model=lambda: GPT(cfg),
                                     sample_batch=lambda b: sample_batch(b, cfg), loss_fn=default_loss),
                           batch_size=2, progress=False)
    with_dropout, without = traced(0.1), traced(0.0)
    assert sum("dropout" in op.target for op in with_dropout.ops) == 1 + 2 * 2
    assert all(attention_dropout(op) for op in with_dropout.ops if op.kind == "attention")
    assert not any("dropout" in op.target or attention_dropout(op) for op in without.ops)


def test_llama_blocks_and_kinds():
    graph = _graph("llama")
    assert graph.block_types["layers.*"] == tuple(f"layers.{i}" for i in range(4))
    assert len(graph.block_types) == 1
    block_ops = [[op.target for op in graph.layer_ops(layer)] for layer in graph.layers() if layer.block_type]
    assert all(ops == block_ops[0] for ops in block_ops)  # identical blocks, identical op sequences


def test_resnet_blocks_and_inplace_relu():
    graph = _graph("resnet")
    assert graph.block_types == {"layer1.*": ("layer1.0", "layer1.1"), "layer2.*": ("layer2.1", "layer2.2")}
    assert {"conv", "norm", "pool", "linear"} <= {op.kind for op in graph.ops}


def test_fx_failure_falls_back_to_export_and_unused_parameters_are_kept(tmp_path):
    path = tmp_path / "branchy.py"
    path.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn

        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
                self.unused = nn.Linear(8, 3)

            def forward(self, x):
                if x.shape[0] > 1:  # python control flow on a shape: fx cannot trace it, export can
                    return self.fc(x) * 2
                return self.fc(x)

        def build_model():
            return Branchy()

        def sample_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
    """))
    graph = trace_model(load_model_file(str(path)), 3)
    assert graph.tracer == "export"
    assert [p.name for p in graph.parameters] == ["fc.weight", "fc.bias", "unused.weight", "unused.bias"]
    assert graph.num_parameters == 8 * 8 + 8 + 8 * 3 + 3
    linear = next(op for op in graph.ops if op.kind == "linear")
    assert linear.module_path == "fc" and linear.fwd_flops == 2 * 3 * 8 * 8
    assert graph.ops[-1].kind == "loss"


@pytest.mark.parametrize("mask", [False, True])
def test_grouped_query_attention_saves_k_and_v_as_flash_keeps_them(tmp_path, mask):
    # enable_gqa without a mask: flash reads the 2 shared k/v heads in place and saves them at that size (the
    # tracer used to expand them to the 8 query heads, 4x the k/v bytes); with a mask (here a sliding window) they
    # are expanded
    path = tmp_path / "gqa.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        class GQA(nn.Module):
            def __init__(self):
                super().__init__()
                self.q, self.kv = nn.Linear(64, 64), nn.Linear(64, 32)

            def forward(self, x):
                b, s, _ = x.shape
                q = self.q(x).view(b, s, 8, 8).transpose(1, 2)
                k, v = self.kv(x).view(b, s, 2, 2, 8).permute(2, 0, 3, 1, 4)
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril().triu(-4) if {mask} else None
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                return y.transpose(1, 2).reshape(b, s, 64)

        def build_model():
            return GQA()

        def sample_batch(batch_size):
            return torch.randn(batch_size, 16, 64), torch.randn(batch_size, 16, 64)
    """))
    graph = trace_model(load_model_file(str(path)), 2)
    attn = next(op for op in graph.ops if op.kind == "attention")
    expanded = [t for t in attn.saved if t.shape == (2, 8, 16, 8)]  # the output, and k and v where expanded
    assert len(expanded) == (3 if mask else 1)
    assert (TensorMeta((2, 16, 32), "float32") in attn.saved) == (not mask)  # the k/v projection's output
    assert attn.fwd_flops == 2 * (2 * 2 * 8 * 16 * 16 * 8)  # q k^T and p v over the 8 query heads either way


@pytest.mark.parametrize("name,block_type,count", [("hf_gpt2", "transformer.h.*", 2),
                                                    ("hf_llama", "model.layers.*", 2)])
def test_hugging_face_models_trace_with_export(name, block_type, count):
    pytest.importorskip("transformers")
    graph = trace_model(_example(name), 2)
    model = build(_example(name), "meta")
    assert graph.tracer == "export"
    assert graph.num_parameters == sum(p.numel() for p in model.parameters())
    assert len(graph.block_types[block_type]) == count
    assert sum(1 for op in graph.ops if op.kind == "attention") == count
    assert graph.flops_per_sample() > 6 * graph.num_parameters * 64 * 0.5


@pytest.mark.parametrize("tracers", [("export",), ("fx",)])
def test_integer_inputs_to_a_matmul_are_a_model_file_error(tmp_path, tracers):
    # meta tensors multiply int64 by float32 without a word; the real kernel refuses ("mat1 and mat2 must have the
    # same dtype"), so `plan` wrote a plan whose dry run passed and `plan measure` failed on the first step
    from planner.errors import ModelError
    path = tmp_path / "ints.py"
    path.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def build_model():
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        def sample_batch(b):
            return torch.randint(0, 5, (b, 8)), torch.randint(0, 3, (b,))
    """))
    with pytest.raises(ModelError, match=r"ints.py: forward\(\) failed on the inputs from sample_batch\(\).* dtype "
                                         r"int64.*float32 inputs where they reach a matmul .*token ids"):
        trace_model(load_model_file(str(path)), tracers=tracers)
    # float64 inputs to float32 weights: the same (autocast never casts float64; plan check passed, measure failed)
    path.write_text(path.read_text().replace("torch.randint(0, 5, (b, 8))", "torch.randn(b, 8, dtype=torch.float64)"))
    with pytest.raises(ModelError, match=r"dtype float64, which it cannot multiply with the float32 weights; make "
                                         r"sample_batch return float32 inputs where they reach a matmul \(e.g. "
                                         r"\.float\(\)\)$"):
        trace_model(load_model_file(str(path)), tracers=tracers)


USER_CHECKPOINT = '''
import torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint as ckpt

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        x = ckpt(self.blocks[0], x, use_reentrant=False)
        x = ckpt(self.blocks[1], x, use_reentrant=True)
        return self.blocks[2](x)

def build_model():
    return M()

def sample_batch(b):
    return torch.randn(b, 16), torch.randn(b, 16)
'''


def test_the_models_own_checkpoint_calls_are_counted_and_said(tmp_path):
    """torch.export inlines a checkpointed block's ops with no trace of the call, so the memory model keeps their
    activations; the tracer counts the calls (non-reentrant and reentrant, under whatever name the model imported
    checkpoint) and the search says what that means."""
    import warnings

    import torch.utils.checkpoint as cp

    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.search import search
    path = tmp_path / "user_ckpt.py"
    path.write_text(USER_CHECKPOINT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reentrant checkpoint's "none of the inputs have requires_grad"
        graph = trace_model(load_model_file(str(path)), batch_size=2, progress=False)
    assert graph.checkpoint_calls == 2
    assert cp.CheckpointFunction.__name__ == "CheckpointFunction"  # put back
    cluster = load_cluster("cpu-local")
    notes = search(graph, cluster, CostModel(cluster), batch_size=4, precision="fp32", top_k=1).notes
    assert any(n.startswith("the model calls torch.utils.checkpoint itself (2 call(s) per forward)") for n in notes)
    plain = trace_model(load_model_file(os.path.join(EXAMPLES, "mlp.py")), batch_size=2, progress=False)
    assert plain.checkpoint_calls == 0
