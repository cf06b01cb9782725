"""Predicted step time, TFLOP/s per GPU and memory per GPU for GPT 1.7B ... 1T on dgx-a100-80gb, with the
configurations of Narayanan et al. SC21 Table 1 (model shapes, t, p, number of GPUs, global batch; s = 2048,
V = 51200); plus the time one `CostModel.predict` of the 1T / 3072-GPU configuration takes.

Only the configurations come from the paper and its run script (micro-batch size, interleaved stages) and
Megatron-LM's defaults (dropout 0.1 on the attention probabilities and residual branches; gradients clipped to norm
1.0, `--clip-grad`'s default, which the run script keeps); full activation
recomputation (the paper's setting), ZeRO-0, bf16 (same peak as the paper's fp16). No figure is tuned to the
published throughputs; the last column is the step time those imply (Table 1's achieved TFLOP/s per GPU, which count
the recomputed forward, through the paper's FLOP formula, eq. 3), for reference.
The attention kernel is the preset's (FlashAttention-2); `--attention unfused` prices SDPA as the separate kernels
Megatron-LM ran in 2021, before FlashAttention (batched GEMMs over the dense scores and a fused softmax).

    python3 benchmarks/cost_model_gpt.py [--only 1.7B,1T] [--repeat 20] [--attention unfused]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt import GPT, GPTConfig, sample_batch  # noqa: E402

from cost_model.model import CostModel  # noqa: E402
from hardware_profiles.load import load_cluster  # noqa: E402
from hardware_profiles.schema import Cluster, ProfileError  # noqa: E402
from planner.defaults import default_plan  # noqa: E402
from planner.model_file import ModelFile, default_loss  # noqa: E402
from planner.trace import trace_model  # noqa: E402

# name: (heads, hidden, layers, t, p, GPUs, global batch, micro-batch, virtual stages) -- Narayanan et al. SC21
# Table 1 (configurations only); micro-batch sizes and interleaving from the paper's run script, Megatron-LM
# examples/sc21/run_table_1.sh (MBS, --num-layers-per-virtual-pipeline-stage: layers / p / that = virtual stages)
CONFIGS = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512, 16, 1),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512, 16, 1),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512, 16, 1),
    "18B": (48, 6144, 40, 8, 1, 256, 1024, 8, 1),
    "39B": (64, 8192, 48, 8, 2, 512, 1536, 4, 1),
    "76B": (80, 10240, 60, 8, 4, 1024, 1792, 2, 3),
    "145B": (96, 12288, 80, 8, 8, 1536, 2304, 2, 2),
    "310B": (128, 16384, 96, 8, 16, 1920, 2160, 1, 2),
    "530B": (128, 20480, 105, 8, 35, 2520, 2520, 1, 3),
    "1T": (160, 25600, 128, 8, 64, 3072, 3072, 1, 1),
}
PUBLISHED_TFLOPS = {"1.7B": 137, "3.6B": 138, "7.5B": 142, "18B": 135, "39B": 138, "76B": 140, "145B": 148,
                    "310B": 155, "530B": 163, "1T": 163}
"""SC21 Table 1, achieved teraFLOP/s per GPU."""
SEQ, VOCAB = 2048, 51200
DROPOUT = 0.1  # Megatron-LM's defaults, hidden_dropout and attention_dropout (megatron/training/arguments.py)


def model_file(heads: int, hidden: int, layers: int) -> ModelFile:
    """A ModelFile for examples/gpt.py's GPT with this shape (built on the meta device by the tracer)."""
    cfg = GPTConfig(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=VOCAB, block_size=SEQ, dropout=DROPOUT)
    return ModelFile(path=os.path.join(ROOT, "examples", "gpt.py"), build_model=lambda: GPT(cfg),
                     sample_batch=lambda b: sample_batch(b, cfg), loss_fn=default_loss)


CLIP_GRAD = 1.0
"""Megatron-LM's `--clip-grad` default (megatron/training/arguments.py), unchanged by examples/sc21/run_table_1.sh."""


def _cluster(nodes: int, attention: str | None) -> Cluster:
    """dgx-a100-80gb with `nodes` nodes, its attention kernel replaced by `attention` when given."""
    cluster = load_cluster("dgx-a100-80gb", nodes=nodes)
    return cluster.with_attention_kernel(attention) if attention else cluster


def _plan(name: str, graph, cluster: Cluster):
    """The run's plan: its t, p, d, micro-batch and interleaving, full recompute, ZeRO-0, no sequence parallelism."""
    _, _, _, t, p, gpus, batch, mbs, vp = CONFIGS[name]
    forced = {"dp": gpus // (t * p), "tp": t, "pp": p, "zero": 0, "mbs": mbs, "recompute": "full", "sp": 0,
              "schedule": "interleaved" if vp > 1 else "1f1b"}
    if vp > 1:
        forced["vp"] = vp
    plan = default_plan(graph, cluster, batch, "bf16", forced, "examples/gpt.py")
    return dataclasses.replace(plan, max_grad_norm=CLIP_GRAD)


def published_step_s(name: str) -> float:
    """Step seconds implied by SC21 Table 1: eq. 3's FLOPs (with the recomputed forward) over GPUs x TFLOP/s."""
    _, h, l, _, _, gpus, batch, _, _ = CONFIGS[name]
    flops = 96 * batch * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))
    return flops / (gpus * PUBLISHED_TFLOPS[name] * 1e12)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model names (default: all)")
    ap.add_argument("--repeat", type=int, default=20, help="predict() repetitions for the 1T timing")
    ap.add_argument("--attention", metavar="KERNEL",
                    help="attention kernel to price SDPA with (default: the preset's; unfused: separate kernels)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: not a Table 1 model; pick from {','.join(CONFIGS)}")
    try:
        _cluster(1, args.attention)
    except ProfileError as e:
        ap.error(str(e))
    print(f"{'model':>6} {'t':>2} {'p':>3} {'d':>3} {'GPUs':>5} {'batch':>5} {'params':>8} {'trace s':>7} "
          f"{'step s':>8} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'fits':>5}  {'breakdown (compute/comm/bubble/opt s)':<38}"
          f"{'published s':>11}")
    graphs = {}
    for name in names:
        heads, hidden, layers, t, p, gpus, batch, mbs, vp = CONFIGS[name]
        t0 = time.perf_counter()
        graph = trace_model(model_file(heads, hidden, layers), batch_size=1, progress=False)
        trace_s = time.perf_counter() - t0
        graphs[name] = graph
        cluster = _cluster(gpus // 8, args.attention)
        pred = CostModel(cluster).predict(graph, _plan(name, graph, cluster))
        b = pred.breakdown
        parts = f"{b['compute_s']:.2f}/{b['exposed_comm_s']:.2f}/{b['bubble_s']:.2f}/{b['optimizer_s']:.3f}"
        print(f"{name:>6} {t:>2} {p:>3} {gpus // (t * p):>3} {gpus:>5} {batch:>5} {graph.num_parameters / 1e9:>7.1f}B "
              f"{trace_s:>7.1f} {pred.step_time_s:>8.2f} {pred.tflops_per_device:>8.1f} {pred.mfu:>6.1%} "
              f"{pred.peak_memory_bytes / 2**30:>8.1f} {str(pred.fits):>5}  {parts:<38}{published_step_s(name):>11.2f}",
              flush=True)
    if "1T" in graphs:
        gpus = CONFIGS["1T"][5]
        cluster = _cluster(gpus // 8, args.attention)
        plan = _plan("1T", graphs["1T"], cluster)
        times = []
        for _ in range(args.repeat):
            cm = CostModel(cluster)  # fresh model: no cached layer costs carried over
            t0 = time.perf_counter()
            cm.predict(graphs["1T"], plan)
            times.append(time.perf_counter() - t0)
        print(f"simulate 1T on 3072 GPUs (t=8 p=64 d=6, batch 3072, mbs 1, m=512): median "
              f"{statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms over {args.repeat} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
