"""The shape-aware compute model: GEMM tile/wave quantization, skinny GEMMs, causal attention, copies vs views,
the kernel floor and host overlap, measured shape tables, and the trace facts they rest on."""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cost_model import kernels
from cost_model.compute import ComputeModel
from cost_model.work import OpWork, op_work
from cost_model.model import CostModel
from hardware_profiles.load import load_cluster
from hardware_profiles.profile_dict import cluster_from_dict, cluster_to_dict
from hardware_profiles.schema import ProfileError
from planner.defaults import default_plan
from planner.model_file import ModelFile, default_loss
from planner.trace import trace_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A100 = load_cluster("dgx-a100-80gb").device
H100 = load_cluster("dgx-h100").device


def _model_file(make, shape: tuple[int, ...]) -> ModelFile:
    """A ModelFile for a small module (built by `make()`) taking one float tensor and returning a tensor."""
    return ModelFile(path=os.path.join(ROOT, "tests", "inline_model.py"), build_model=make,
                     sample_batch=lambda b: (torch.randn(b, *shape), torch.randn(b, *shape)),
                     loss_fn=lambda out, tgt: F.mse_loss(out, tgt))


# ---- GEMMs --------------------------------------------------------------------------------------------------------

def test_gemm_efficiency_drops_for_shapes_that_waste_tiles_and_waves():
    aligned = kernels.gemm_efficiency(A100, (1, 4096, 4096, 4096))
    ragged = kernels.gemm_efficiency(A100, (1, 4097, 4097, 4097))
    assert ragged < 0.93 * aligned
    per_flop = lambda n: kernels.gemm_time(A100, (1, n, n, n), "bf16") / (2.0 * n ** 3)  # noqa: E731
    assert per_flop(4097) > 1.05 * per_flop(4096)
    # one wave of 108 SMs holding 64 tiles of 128x128 is ~40 % idle when K is too shallow to split
    assert kernels.gemm_efficiency(A100, (1, 1024, 1024, 128)) < 0.6 * A100.matmul.best_efficiency


def test_split_k_fills_the_sms_for_weight_gradients():
    # a weight gradient (M x N = in x out features, K = tokens) has too few output tiles for one wave: the K is split
    # so tiles x slices fill the SMs, each slice paying the pipeline fill, plus one fp32 round trip of the partials
    h200 = load_cluster("hgx-h200").device
    g = (1, 768, 768, 16384)  # GPT-2 124M's attention-projection weight gradient at 16 x 1024 tokens
    seconds, splits, e = kernels.gemm_plan(h200, g, "bf16")
    assert kernels.tile_count(1, 768, 768, (256, 128)) < h200.sms and splits > 1
    one = kernels.quantization(1, 768, 768, (256, 128), h200.sms)
    assert e > 3 * h200.matmul.best_efficiency * one * 16384 / (16384 + 192)
    fixup = kernels.memory_time(h200, 768 * 768 * (kernels.SPLIT_K_FIXUP_BYTES + 2))
    assert seconds == pytest.approx(2.0 * 768 * 768 * 16384 / (989e12 * e) + fixup)
    # `plan profile --model` timed it at 35.9 us on one H200 SXM (2026-11-27); priced without splitting, 89.8 us
    assert kernels.gemm_time(h200, g, "bf16") == pytest.approx(35.9e-6, rel=0.15)
    # enough tiles for a wave, or a K too shallow to split: one slice, as before
    assert kernels.gemm_plan(h200, (1, 16384, 768, 768), "bf16")[1] == 1
    assert kernels.gemm_plan(h200, (1, 768, 768, 128), "bf16")[1] == 1
    assert kernels.gemm_plan(h200, (1, 768, 768, 0), "bf16") == (0.0, 1, 0.0)  # an empty GEMM costs nothing


def test_skinny_gemm_is_memory_bound():
    g = (1, 8, 8192, 8192)
    nbytes = (8 * 8192 + 8192 * 8192 + 8 * 8192) * 2
    assert kernels.gemm_time(A100, g, "bf16") == pytest.approx(kernels.memory_time(A100, nbytes))
    square = (1, 4096, 4096, 4096)
    assert kernels.gemm_time(A100, square, "bf16") > kernels.memory_time(A100, 3 * 4096 * 4096 * 2)


def test_linear_gemm_shape_follows_tp_sharding():
    make = lambda: nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))  # noqa: E731
    g = trace_model(_model_file(make, (256, 1024)), 2, progress=False)
    op = next(o for o in g.ops if o.kind == "linear")
    from planner.plan import OpPlacement
    col = OpPlacement(strategy="colwise", inputs=("R",), output="S(2)", params=("S(0)", "S(0)"))
    row = OpPlacement(strategy="rowwise", inputs=("S(2)",), output="P", params=("S(1)", "R"))
    assert op_work(op, None, 1, 1.0, "bf16").gemms == ((1, 512, 4096, 1024),)
    assert op_work(op, col, 4, 1.0, "bf16").gemms == ((1, 512, 1024, 1024),)
    assert op_work(op, row, 4, 1.0, "bf16").gemms == ((1, 512, 4096, 256),)
    assert op_work(op, None, 1, 4.0, "bf16").gemms == ((1, 2048, 4096, 1024),)


# ---- attention ----------------------------------------------------------------------------------------------------

class _Attn(nn.Module):
    def __init__(self, causal: bool, explicit: bool = False):
        super().__init__()
        self.causal, self.explicit = causal, explicit
        self.qkv = nn.Linear(64, 192)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        if self.explicit:  # Megatron-LM 2021: scores materialised, softmax and dropout over s x s
            att = F.dropout((q @ k.transpose(-2, -1) / 4.0).softmax(-1), 0.1) @ v
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return att.transpose(1, 2).reshape(b, s, 64)


def test_trace_records_causal_attention():
    for causal in (True, False):
        g = trace_model(_model_file(lambda: _Attn(causal), (32, 64)), 1, progress=False)
        (op,) = [o for o in g.ops if o.kind == "attention"]
        assert op.causal is causal


def test_causal_attention_costs_about_half_of_dense_at_long_sequence():
    dense = kernels.attention_time(A100, (64, 8192, 8192, 128, False), 4.0 * 64 * 8192 ** 2 * 128, "bf16", False)
    causal = kernels.attention_time(A100, (64, 8192, 8192, 128, True), 4.0 * 64 * 8192 ** 2 * 128, "bf16", False)
    assert causal / dense == pytest.approx(0.5, abs=0.01)
    assert kernels.causal_fraction(8192, 8192, 1) == pytest.approx((8192 + 1) / (2 * 8192))
    # PyTorch's CPU flash kernel: 256-query x 512-key blocks at s = 1024 compute 6 of 8 blocks
    assert kernels.causal_fraction(1024, 1024, kernels.cpu_flash_q_split(1024), kernels.CPU_FLASH_KV_SPLIT) == 0.75
    # fused attention is priced at its own efficiency, not the GEMM's
    assert dense == pytest.approx(4.0 * 64 * 8192 ** 2 * 128 / (312e12 * 0.73), rel=0.02)


def test_explicit_matmul_attention_is_priced_by_its_parts():
    g = trace_model(_model_file(lambda: _Attn(False, explicit=True), (256, 64)), 2, progress=False)
    bmm = [o for o in g.ops if o.kind == "matmul"]
    assert [op_work(o, None, 1, 1.0, "bf16").gemms for o in bmm] == [((8, 256, 256, 16),), ((8, 256, 16, 256),)]
    cm = ComputeModel(A100)
    soft = next(o for o in g.ops if o.kind == "softmax")
    f, _ = cm.op_times("softmax", op_work(soft, None, 1, 64.0, "bf16"), "bf16")
    assert f >= kernels.memory_time(A100, 2 * 64 * 8 * 256 * 256 * 2) * 0.99  # reads and writes the scores


FA3_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
FA3_PUBLISHED = {
    # Shah et al. 2024 ("FlashAttention-3", Sec. 4.1), H100 SXM5, bf16, 16k tokens (batch 16384 / s), hidden 2048:
    # (kernel, head dim): (causal forward, backward without mask) TFLOP/s at FA3_SEQS
    ("cudnn", 128): ((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516)),
    ("flash2", 128): ((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322)),
    ("flash3", 128): ((292, 423, 521, 579, 602, 616), (316, 424, 501, 542, 559, 561)),
    ("cudnn", 64): ((225, 288, 334, 363, 379, 388), (266, 348, 395, 417, 432, 433)),
    ("flash2", 64): ((180, 229, 262, 284, 295, 299), (198, 238, 264, 279, 287, 291)),
    ("flash3", 64): ((197, 265, 371, 420, 460, 473), (272, 363, 422, 453, 472, 474)),
}


@pytest.mark.parametrize("preset", ["dgx-h100", "hgx-h200"])
def test_h100_attention_kernels_reproduce_the_published_times(preset):
    """Each kernel of the H100 (and H200) preset gives back the paper's TFLOP/s at every head dim and sequence
    length it published (causal FLOPs counted as half the dense)."""
    att = load_cluster(preset).device.attention
    assert att.kernel == "cudnn" and {k for k, _, _ in att.kernels} == {"cudnn", "flash2", "flash3"}
    for (name, d), (fwd_pub, bwd_pub) in FA3_PUBLISHED.items():
        dev = dataclasses.replace(H100, attention=load_cluster(preset).with_attention_kernel(name).device.attention)
        for s, pf, pb in zip(FA3_SEQS, fwd_pub, bwd_pub):
            bh = 16384 // s * (2048 // d)
            dense = 4.0 * bh * s * s * d
            fwd = kernels.attention_time(dev, (bh, s, s, d, True), dense, "bf16", False)
            bwd = kernels.attention_time(dev, (bh, s, s, d, False), 2.5 * dense, "bf16", True)
            assert dense / 2 / fwd / 1e12 == pytest.approx(pf, rel=0.02), (name, d, s)
            assert 2.5 * dense / bwd / 1e12 == pytest.approx(pb, rel=0.03), (name, d, s)


def test_attention_efficiency_interpolates_head_dim_and_sequence_in_log2_and_holds_beyond():
    att = load_cluster("dgx-h100").with_attention_kernel("flash3").device.attention
    e = att.efficiency
    assert e(128, False) == e(128, False, 2048) == att.forward_efficiency == e(256, False)
    assert e(64, False) < e(96, False) < e(128, False)
    assert e(128, False, 2048) < e(128, False, 2896) < e(128, False, 4096)
    assert e(128, True, 2896) == pytest.approx((e(128, True, 2048) + e(128, True, 4096)) / 2, rel=1e-3)
    assert e(128, False, 256) == e(128, False, 512) and e(128, False, 65536) == e(128, False, 16384)
    # between head dims 64 and 128 at 8k: the mean of the two columns at log2-midpoint 90.5
    assert e(90, False, 8192) == pytest.approx(0.5 * (e(64, False, 8192) + e(128, False, 8192)), rel=0.01)
    a100 = load_cluster("dgx-a100-80gb").device.attention  # no head-dim or length figures: one efficiency for all
    assert a100.efficiency(64, True, 512) == a100.efficiency(128, True, 8192) == a100.backward_efficiency


def test_attention_time_follows_the_sequence_length():
    """A causal call at 8k on the H100 preset does its (n+1)/(2n) blocks at the 8k figure, not the 2k one."""
    bh, d = 132, 128  # whole waves on 132 SMs at both lengths
    t = {s: kernels.attention_time(H100, (bh, s, s, d, True), 4.0 * bh * s * s * d, "bf16", False)
         for s in (2048, 8192)}
    att = H100.attention
    per_flop = {s: t[s] / (4.0 * bh * s * s * d * kernels.causal_fraction(s, s, 128)) for s in t}
    assert per_flop[2048] / per_flop[8192] == pytest.approx(att.efficiency(d, False, 8192) / att.forward_efficiency,
                                                            rel=1e-6)
    assert per_flop[2048] > per_flop[8192]


def test_attention_head_dims_round_trip_and_bad_values_name_the_field():
    d = cluster_to_dict(load_cluster("dgx-h100"))
    assert d["device"]["attention"]["kernels"]["cudnn"]["head_dims"] == {64: [0.37, 0.41]}
    d["device"]["attention"]["kernels"]["cudnn"]["head_dims"] = {64: [0.37]}
    with pytest.raises(ProfileError, match=r"device.attention.kernels.cudnn.head_dims.64: expected \[forward"):
        cluster_from_dict(d)
    d["device"]["attention"]["kernels"]["cudnn"]["head_dims"] = {64: [0.37, 1.7]}
    with pytest.raises(ProfileError, match=r"device.attention.kernels.cudnn.head_dims.64"):
        cluster_from_dict(d)
    flat = cluster_to_dict(load_cluster("dgx-a100-80gb"))
    flat["device"]["attention"].update(head_dim=64, head_dims={128: [0.8, 0.7]})
    att = cluster_from_dict(flat).device.attention
    assert (att.head_dim, att.head_dims, att.efficiency(128, False)) == (64, (("flash2", 128, 0.8, 0.7),), 0.8)
    assert cluster_from_dict(cluster_to_dict(cluster_from_dict(flat))) == cluster_from_dict(flat)


def test_attention_seq_lens_round_trip_and_bad_values_name_the_field():
    d = cluster_to_dict(load_cluster("dgx-h100"))
    assert d["device"]["attention"]["kernels"]["flash3"]["seq_lens"][128][8192] == [0.638, 0.583]
    assert cluster_from_dict(d) == load_cluster("dgx-h100")
    d["device"]["attention"]["kernels"]["flash3"]["seq_lens"][128][8192] = [0.6]
    with pytest.raises(ProfileError, match=r"device.attention.kernels.flash3.seq_lens.128.8192: expected \[forward"):
        cluster_from_dict(d)
    d["device"]["attention"]["kernels"]["flash3"]["seq_lens"][128] = [0.6, 0.5]
    with pytest.raises(ProfileError, match=r"device.attention.kernels.flash3.seq_lens: expected a mapping of head"):
        cluster_from_dict(d)
    flat = cluster_to_dict(load_cluster("dgx-a100-80gb"))
    flat["device"]["attention"].update(seq_len=4096, seq_lens={128: {1024: [0.5, 0.4]}})
    att = cluster_from_dict(flat).device.attention
    assert (att.seq_len, att.seq_lens) == (4096, (("flash2", 128, 1024, 0.5, 0.4),))
    assert (att.efficiency(128, False, 1024), att.efficiency(128, False, 4096)) == (0.5, att.forward_efficiency)
    assert cluster_from_dict(cluster_to_dict(cluster_from_dict(flat))) == cluster_from_dict(flat)
    flat["device"]["attention"]["seq_len"] = "4k"
    with pytest.raises(ProfileError, match=r"device.attention.seq_len: got the string"):
        cluster_from_dict(flat)


def test_attention_kernel_is_chosen_by_name_and_bad_names_are_errors():
    d = cluster_to_dict(load_cluster("dgx-h100"))
    d["device"]["attention"]["kernel"] = "flash2"
    att = cluster_from_dict(d).device.attention
    assert (att.kernel, att.forward_efficiency, att.backward_efficiency) == ("flash2", 0.33, 0.30)
    assert cluster_from_dict(cluster_to_dict(cluster_from_dict(d))) == cluster_from_dict(d)
    d["device"]["attention"]["kernel"] = "flash9"
    with pytest.raises(ProfileError, match=r"device.attention.kernel: 'flash9' is not one of .*cudnn, flash2"):
        cluster_from_dict(d)
    d["device"]["attention"]["kernel"] = "cudnn"
    d["device"]["attention"]["kernels"]["cudnn"] = {"forward_efficiency": 0.5}
    with pytest.raises(ProfileError, match="device.attention.kernels.cudnn.backward_efficiency: missing"):
        cluster_from_dict(d)
    flat = cluster_to_dict(load_cluster("dgx-a100-80gb"))["device"]["attention"]
    assert flat == {"forward_efficiency": 0.73, "backward_efficiency": 0.63, "block": 128, "kernel": "flash2"}


def test_unfused_attention_kernel_prices_sdpa_as_gemms_softmax_and_dropout_over_the_dense_scores():
    """`attention: {kernel: unfused}` (a run without FlashAttention, e.g. Megatron-LM in 2021): the SDPA call costs
    its two batched GEMMs over the dense scores (causal skips nothing) plus a softmax pass, a dropout pass when the
    call drops out, and their backward; the probabilities it keeps count as saved activations."""
    d = cluster_to_dict(load_cluster("dgx-a100-80gb", nodes=1))
    d["device"]["attention"] = {"kernel": "unfused"}
    cluster = cluster_from_dict(d)
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    dev = cluster.device
    cm = ComputeModel(dev)
    bh, s, hd, e = 8 * 16, 2048, 128, 2
    scores = bh * s * s
    qk, pv = (bh, s, s, hd), (bh, s, hd, s)
    gemms = kernels.gemm_time(dev, qk, "bf16") + kernels.gemm_time(dev, pv, "bf16")
    soft = kernels.memory_time(dev, 2 * e * scores)
    drop = kernels.memory_time(dev, (2 * e + 1) * scores)
    for causal in (True, False):
        assert cm.unfused_attention_time((bh, s, s, hd, causal), "bf16", False, False) == pytest.approx(gemms + soft)
    assert cm.unfused_attention_time((bh, s, s, hd, True), "bf16", False, True) == pytest.approx(gemms + soft + drop)
    bwd = cm.unfused_attention_time((bh, s, s, hd, True), "bf16", True, True)
    assert bwd > 2 * gemms and bwd > kernels.memory_time(dev, 3 * e * scores) + drop
    # far slower than FlashAttention-2 on the same causal call, which never writes the scores to memory
    flash = kernels.attention_time(A100, (bh, s, s, hd, True), 4.0 * bh * s * s * hd, "bf16", False)
    assert cm.unfused_attention_time((bh, s, s, hd, True), "bf16", False, False) > 3 * flash

    class Drop(_Attn):
        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).transpose(1, 2) \
                .reshape(b, n, 64)

    g = trace_model(_model_file(lambda: Drop(True), (256, 64)), 1, progress=False)
    (op,) = [o for o in g.ops if o.kind == "attention"]
    w = op_work(op, None, 1, 1.0, "bf16")
    assert w.dropout and w.attn == (4, 256, 256, 16, True)
    assert cm.op_times("attention", w, "bf16")[0] >= cm.unfused_attention_time(w.attn, "bf16", False, True)
    fused, unfused = CostModel(load_cluster("dgx-a100-80gb", nodes=1)), CostModel(cluster)
    extra = unfused.op_memory(op, None, 1, 1, "bf16")[1] - fused.op_memory(op, None, 1, 1, "bf16")[1]
    assert extra == 4 * 256 * 256 * (2 * 2 + 1)  # probabilities, mask and dropped-out probabilities


# ---- copies, views, floor, host -----------------------------------------------------------------------------------

class _Reshapes(nn.Module):
    def forward(self, x):
        t = x.transpose(1, 2)
        a = t.contiguous()                                     # copy
        b = torch.cat([x, x], dim=1)                           # copy
        c = x[:, None].expand(-1, 2, -1, -1).reshape(x.shape[0], -1, x.shape[2])  # expand + reshape: copy
        d = x.repeat_interleave(2, dim=1)                      # GQA-style key/value expansion: copy
        e = x.view(x.shape[0], -1)                             # view
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + t.sum()


def test_copies_cost_bytes_and_views_are_free():
    g = trace_model(_model_file(_Reshapes, (128, 64)), 1, progress=False)
    by_target = {o.name: o for o in g.ops if o.kind == "reshape"}
    copies = {n for n, o in by_target.items() if o.copies}
    assert {"contiguous", "cat", "reshape", "repeat_interleave"} <= copies
    assert {"transpose", "view", "expand"}.isdisjoint(copies)
    cm = ComputeModel(A100)
    for name, op in by_target.items():
        f, b, _, _ = cm.op_parts(op.kind, op_work(op, None, 1, 256.0, "bf16"), "bf16")
        if name in copies:
            assert f >= A100.kernel_floor and b > 0
        else:
            assert f == b == 0.0


def test_norm_backward_is_its_two_kernels():
    """A layer norm's backward runs the input-gradient kernel (read the output's gradient, the input and the
    weight; write the input's gradient) and, with affine parameters, the weight/bias-gradient kernel (read both
    again; write the parameters' gradients): 5 passes over the activation against forward's 2."""
    for affine in (True, False):
        g = trace_model(_model_file(lambda: nn.LayerNorm(64, elementwise_affine=affine), (128, 64)), 1,
                        progress=False)
        op = next(o for o in g.ops if o.kind == "norm")
        w = op_work(op, None, 1, 1.0, "fp32")
        n = 128 * 64 * 4.0
        params = 2 * 64 * 4.0 if affine else 0.0
        assert w.fwd_bytes == n + params + n
        assert w.bwd_bytes == (5 * n + 2 * params if affine else 3 * n)


def test_host_dispatch_overlaps_kernels_on_gpus_and_adds_on_cpus():
    cpu = dataclasses.replace(A100, async_host=False)
    assert ComputeModel(A100).combine(3.0, 2.0) == 3.0
    assert ComputeModel(cpu).combine(3.0, 2.0) == 5.0


def test_launch_floor_separates_micro_batch_sizes_of_a_small_gpt():
    """The issue's symptom: micro-batches of 1 and 8 of a small GPT on 8 A100 came out within 1 % per sample."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig, sample_batch
    cfg = GPTConfig(n_layer=2, n_embd=768, n_head=12, vocab_size=8192, block_size=512)
    mf = ModelFile(path=os.path.join(ROOT, "examples", "gpt.py"), build_model=lambda: GPT(cfg),
                   sample_batch=lambda b: sample_batch(b, cfg), loss_fn=default_loss)
    graph = trace_model(mf, 1, progress=False)
    cluster = load_cluster("dgx-a100-80gb")
    step = {}
    for mbs in (1, 8):
        plan = default_plan(graph, cluster, 64, "bf16", {"dp": 8, "tp": 1, "pp": 1, "zero": 0, "mbs": mbs,
                                                          "recompute": "none", "sp": 0}, "examples/gpt.py")
        step[mbs] = CostModel(cluster).predict(graph, plan).breakdown["compute_s"]
    assert step[1] > 1.2 * step[8]


# ---- profiles -----------------------------------------------------------------------------------------------------

def test_profiles_without_the_new_fields_still_load():
    d = cluster_to_dict(load_cluster("dgx-a100-80gb"))
    for k in ("sms", "matmul", "attention", "kernel_floor", "async_host", "matmul_shapes", "attention_shapes"):
        d["device"].pop(k, None)
    dev = cluster_from_dict(d).device
    assert dev.matmul is None and dev.attention is None and dev.kernel_floor == 0 and not dev.async_host
    assert ComputeModel(dev).gemm_time((1, 4096, 4096, 4096), "bf16") > 0


def test_new_fields_round_trip_and_bad_values_name_the_field():
    d = cluster_to_dict(load_cluster("dgx-h100"))
    d["device"]["matmul_shapes"] = [[1, 2048, 4096, 4096, "bf16", 1.0e-4]]
    d["device"]["attention_shapes"] = [[32, 2048, 2048, 128, True, "bf16", 3.0e-4, 8.0e-4]]
    c = cluster_from_dict(d)
    assert cluster_from_dict(cluster_to_dict(c)) == c
    d["device"]["attention_shapes"] = [[32, 2048, 2048, 128, "yes", "bf16", 3.0e-4, 8.0e-4]]
    with pytest.raises(ProfileError, match=r"device.attention_shapes\[0\]"):
        cluster_from_dict(d)
    d["device"]["attention_shapes"] = []
    d["device"]["matmul"] = {"tiles": [[256, 128]], "best_efficiency": 1.5}
    with pytest.raises(ProfileError, match="device.matmul.best_efficiency"):
        cluster_from_dict(d)


def test_measured_shape_tables_take_precedence():
    g = (1, 2048, 4096, 4096)
    dev = dataclasses.replace(A100, matmul_shapes=((*g, "bf16", 1.0e-3),),
                              attention_shapes=((32, 2048, 2048, 128, True, "bf16", 2.0e-3, 5.0e-3),))
    cm = ComputeModel(dev)
    assert cm.gemm_time(g, "bf16") == pytest.approx(1.0e-3)
    # one dimension away: the measurement scaled by the shape model's ratio
    g2 = (1, 4096, 4096, 4096)
    ratio = kernels.gemm_time(dev, g2, "bf16") / kernels.gemm_time(dev, g, "bf16")
    assert cm.gemm_time(g2, "bf16") == pytest.approx(1.0e-3 * ratio)
    assert cm.gemm_time((1, 4096, 8192, 4096), "bf16") == pytest.approx(kernels.gemm_time(dev, (1, 4096, 8192,
                                                                                            4096), "bf16"))
    flops = 4.0 * 32 * 2048 ** 2 * 128
    assert cm.attention_time((32, 2048, 2048, 128, True), flops, "bf16", False) == pytest.approx(2.0e-3)
    assert cm.attention_time((32, 2048, 2048, 128, True), 2.5 * flops, "bf16", True) == pytest.approx(5.0e-3)
    assert cm.attention_time((64, 2048, 2048, 128, True), 2 * flops, "bf16", False) == pytest.approx(4.0e-3,
                                                                                                     rel=0.02)


def test_gemms_are_looked_up_in_their_own_operand_layout():
    g = (1, 8192, 50257, 768)  # GPT-2's head: F.linear reads its [N, K] weight transposed ("nt")
    rows = ((*g, "bf16", 9.83e-3, "nn"), (*g, "bf16", 13.25e-3, "nt"), (1, 8192, 768, 50257, "bf16", 8.0e-3, "nn"),
            (1, 50257, 768, 8192, "bf16", 9.0e-3, "tn"))
    cm = ComputeModel(dataclasses.replace(H100, matmul_shapes=rows))
    assert cm.gemm_time(g, "bf16", "nt") == pytest.approx(13.25e-3)
    assert cm.gemm_time(g, "bf16", "nn") == pytest.approx(9.83e-3)
    # a layout the profile did not time falls back to the rows of any layout; so does a profile without layouts
    assert cm.gemm_time(g, "bf16", "tn") in (pytest.approx(9.83e-3), pytest.approx(13.25e-3))
    old = ComputeModel(dataclasses.replace(H100, matmul_shapes=((*g, "bf16", 9.83e-3),)))
    assert old.gemm_time(g, "bf16", "nt") == pytest.approx(9.83e-3)
    # an older profile's weight-gradient row (K, N, M) still prices the linear's (N, K, M): the same GEMM transposed
    assert old.gemm_time((1, 50257, 8192, 768), "bf16", "tn") == pytest.approx(9.83e-3)
    assert cm.gemm_time((1, 50257, 8192, 768), "bf16", "tn") != pytest.approx(9.83e-3)  # rows with layouts: not
    # the linear's forward is "nt", its input gradient dY W "nn" (M, K, N), its weight gradient dY^T x "tn" (N, K, M)
    work = OpWork(fwd_flops=2.0 * math.prod(g), bwd_flops=4.0 * math.prod(g), fwd_bytes=0, bwd_bytes=0, gemms=(g,),
                  gemm_layout="nt")
    f, b = cm._gemm_times(work, "bf16")
    assert f == pytest.approx(13.25e-3) and b == pytest.approx(8.0e-3 + 9.0e-3)


def test_a_linear_is_traced_with_the_layouts_torch_runs():
    from cost_model.work import backward_gemms, gemm_layout, graph_shapes
    from hardware_profiles import shapes as S
    from planner.model_file import load_model_file
    graph = trace_model(load_model_file(os.path.join(ROOT, "examples", "gpt.py")), 1)
    lin = next(o for o in graph.ops if o.kind == "linear")
    w = op_work(lin, None, 1, 1.0, "fp32")
    assert gemm_layout(lin) == w.gemm_layout == "nt"
    (b, m, n, k), = w.gemms
    assert backward_gemms((b, m, n, k), "nt") == (((b, m, k, n), "nn"), ((b, n, k, m), "tn"))
    assert backward_gemms((b, m, n, k)) == (((b, m, k, n), "nt"), ((b, k, n, m), "tn"))
    shapes, _ = graph_shapes(graph, limit=64)
    assert {(b, m, n, k, "nt"), (b, m, k, n, "nn"), (b, n, k, m, "tn")} <= set(shapes)
    # the probe stores the operands as the layout says and computes the same product
    for layout in ("nn", "nt", "tn"):
        a, x = S.gemm_operands(2, 5, 3, 4, layout, torch.float32, torch.device("cpu"))
        assert a.shape == (2, 5, 4) and x.shape == (2, 4, 3)
        assert a.is_contiguous() == (layout != "tn") and x.is_contiguous() == (layout != "nt")


def test_gemm_layouts_round_trip_in_a_profile_and_a_bad_one_is_named():
    d = cluster_to_dict(load_cluster("dgx-h100"))
    d["device"]["matmul_shapes"] = [[1, 2048, 4096, 4096, "bf16", 1.0e-4, "nt"], [1, 64, 64, 64, "bf16", 1.0e-6]]
    c = cluster_from_dict(d)
    assert c.device.matmul_shapes == ((1, 2048, 4096, 4096, "bf16", 1.0e-4, "nt"), (1, 64, 64, 64, "bf16", 1.0e-6))
    assert cluster_from_dict(cluster_to_dict(c)) == c
    d["device"]["matmul_shapes"] = [[1, 2048, 4096, 4096, "bf16", 1.0e-4, "tt"]]
    with pytest.raises(ProfileError, match=r"device.matmul_shapes\[0\]: layout 'tt' is not one of nn, nt, tn"):
        cluster_from_dict(d)


# ---- plan profile --model (CPU path, in process) ------------------------------------------------------------------

def test_profile_model_shapes_are_timed_and_preferred_on_cpu():
    from hardware_profiles import shapes as S
    from hardware_profiles.measure import plan_for
    from planner.cli import _model_shapes
    shapes = _model_shapes(os.path.join(ROOT, "examples", "gpt.py"), quick=True)
    assert len(shapes["gemms"]) == 6 and shapes["attentions"] == [(4, 64, 64, 32, True)]
    plan = plan_for(True, False)
    cpu = torch.device("cpu")
    rows = S.gemm_seconds(shapes["gemms"][:2], "fp32", cpu, lambda: None, plan)
    att = S.attention_seconds(shapes["attentions"], "fp32", cpu, lambda: None, plan)
    assert all(r[5] > 0 for r in rows) and att[0][6] > 0 and att[0][7] > 0
    dev = dataclasses.replace(load_cluster("cpu-local").device, matmul_shapes=tuple(rows),
                              attention_shapes=tuple(att))
    assert ComputeModel(dev).gemm_time(rows[0][:4], "fp32") == pytest.approx(rows[0][5])
    flops = 4.0 * 4 * 64 * 64 * 32  # no fused-attention model on CPU: the rows still win, and scale by b*h
    assert ComputeModel(dev).attention_time(att[0][:5], flops, "fp32", False) == pytest.approx(att[0][6])
    assert ComputeModel(dev).attention_time((8, *att[0][1:5]), 2 * flops, "fp32", True) == \
        pytest.approx(2 * att[0][7], rel=0.3)
    # the graph's own linear is priced from its measured forward GEMM (plus the profile's host overhead)
    mf = ModelFile(path=os.path.join(ROOT, "examples", "gpt.py"), build_model=lambda: _gpt(),
                   sample_batch=lambda b: _gpt_batch(b), loss_fn=default_loss)
    graph = trace_model(mf, 1, progress=False)
    lin = next(o for o in graph.ops if o.kind == "linear" and op_work(o, None, 1, 1.0, "fp32").gemms[0] ==
               rows[0][:4])
    kf, _, _, _ = ComputeModel(dev).op_parts("linear", op_work(lin, None, 1, 1.0, "fp32"), "fp32")
    assert kf == pytest.approx(rows[0][5])


def test_norms_are_timed_at_the_models_shapes_and_preferred():
    from cost_model.work import graph_norms
    from hardware_profiles import shapes as S
    from hardware_profiles.measure import plan_for
    from planner.cli import _model_shapes
    from planner.model_file import load_model_file
    graph = trace_model(load_model_file(os.path.join(ROOT, "examples", "gpt.py")), 1)
    assert graph_norms(graph) == [(64, 128, 2, "layer_norm")]  # 64 tokens x width 128, weight and bias
    assert graph_norms(graph, (1, 4)) == [(64, 128, 2, "layer_norm"), (256, 128, 2, "layer_norm")]
    assert _model_shapes(os.path.join(ROOT, "examples", "gpt.py"), quick=True)["norms"] == graph_norms(graph)
    rows = S.norm_seconds([(64, 128, 2, "layer_norm"), (64, 128, 1, "rms_norm"), (64, 128, 2, "rms_norm")],
                          torch.device("cpu"), lambda: None, plan_for(True, False))
    assert [r[:5] for r in rows] == [(64, 128, 2, "layer_norm", "fp32"), (64, 128, 1, "rms_norm", "fp32"),
                                     (64, 128, 2, "rms_norm", "fp32")]  # an RMS norm has no bias to time
    assert all(r[5] > 0 and r[6] > 0 for r in rows)
    # the graph's norm is priced from its row (kernels; host overhead apart), a longer one scaled by bytes
    row = (64, 128, 2, "layer_norm", "fp32", 3.0e-5, 9.0e-5)
    cm = ComputeModel(dataclasses.replace(load_cluster("cpu-local").device, norm_shapes=(row,)))
    ln = next(o for o in graph.ops if o.kind == "norm")
    f, b, _, _ = cm.op_parts("norm", op_work(ln, None, 1, 1.0, "fp32"), "fp32")
    assert (f, b) == (pytest.approx(3.0e-5), pytest.approx(9.0e-5))
    f4, _, _, _ = cm.op_parts("norm", op_work(ln, None, 1, 4.0, "fp32"), "fp32")
    assert f4 == pytest.approx(3.0e-5 * cm.memory_time(8 * 256 * 128) / cm.memory_time(8 * 64 * 128))
    # another width, or a norm without a bias, has no row: the bytes model as before
    plain = ComputeModel(load_cluster("cpu-local").device)
    assert cm.norm_time((64, 256, 2, "layer_norm"), "fp32", False) is None
    assert cm.norm_time((64, 128, 1, "layer_norm"), "fp32", True) is None
    assert cm.op_parts("norm", op_work(ln, None, 1, 1.0, "fp32"), "fp32") != \
        plain.op_parts("norm", op_work(ln, None, 1, 1.0, "fp32"), "fp32")


def test_bias_gradients_are_priced_and_timed_at_the_models_shapes():
    # addmm's backward sums the output gradient over its rows for the bias: one reduction kernel the GEMMs do not
    # include; the forward adds the bias in the GEMM's epilogue
    from cost_model.work import graph_bias_grads
    from hardware_profiles import shapes as S
    from hardware_profiles.measure import plan_for
    from planner.cli import _model_shapes
    from planner.model_file import load_model_file
    graph = trace_model(load_model_file(os.path.join(ROOT, "examples", "gpt.py")), 1)
    # 64 tokens: q, k, v and the projections write width 128, the MLP's first linear 512; the head has no bias
    assert graph_bias_grads(graph) == [(64, 128), (64, 512)]
    assert graph_bias_grads(graph, (1, 4))[2:] == [(256, 128), (256, 512)]
    assert _model_shapes(os.path.join(ROOT, "examples", "gpt.py"), quick=True)["reduces"] == graph_bias_grads(graph)
    rows = S.reduce_seconds([(64, 128)], "fp32", torch.device("cpu"), lambda: None, plan_for(True, False))
    assert rows[0][:3] == (64, 128, "fp32") and rows[0][3] > 0
    dev = dataclasses.replace(load_cluster("dgx-h100").device, reduce_shapes=())
    fc = next(o for o in graph.ops if o.kind == "linear" and o.module_path.endswith("c_fc"))
    head = next(o for o in graph.ops if o.kind == "linear" and o.module_path == "lm_head")
    w = op_work(fc, None, 1, 1.0, "bf16")
    assert w.bias_grad == (64, 512) and op_work(head, None, 1, 1.0, "bf16").bias_grad is None
    cm = ComputeModel(dev)
    _, b, _, _ = cm.op_parts("linear", w, "bf16")
    _, b0, _, _ = cm.op_parts("linear", dataclasses.replace(w, bias_grad=None), "bf16")
    assert b - b0 == pytest.approx(max(cm.memory_time(2 * 65 * 512), dev.kernel_floor))  # read 64 rows, write one
    # a measured row of the same width: its time, scaled by bytes to other row counts
    timed = ComputeModel(dataclasses.replace(dev, reduce_shapes=((64, 512, "bf16", 3.0e-5),)))
    assert timed.bias_grad_time(64, 512, "bf16") == pytest.approx(3.0e-5)
    assert timed.bias_grad_time(256, 512, "bf16") == pytest.approx(
        3.0e-5 * cm.memory_time(2 * 257 * 512) / cm.memory_time(2 * 65 * 512))
    assert timed.bias_grad_time(64, 128, "bf16") == cm.bias_grad_time(64, 128, "bf16")  # other width: bytes
    # a bias that needs no gradient (frozen) runs no reduction
    grads = [True] * len(fc.input_meta)
    bias = next(i for i, m in enumerate(fc.input_meta) if len(m.shape) == 1)
    grads[bias] = False
    assert op_work(fc, None, 1, 1.0, "bf16", grads=grads).bias_grad is None


def test_norm_shapes_round_trip_in_a_profile_and_bad_rows_are_named():
    d = cluster_to_dict(load_cluster("dgx-h100"))
    d["device"]["norm_shapes"] = [[8192, 768, 2, "layer_norm", "fp32", 2.0e-5, 9.0e-5]]
    c = cluster_from_dict(d)
    assert c.device.norm_shapes == ((8192, 768, 2, "layer_norm", "fp32", 2.0e-5, 9.0e-5),)
    assert cluster_from_dict(cluster_to_dict(c)) == c
    for bad, message in (([8192, 768, 3, "layer_norm", "fp32", 2e-5, 9e-5], "parameters must be 0, 1 or 2"),
                         ([8192, 768, 2, "group_norm", "fp32", 2e-5, 9e-5], "function 'group_norm' is not one of"),
                         ([8192, 768, 2, "layer_norm", "fp32", 2e-5], "expected a row like")):
        d["device"]["norm_shapes"] = [bad]
        with pytest.raises(ProfileError, match=r"device.norm_shapes\[0\]: " + message):
            cluster_from_dict(d)
    del d["device"]["norm_shapes"]
    d["device"]["reduce_shapes"] = [[16384, 768, "bf16", 3.0e-5]]
    c = cluster_from_dict(d)
    assert c.device.reduce_shapes == ((16384, 768, "bf16", 3.0e-5),) and cluster_from_dict(cluster_to_dict(c)) == c
    d["device"]["reduce_shapes"] = [[16384, 768, "int8", 3.0e-5]]
    with pytest.raises(ProfileError, match=r"device.reduce_shapes\[0\]: precision 'int8'"):
        cluster_from_dict(d)


def test_profile_model_flag_needs_the_planner():
    from hardware_profiles.probe import main as probe_main
    with pytest.raises(ProfileError, match="--model needs the planner"):
        probe_main(["--model", "x.py"])


def _gpt():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig
    return GPT(GPTConfig())


def _gpt_batch(b):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import sample_batch
    return sample_batch(b)


def test_conv_is_an_implicit_gemm_and_addmm_weights_skip_the_bias():
    class _Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, padding=1)
            self.w, self.b = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8))

        def forward(self, x):  # x: (b, 3, 8, 8) -> conv -> (b*64, 16) @ (16, 8) + bias, as HF's Conv1D does
            y = self.conv(x).permute(0, 2, 3, 1).reshape(-1, 16)
            return torch.addmm(self.b, y, self.w).reshape(x.shape[0], 8, 8, 8).permute(0, 3, 1, 2)[:, :3]

    g = trace_model(_model_file(_Net, (3, 8, 8)), 2, progress=False)
    conv = next(o for o in g.ops if o.kind == "conv")
    assert op_work(conv, None, 1, 1.0, "bf16").gemms == ((1, 2 * 64, 16, 27),)  # M positions, N out, K = 3*3*3
    addmm = next(o for o in g.ops if o.kind == "linear")
    assert op_work(addmm, None, 1, 1.0, "bf16").gemms == ((1, 128, 8, 16),)


def test_unaligned_gemms_run_at_the_measured_unaligned_efficiency():
    from cost_model import kernels
    h100 = load_cluster("dgx-h100").device  # unaligned_efficiency 0.13, measured on an H200 (same die)
    aligned, odd = (1, 1024, 50304, 768), (1, 1024, 50257, 768)  # nanoGPT's padded vocabulary vs GPT-2's
    assert kernels.aligned(aligned, "bf16") and not kernels.aligned(odd, "bf16")
    assert kernels.gemm_efficiency(h100, odd, "bf16") == pytest.approx(
        0.13 / h100.matmul.best_efficiency * kernels.gemm_efficiency(h100, aligned, "bf16"), rel=0.01)
    assert kernels.gemm_time(h100, odd, "bf16") > 5 * kernels.gemm_time(h100, aligned, "bf16")
    assert kernels.aligned((1, 1024, 50260, 768), "fp32") and not kernels.aligned((1, 1024, 50260, 768), "bf16")
    a100 = load_cluster("dgx-a100-80gb").device  # no measurement: no penalty
    assert kernels.gemm_efficiency(a100, odd, "bf16") == pytest.approx(kernels.gemm_efficiency(a100, aligned, "bf16"),
                                                                     rel=0.01)


def test_profile_shapes_cover_larger_micro_batches():
    from cost_model.work import graph_shapes
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    graph = trace_model(load_model_file(os.path.join(ROOT, "examples", "gpt.py")), 1)
    one, one_att = graph_shapes(graph, limit=4)
    many, many_att = graph_shapes(graph, limit=4, scales=(1, 4, 16))
    assert many[:len(one)] == one and len(many) == 3 * len(one)
    t = one_att[0][1]  # tokens of one sample: the M of forward GEMMs, the K of weight gradients
    for s in (4, 16):
        assert any(g[1] == s * t for g in many) and any(g[3] == s * t for g in many)
        assert (one_att[0][0] * s, *one_att[0][1:]) in many_att  # attention: batch x heads
    # a plan at 16 samples finds its GEMMs measured as they are, not scaled from one sample
    from cost_model import kernels
    fwd16 = next(g for g in many if g[1] == 16 * t)
    rows = [(*g[:4], "fp32", 1.0, g[4]) for g in many]
    assert kernels.nearest_row(rows, (*fwd16[:4], "fp32"), free=(0, 1, 2, 3))[:4] == fwd16[:4]


def test_shallow_gemms_pay_their_tiles_pipeline_fill():
    from cost_model import kernels
    h100 = load_cluster("dgx-h100").device  # k_overhead 192, measured on an H200 (same die)
    deep, shallow = (1, 8192, 8192, 16384), (1, 8192, 8192, 1024)
    e_deep, e_shallow = (kernels.gemm_efficiency(h100, g, "bf16") for g in (deep, shallow))
    assert e_shallow / e_deep == pytest.approx((1024 / (1024 + 192)) / (16384 / (16384 + 192)))
    plain = dataclasses.replace(h100, matmul=dataclasses.replace(h100.matmul, k_overhead=0.0))
    one_wave = (1, 12 * 256, 11 * 128, 1024)  # 132 tiles of 256 x 128 on 132 SMs: no quantization loss
    best = h100.matmul.best_efficiency
    assert kernels.gemm_efficiency(plain, one_wave, "bf16") == pytest.approx(best)
    assert kernels.gemm_efficiency(h100, one_wave, "bf16") == pytest.approx(best * 1024 / (1024 + 192))


# ---- rates measured at bf16 on CPU ranks (by_precision) -----------------------------------------------------------

CPU = dataclasses.replace(load_cluster("cpu-local").device, by_precision={})  # as measured before by_precision


def _with_bf16(dev, **rates):
    """`dev` with a by_precision.bf16 entry of the given PrecisionRates fields."""
    from hardware_profiles.schema import PrecisionRates
    return dataclasses.replace(dev, by_precision={"bf16": PrecisionRates(**rates)})


def test_a_bf16_linear_on_a_cpu_profile_is_priced_by_its_bf16_curves():
    """Before by_precision, a bf16 linear on cpu-local ran on the fp32-measured matmul curve at the bf16 peak; with
    bf16 linear curves it takes them (fp32 keeps its own curves)."""
    f = 2.0 * 256 * 128 * 512
    work = OpWork(fwd_flops=f, bwd_flops=2 * f, fwd_bytes=0, bwd_bytes=0, gemms=((1, 256, 512, 128),),
                  gemm_layout="nt")
    curve = ((1e4, 0.01), (1e9, 0.01))
    dev = _with_bf16(CPU, linear_efficiency=curve, linear_backward_efficiency=((1e4, 0.02), (1e9, 0.02)))
    fwd, bwd = ComputeModel(dev)._kernel_times("linear", work, "bf16")
    pk = CPU.peak_flops["bf16"]
    assert fwd == pytest.approx(f / (pk * 0.01)) and bwd == pytest.approx(2 * f / (pk * 0.02))
    assert ComputeModel(dev)._kernel_times("linear", work, "fp32") == \
        ComputeModel(CPU)._kernel_times("linear", work, "fp32")
    assert ComputeModel(CPU)._kernel_times("linear", work, "bf16")[0] < fwd / 10  # without: the fp32 curves


def test_bf16_matmuls_attention_and_kernels_use_the_bf16_measurements():
    dev = _with_bf16(CPU, matmul_efficiency=((1e4, 0.001), (1e9, 0.001)),
                     attention_efficiency={32: ((1e4, 0.1), (1e9, 0.1)), 128: ((1e4, 0.4), (1e9, 0.4))},
                     attention_backward_efficiency={32: ((1e4, 0.01), (1e9, 0.01)), 128: ((1e4, 0.04),)},
                     kernel_costs={"gelu": (1e-6, 2e-6), "widen": (1e-7, 1e-7)})
    pk = CPU.peak_flops["bf16"]
    g = (4, 64, 64, 32)
    assert kernels.gemm_time(dev, g, "bf16") == pytest.approx(2.0 * math.prod(g) / (pk * 0.001))
    assert kernels.gemm_time(dev, g, "fp32") == kernels.gemm_time(CPU, g, "fp32")
    # a causal SDPA call: dense forward FLOPs over the measured rates, backward 2.5x the FLOPs
    a = (16, 64, 64, 32, True)
    f = 4.0 * 16 * 64 * 64 * 32
    work = OpWork(fwd_flops=f, bwd_flops=2.5 * f, fwd_bytes=0, bwd_bytes=0, attn=a)
    fwd, bwd = ComputeModel(dev)._kernel_times("attention", work, "bf16")
    assert fwd == pytest.approx(f / (pk * 0.1)) and bwd == pytest.approx(2.5 * f / (pk * 0.01))
    # head dim 64: halfway between the curves of 32 and 128 in log2 (0.1 + 0.5 x 0.3); beyond them, held
    a64 = dataclasses.replace(work, attn=(16, 64, 64, 64, True))
    assert ComputeModel(dev)._kernel_times("attention", a64, "bf16")[0] == pytest.approx(f / (pk * 0.25))
    a16 = dataclasses.replace(work, attn=(16, 64, 64, 16, True))
    assert ComputeModel(dev)._kernel_times("attention", a16, "bf16") == pytest.approx((fwd, bwd))
    # a gelu on a bf16 tensor at the bf16 cost; the same family in fp32 (an fp32 input) at the fp32 one
    gelu = OpWork(fwd_flops=0, bwd_flops=0, fwd_bytes=1.0, bwd_bytes=1.0, elems=1e4, kernel="gelu",
                  kernel_precision="bf16")
    assert ComputeModel(dev).kernel_time(gelu, False) == pytest.approx(1e-2)
    assert ComputeModel(dev).kernel_time(dataclasses.replace(gelu, kernel_precision="fp32"), False) == \
        pytest.approx(1e4 * CPU.kernel_costs["gelu"][0])
    # autocast's widening cast at the measured bf16 -> fp32 rate (6 bytes per element)
    assert ComputeModel(dev).cast_time(6e4, True, "bf16") == pytest.approx(1e4 * 1e-7)
    assert ComputeModel(dev).cast_time(6e4, True, "fp32") == ComputeModel(CPU).cast_time(6e4, True)


def test_by_precision_round_trips_and_bad_values_name_the_field():
    dev = _with_bf16(CPU, linear_efficiency=((1e4, 0.01), (1e9, 0.5)), linear_backward_efficiency=((1e4, 0.02),),
                     attention_efficiency={64: ((1e6, 0.3),)}, attention_backward_efficiency={64: ((1e6, 0.1),)},
                     matmul_efficiency=((1e4, 0.1), (1e6, 1.0)), kernel_costs={"add": (1e-9, 2e-9)})
    c = dataclasses.replace(load_cluster("cpu-local"), device=dev)
    d = cluster_to_dict(c)
    assert cluster_from_dict(d) == c
    old = dataclasses.replace(c, device=CPU)  # a profile without it writes none and reads back without it
    assert "by_precision" not in cluster_to_dict(old)["device"] and cluster_from_dict(cluster_to_dict(old)) == old
    assert load_cluster("cpu-local").device.rates("bf16") is not None  # the preset measured bf16
    bad = cluster_to_dict(c)
    bad["device"]["by_precision"]["bf16"]["linear_efficiency"] = [[1e4, 2.0]]
    with pytest.raises(ProfileError, match=r"by_precision\.bf16\.linear_efficiency\[0\]\[1\]"):
        cluster_from_dict(bad)
    bad["device"]["by_precision"]["bf16"]["linear_efficiency"] = [[1e4, 0.5]]
    bad["device"]["by_precision"]["bf16"]["attention_efficiency"] = {64: [[1e6, 0.3]], "d": [[1e6, 0.3]]}
    with pytest.raises(ProfileError, match=r"by_precision\.bf16\.attention_efficiency\.d"):
        cluster_from_dict(bad)
    bad["device"]["by_precision"] = {"int8": {}}
    with pytest.raises(ProfileError, match=r"by_precision\.int8: unknown key"):
        cluster_from_dict(bad)
