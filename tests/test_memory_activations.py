"""Activation and model-state memory against closed forms: Korthikanti et al. 2022 per-layer activation bytes
(formulas.csv activation_memory_per_layer_*) on a hand-built Megatron GPT layer, and ZeRO's 16Psi family."""
from __future__ import annotations

import pytest

from cost_model.layers import LayerCoster
from cost_model.memory import in_flight, model_state_bytes
from cost_model.model import CostModel
from hardware_profiles.schema import Cluster, DeviceSpec, LinkSpec
from planner.defaults import megatron_placements
from planner.graph import OpGraph, OpNode, ParamInfo, TensorMeta
from planner.plan import Mesh, Plan

F32, BOOL = "float32", "bool"


def cluster(nodes: int = 1, per_node: int = 8, flops: float = 100e12, mem_bw: float = 2e12, intra: float = 200e9,
            inter: float = 25e9) -> Cluster:
    """A simple GPU-like cluster with flat efficiency curves."""
    dev = DeviceSpec(name="test-gpu", memory_bytes=80 * 2**30, usable_memory_fraction=0.9,
                     peak_flops={"bf16": flops, "fp16": flops, "fp32": flops / 8}, memory_bandwidth=mem_bw,
                     matmul_efficiency=((1e9, 0.8),), memory_efficiency=((1e6, 0.8),))
    return Cluster(name="test", nodes=nodes, devices_per_node=per_node, device=dev,
                   intra_node=LinkSpec(kind="nvswitch", bandwidth=intra, latency=3e-6),
                   inter_node=LinkSpec(kind="infiniband", bandwidth=inter, latency=5e-6))


class _G:
    """Builds ops of a hand-made graph."""

    def __init__(self) -> None:
        self.ops: list[OpNode] = []
        self.params: list[ParamInfo] = []

    def op(self, name, kind, inputs, in_shapes, out_shape, *, params=(), saved=(), flops=0, block=None,
           out_dtype=F32, module=None) -> str:
        ps = tuple(ParamInfo(f"{module or name}.{pn}", shp, F32) for pn, shp in params)
        self.params += ps
        ids = "int64" if kind == "embedding" else F32
        in_meta = tuple(TensorMeta(s, ids) for s in in_shapes) + tuple(TensorMeta(p.shape, F32) for p in ps)
        out = TensorMeta(out_shape, out_dtype)
        saved_meta = tuple(TensorMeta(s, d) for s, d in saved)
        nbytes_in = sum(m.bytes for m in in_meta)
        target, args = _call(name, kind, len(in_shapes), out_shape)
        self.ops.append(OpNode(name=name, kind=kind, target=target, module_path=module or name, inputs=tuple(inputs),
                               input_meta=in_meta, output_meta=(out,), fwd_flops=int(flops),
                               bwd_flops=int(2 * flops), bytes_read=nbytes_in, bytes_written=out.bytes,
                               params=ps, saved=saved_meta, block=block,
                               block_type="h.*" if block else None, args=args))
        return name


def _call(name: str, kind: str, n_in: int, out_shape) -> tuple[str, tuple]:
    """What an op of the hand-made graph calls, as a trace records it (target, arguments): real callables, so
    `planner.dtensor_rules` can check its candidate placements."""
    modules = {"linear": "torch.nn.Linear", "embedding": "torch.nn.Embedding", "norm": "torch.nn.LayerNorm"}
    if kind in modules:
        return modules[kind], ("T",)
    if kind == "reshape":
        return ("Tensor.transpose", ("T", 1, 2)) if name.endswith("transpose") else \
            ("Tensor.reshape", ("T", *out_shape))
    if kind == "matmul":  # scores = q k^T (k kept [b, a, s, d]), ctx = probs v
        return ("torch.einsum", ("bhsd,bhtd->bhst", "T", "T")) if name.endswith("scores") else \
            ("torch.matmul", ("T", "T"))
    if kind == "softmax":
        return "F.softmax", ("T", ("dim", -1))
    if "dropout" in name:
        return "F.dropout", ("T",)
    return ("operator.add", ("T", "T")) if n_in == 2 else ("F.gelu", ("T",))


def megatron_gpt(b: int = 1, s: int = 32, h: int = 64, a: int = 4, layers: int = 1, vocab: int = 128,
                 loss: bool = True) -> OpGraph:
    """A Megatron-style GPT with eager attention and dropout, saving exactly what Korthikanti et al. Sec 4.1 count;
    `loss`: ending in a cross-entropy op (a traced model's loss)."""
    g, d = _G(), h // a
    x = g.op("wte", "embedding", (), [(b, s)], (b, s, h), params=[("weight", (vocab, h))],
             saved=[((b, s), "int64")])
    for i in range(layers):
        blk, p = f"h.{i}", f"h{i}_"
        hs, hs4, heads, sc = (b, s, h), (b, s, 4 * h), (b, a, s, d), (b, a, s, s)
        ln1 = g.op(p + "ln1", "norm", [x], [hs], hs, params=[("w", (h,)), ("b", (h,))], saved=[(hs, F32)],
                   block=blk, module=f"{blk}.ln_1")
        qkv = []
        for j, nm in enumerate("qkv"):
            lin = g.op(p + nm, "linear", [ln1], [hs], hs, params=[("weight", (h, h)), ("bias", (h,))],
                       saved=[(hs, F32)] if j == 0 else [], flops=2 * b * s * h * h, block=blk,
                       module=f"{blk}.attn.{nm}_proj")
            v = g.op(p + nm + "_view", "reshape", [lin], [hs], (b, s, a, d), block=blk)
            qkv.append(g.op(p + nm + "_transpose", "reshape", [v], [(b, s, a, d)], heads, block=blk))
        scores = g.op(p + "scores", "matmul", qkv[:2], [heads, heads], sc, saved=[(heads, F32), (heads, F32)],
                      flops=2 * b * s * s * h, block=blk)
        soft = g.op(p + "softmax", "softmax", [scores], [sc], sc, saved=[(sc, F32)], block=blk)
        drop = g.op(p + "attn_dropout", "elementwise", [soft], [sc], sc, saved=[(sc, BOOL)], block=blk)
        ctx = g.op(p + "ctx", "matmul", [drop, qkv[2]], [sc, heads], heads, saved=[(sc, F32), (heads, F32)],
                   flops=2 * b * s * s * h, block=blk)
        t = g.op(p + "ctx_transpose", "reshape", [ctx], [heads], (b, s, a, d), block=blk)
        r = g.op(p + "ctx_view", "reshape", [t], [(b, s, a, d)], hs, block=blk)
        proj = g.op(p + "proj", "linear", [r], [hs], hs, params=[("weight", (h, h)), ("bias", (h,))],
                    saved=[(hs, F32)], flops=2 * b * s * h * h, block=blk, module=f"{blk}.attn.c_proj")
        d1 = g.op(p + "dropout1", "elementwise", [proj], [hs], hs, saved=[(hs, BOOL)], block=blk)
        add1 = g.op(p + "add1", "elementwise", [x, d1], [hs, hs], hs, block=blk)
        ln2 = g.op(p + "ln2", "norm", [add1], [hs], hs, params=[("w", (h,)), ("b", (h,))], saved=[(hs, F32)],
                   block=blk, module=f"{blk}.ln_2")
        fc1 = g.op(p + "fc1", "linear", [ln2], [hs], hs4, params=[("weight", (4 * h, h)), ("bias", (4 * h,))],
                   saved=[(hs, F32)], flops=8 * b * s * h * h, block=blk, module=f"{blk}.mlp.c_fc")
        gelu = g.op(p + "gelu", "elementwise", [fc1], [hs4], hs4, saved=[(hs4, F32)], block=blk)
        fc2 = g.op(p + "fc2", "linear", [gelu], [hs4], hs, params=[("weight", (h, 4 * h)), ("bias", (h,))],
                   saved=[(hs4, F32)], flops=8 * b * s * h * h, block=blk, module=f"{blk}.mlp.c_proj")
        d2 = g.op(p + "dropout2", "elementwise", [fc2], [hs], hs, saved=[(hs, BOOL)], block=blk)
        x = g.op(p + "add2", "elementwise", [add1, d2], [hs, hs], hs, block=blk)
    lnf = g.op("ln_f", "norm", [x], [(b, s, h)], (b, s, h), params=[("w", (h,)), ("b", (h,))],
               saved=[((b, s, h), F32)])
    g.op("lm_head", "linear", [lnf], [(b, s, h)], (b, s, vocab), params=[("weight", (vocab, h))],
         saved=[((b, s, h), F32)], flops=2 * b * s * h * vocab)
    if loss:  # cross-entropy over class ids, as `plan` traces a model's loss (what makes lm_head the LM head)
        logits, ids = TensorMeta((b, s, vocab), F32), TensorMeta((b, s), "int64")
        g.ops.append(OpNode(name="loss", kind="loss", target="cross_entropy", module_path="", inputs=("lm_head",),
                            input_meta=(logits, ids), output_meta=(TensorMeta((), F32),), fwd_flops=0,
                            bwd_flops=0, bytes_read=logits.bytes + ids.bytes, bytes_written=4,
                            saved=(TensorMeta((b, s, vocab), F32),)))
    return OpGraph(model_name="megatron-gpt", ops=tuple(g.ops), parameters=tuple(g.params), batch_size=b)


def _layer_act(graph: OpGraph, tp: int, sp: bool, recompute: str, mbs: int = 1) -> float:
    plan = Plan(mesh=Mesh(dp=1, tp=tp, pp=1), sequence_parallel=sp, recompute=recompute, global_batch_size=mbs,
                microbatch_size=mbs, num_microbatches=1, ops=megatron_placements(graph, tp, sp))
    cm = CostModel(cluster())
    coster = LayerCoster(cm, graph, plan, cm.tp_group(tp))
    block = [l for l in graph.layers() if l.block_type][0]
    return coster.cost(block).act_bytes


S, H, A = 32, 64, 4


def _autocast_fp32_extra(t, norm_shards):
    """Bytes the executor's bf16 autocast adds to the paper's 2-byte count: the two LayerNorms save their input in
    fp32 (sbh x 2 more bytes each, sharded under sequence parallelism) and the softmax its output (as^2 b x 2 more,
    split over heads) — torch AMP's fp32 op list."""
    return 2 * 2 * S * H / norm_shards + 2 * A * S * S / t


@pytest.mark.parametrize("t", [1, 2, 4])
def test_korthikanti_tensor_parallel(t):
    g = megatron_gpt(s=S, h=H, a=A)
    sbh = S * H
    want = sbh * (10 + 24 / t + 5 * A * S / (H * t))  # eq. (2); t=1 is eq. (1): sbh(34 + 5as/h)
    assert _layer_act(g, t, False, "none") == pytest.approx(want + _autocast_fp32_extra(t, 1))


@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_sequence_parallel(t):
    g = megatron_gpt(s=S, h=H, a=A)
    megatron = S * H / t * (34 + 5 * A * S / H)  # eq. (4)
    # the two norm outputs the column-parallel linears read gathered are saved as their shard (2sbh/t) and
    # gathered again in backward, as Megatron does (executor.tp.keep_shards)
    assert _layer_act(g, t, True, "none") == pytest.approx(megatron + _autocast_fp32_extra(t, t))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_selective_keeps_what_op_level_sac_caches(t):
    """The executor's selective recomputation is torchtitan's op-level SAC, not Korthikanti's: a block keeps its
    input and the outputs of its 1st, 3rd and 5th linears (bf16: q and v 2sh each, fc1 8sh), column-sharded over
    t. The input is the residual stream: fp32 on one device (4sh bytes: autocast over an fp32 embedding table),
    bf16 under tp (2sh: FSDP2's replicate computes with bf16 weights, `Plan.fsdp_mixed_precision`). With sequence
    parallelism the input is sharded too, and the policy also keeps the outputs of the block's reduce-scatters
    (functional reduce_scatter_tensor): the two row-parallel linears' bf16 partial sums (2sh/t each) and, in this
    first block, the vocabulary-parallel embedding's (2sh/t), which it reads directly."""
    g = megatron_gpt(s=S, h=H, a=A)
    residual = 4 if t == 1 else 2
    assert _layer_act(g, t, False, "selective") == pytest.approx(S * H * (residual + 12 / t))
    if t > 1:
        assert _layer_act(g, t, True, "selective") == pytest.approx(S * H * (2 + 12 + 2 + 2 * 2) / t)


def test_korthikanti_full_recompute_and_microbatch_scaling():
    # Korthikanti's 2sbh: the block input, bf16 under tp (FSDP2's bf16 weights); on one device 4 bytes, the fp32
    # residual stream of autocast over fp32 parameters
    g = megatron_gpt(s=S, h=H, a=A)
    assert _layer_act(g, 1, False, "full") == pytest.approx(4 * S * H)
    assert _layer_act(g, 2, False, "full", mbs=3) == pytest.approx(3 * 2 * S * H)
    assert _layer_act(g, 2, False, "none", mbs=4) == pytest.approx(4 * _layer_act(g, 2, False, "none"))


def test_megatron_layout_of_the_hand_graph():
    g = megatron_gpt()
    ops = megatron_placements(g, 2, True)
    strat = {k: v.strategy for k, v in ops.items()}
    assert [strat[f"h0_{n}"] for n in ("q", "k", "v", "proj", "fc1", "fc2")] == \
        ["colwise", "colwise", "colwise", "rowwise", "colwise", "rowwise"]
    assert strat["h0_scores"] == strat["h0_softmax"] == strat["h0_ctx"] == "heads"
    assert strat["h0_ln1"] == strat["h0_ln2"] == strat["h0_add2"] == "sequence"
    assert strat["wte"] == "vocab" and strat["lm_head"] == "colwise"
    assert "h0_ln1" not in megatron_placements(g, 2, False)
    assert megatron_placements(g, 1, False) == {}


@pytest.mark.parametrize("precision,w,k", [("bf16", 2, 12), ("fp32", 4, 8)])
def test_zero_model_states(precision, w, k):
    psi, n = 7.5e9, 64
    total = {z: sum(model_state_bytes(psi, z, n, precision).values()) for z in range(4)}
    assert total[0] == pytest.approx((2 * w + k) * psi)  # 16 Psi
    assert total[1] == pytest.approx(2 * w * psi + k * psi / n)  # 4 Psi + 12 Psi / N
    assert total[2] == pytest.approx(w * psi + (w + k) * psi / n)  # 2 Psi + 14 Psi / N
    assert total[3] == pytest.approx((2 * w + k) * psi / n)  # 16 Psi / N
    if precision == "bf16":  # ZeRO Fig. 1 example: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
        assert [round(total[z] / 1e9, 1) for z in range(4)] == [120.0, 31.4, 16.6, 1.9]


def test_in_flight_micro_batches():
    p, m = 4, 8
    assert [in_flight("1f1b", p, 1, m, r)[0] for r in range(p)] == [4, 3, 2, 1]
    assert in_flight("gpipe", p, 1, m, 0)[0] == m
    assert in_flight("1f1b", 8, 1, 3, 0)[0] == 3
    for v in (2, 4):
        held = sum(in_flight("interleaved", p, v, m, 0).values())
        # chunk-micro-batches x layers per chunk (L / (p v)) = L (1 + (p-1)/(p v)) on the first stage
        assert held / (p * v) == pytest.approx(1 + (p - 1) / (p * v))


def test_sdpa_with_dropout_on_cpu_ranks_keeps_what_torchs_math_path_keeps():
    """torch runs SDPA with dropout on CPU as its math path (the CPU flash kernel takes no dropout): it keeps the
    probabilities, the dropout noise (fp32, at::dropout's input * noise) and the dropped-out probabilities, each
    (b, h, s, s); the model counted none of them (HF GPT-2, attention dropout 0.1, measured 12-23 % over the
    predicted peak on 2 CPU ranks, 2-5 % after). GPUs run fused kernels that keep none."""
    import torch
    import torch.nn.functional as F

    from hardware_profiles.load import load_cluster
    from planner.model_file import ModelFile, default_loss
    from planner.trace import trace_model
    b, h, s, d = 2, 4, 64, 32
    q = torch.randn(b, h, s, d, requires_grad=True)
    scores_saved = []

    def pack(t):
        if tuple(t.shape[-2:]) == (s, s):
            scores_saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    torch_bytes = sum(scores_saved)
    assert torch_bytes == 3 * b * h * s * s * 4  # probabilities, noise, dropped-out probabilities

    from gpt import GPT, GPTConfig, sample_batch  # examples/ is on sys.path (tests/conftest.py)
    extra = {}
    for dropout in (0.0, 0.1):
        cfg = GPTConfig(n_layer=1, n_embd=h * d, n_head=h, vocab_size=64, block_size=s, dropout=dropout)
        model_file = ModelFile(path="gpt.py", build_model=lambda: GPT(cfg),
                               sample_batch=lambda n: sample_batch(n, cfg), loss_fn=default_loss)
        g = trace_model(model_file, batch_size=1, progress=False)
        op = next(o for o in g.ops if o.kind == "attention")
        for name in ("cpu-local", "dgx-a100-80gb"):
            extra[dropout, name] = CostModel(load_cluster(name)).op_memory(op, None, 1, b, "fp32")[1]
    assert extra[0.1, "cpu-local"] - extra[0.0, "cpu-local"] == torch_bytes
    assert extra[0.1, "dgx-a100-80gb"] == extra[0.0, "dgx-a100-80gb"]  # FlashAttention keeps no s x s tensor


WEIGHT_NORM = '''
import torch, torch.nn as nn
from torch.nn.utils.parametrizations import weight_norm

def build_model():
    return nn.Sequential(weight_norm(nn.Linear(16, 64)), nn.ReLU(), weight_norm(nn.Linear(64, 64)), nn.ReLU(),
                         nn.Linear(64, 4))

def sample_batch(n):
    return torch.randn(n, 16), torch.randn(n, 4)
'''


def test_what_does_not_read_the_batch_does_not_grow_with_it(tmp_path):
    """A weight-norm weight (g * v / ||v||) is made from parameters each forward and saved by its linear: one per
    pass, whatever the micro-batch. Counted per sample, the audit's weight-norm MLP was predicted at 0.37 MiB
    peak on 2 CPU ranks at batch 32 and measured 0.14 (-62 %): its 'activations' were its weights x 16."""
    from hardware_profiles.load import load_cluster
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    path = tmp_path / "wn.py"
    path.write_text(WEIGHT_NORM)
    graph = trace_model(load_model_file(str(path)), batch_size=1, progress=False)
    free = [op for op in graph.ops if op.batch_free]
    assert free and all(op.module_path.startswith(("0", "2")) for op in free)  # the two weight norms' ops
    assert not any(op.batch_free for op in graph.ops if op.kind in ("linear", "loss"))
    assert [op.fixed_saved for op in graph.ops if op.kind == "loss"] == [()]  # its targets are the batch's
    fixed = sum(t.bytes for op in graph.ops for i, t in enumerate(op.saved) if i in op.fixed_saved)
    assert fixed >= 64 * 64 * 4  # the computed weight the second linear saves (the first needs no input gradient)
    # per sample: the linears' inputs and the ReLU outputs (and masks), not the weights
    assert graph.saved_bytes_per_sample() < 4 * (16 + 2 * 64 + 2 * 64) + 2 * 64 + 64
    cost = CostModel(load_cluster("cpu-local"))
    at = {mbs: sum(cost.op_memory(op, None, 1, mbs, "fp32")[1] for op in graph.ops) for mbs in (1, 32)}
    assert at[32] - at[1] == pytest.approx(31 * graph.saved_bytes_per_sample(), rel=1e-6)
    time = {mbs: sum(sum(cost.op_parts(op, None, 1, mbs, "fp32")[:2]) for op in free) for mbs in (1, 32)}
    assert time[32] == time[1] > 0
