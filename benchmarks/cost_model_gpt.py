"""Predicted step time, TFLOP/s per GPU and memory per GPU for published Megatron-LM runs on dgx-a100-80gb, each
with its own configuration (with `--attention unfused`, also the attention those runs had); plus the time one
`CostModel.predict` of the 1T / 3072-GPU configuration takes.

`--paper sc21` (default): GPT 1.7B ... 1T with the configurations of Narayanan et al. SC21 Table 1 (model shapes, t,
p, number of GPUs, global batch; s = 2048, V = 51200), the micro-batch sizes and interleaved stages of its run script,
full activation recomputation (the paper's setting). The last column is the step time Table 1's achieved TFLOP/s per
GPU imply (they count the recomputed forward) through the paper's FLOP formula, eq. 3.
`--paper korthikanti`: GPT 22B, 175B, 530B and 1T with the configurations of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models") Table 3, each run twice as its Table 5 did: full
recomputation, and selective recomputation (the attention core, `recompute=attention`) with sequence parallelism.
The micro-batch sizes and interleaving are those of Calculon's validation configurations of these runs (Isaev et al.
SC23; validation/*.json of its repository, calculon-ai/calculon). The last column is Table 5's measured iteration time.

`--only` takes run names or model sizes (`--only 22B` is both 22B runs). The TFLOP/s column counts the model's
FLOPs without the recomputed forward (SC21's published figures count it); `fits`: whether shardwise's executor,
which keeps more activations than Megatron-LM's fused layers, would fit the run in 80 GB.
Both: Megatron-LM's defaults (dropout 0.1 on the attention probabilities and residual branches; gradients clipped to
norm 1.0, `--clip-grad`'s default), ZeRO-0, bf16 (same peak as the papers' fp16). Only the configurations come from
the papers; no figure is tuned to the published times, which are printed for reference.
The attention kernel is the preset's (FlashAttention-2); `--attention unfused` prices SDPA as the separate kernels
Megatron-LM ran in 2021-22, before FlashAttention (batched GEMMs over the dense scores and a fused softmax).

    python3 benchmarks/cost_model_gpt.py [--paper sc21|korthikanti] [--only 1.7B,1T] [--repeat 20] [--attention unfused]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import NamedTuple

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

class Run(NamedTuple):
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    mbs: int
    vp: int  # virtual stages per pipeline rank (interleaved schedule when > 1)
    recompute: str
    sp: int
    published_s: float  # the paper's step time (see PAPERS)


# SC21 Table 1 (configurations only); micro-batch sizes and interleaving from the paper's run script, Megatron-LM
# examples/sc21/run_table_1.sh (MBS, --num-layers-per-virtual-pipeline-stage: layers / p / that = virtual stages).
# Published: Table 1's achieved teraFLOP/s per GPU, as step seconds through eq. 3 (`_sc21_step_s`).
_SC21 = {  # name: (heads, hidden, layers, t, p, GPUs, global batch, micro-batch, virtual stages, TFLOP/s per GPU)
    "1.7B": (24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    "18B": (48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    "39B": (64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    "76B": (80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    "145B": (96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    "310B": (128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    "530B": (128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    "1T": (160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
}
# Korthikanti et al. 2022 Table 3 (shapes, t, p, GPUs, global batch) with the micro-batch sizes and interleaving of
# Calculon's validation configurations of these runs; published: Table 5's iteration seconds, full recompute and
# selective recompute + sequence parallelism.
# name: (heads, hidden, layers, t, p, GPUs, global batch, micro-batch, virtual stages, full s, sel+sp s)
_KORTHIKANTI = {
    "22B": (64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    "175B": (96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    "530B": (128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    "1T": (160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
}
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


def _sc21_step_s(heads: int, h: int, l: int, gpus: int, batch: int, tflops: float) -> float:
    """Step seconds implied by SC21 Table 1: eq. 3's FLOPs (with the recomputed forward) over GPUs x TFLOP/s."""
    flops = 96 * batch * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))
    return flops / (gpus * tflops * 1e12)


def _runs(paper: str) -> dict[str, Run]:
    """The paper's runs by name, each with the recompute and sequence parallelism it ran with."""
    if paper == "sc21":
        return {name: Run(*c[:9], "full", 0, _sc21_step_s(c[0], c[1], c[2], c[5], c[6], c[9]))
                for name, c in _SC21.items()}
    runs = {}
    for name, c in _KORTHIKANTI.items():
        runs[f"{name} full"] = Run(*c[:9], "full", 0, c[9])
        runs[f"{name} sel+sp"] = Run(*c[:9], "attention", 1, c[10])
    return runs


def _plan(run: Run, graph, cluster: Cluster):
    """The run's plan: its t, p, d, micro-batch, interleaving, recompute and sp; ZeRO-0; Megatron's clipping."""
    forced = {"dp": run.gpus // (run.t * run.p), "tp": run.t, "pp": run.p, "zero": 0, "mbs": run.mbs,
              "recompute": run.recompute, "sp": run.sp, "schedule": "interleaved" if run.vp > 1 else "1f1b"}
    if run.vp > 1:
        forced["vp"] = run.vp
    plan = default_plan(graph, cluster, run.batch, "bf16", forced, "examples/gpt.py")
    return dataclasses.replace(plan, max_grad_norm=CLIP_GRAD)


def _bad(what: str) -> int:
    """Bad input: one line on stderr, exit status 2."""
    print(f"cost_model_gpt.py: error: {what}", file=sys.stderr)
    return 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paper", choices=("sc21", "korthikanti"), default="sc21",
                    help="whose runs: Narayanan et al. SC21 Table 1 (default), or Korthikanti et al. 2022 Table 5")
    ap.add_argument("--only", help="comma-separated run names or model sizes (default: all)")
    ap.add_argument("--repeat", type=int, default=20,
                    help="predict() repetitions for the 1T / 3072-GPU timing (--paper sc21 with 1T only)")
    ap.add_argument("--attention", metavar="KERNEL",
                    help="attention kernel to price SDPA with (default: the preset's; unfused: separate kernels)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = _runs(args.paper)
    names, unknown = [], []
    for want in (args.only.split(",") if args.only else list(runs)):
        picked = [n for n in runs if n == want or n.split(" ")[0] == want]
        unknown += [] if picked else [want]
        names += [n for n in picked if n not in names]
    if unknown:
        return _bad(f"--only {','.join(unknown)}: not a run or model of --paper {args.paper}; pick from "
                    f"{', '.join(runs)}")
    if args.repeat < 1:
        return _bad(f"--repeat {args.repeat}: must be at least 1")
    try:
        _cluster(1, args.attention)
    except ProfileError as e:
        return _bad(str(e))
    width = max(len(n) for n in names)
    print(f"{'run':>{width}} {'t':>2} {'p':>3} {'d':>3} {'GPUs':>5} {'batch':>5} {'params':>8} {'trace s':>7} "
          f"{'step s':>8} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'fits':>5}  {'breakdown (compute/comm/bubble/opt s)':<38}"
          f"{'published s':>11} {'error':>6}")
    graphs, errors = {}, []
    for name in names:
        run = runs[name]
        shape = (run.heads, run.hidden, run.layers)
        t0 = time.perf_counter()
        if shape not in graphs:
            graphs[shape] = trace_model(model_file(*shape), batch_size=1, progress=False)
        graph = graphs[shape]
        trace_s = time.perf_counter() - t0
        cluster = _cluster(run.gpus // 8, args.attention)
        pred = CostModel(cluster).predict(graph, _plan(run, graph, cluster))
        b = pred.breakdown
        parts = f"{b['compute_s']:.2f}/{b['exposed_comm_s']:.2f}/{b['bubble_s']:.2f}/{b['optimizer_s']:.3f}"
        error = pred.step_time_s / run.published_s - 1
        errors.append(error)
        print(f"{name:>{width}} {run.t:>2} {run.p:>3} {run.gpus // (run.t * run.p):>3} {run.gpus:>5} {run.batch:>5} "
              f"{graph.num_parameters / 1e9:>7.1f}B {trace_s:>7.1f} {pred.step_time_s:>8.2f} "
              f"{pred.tflops_per_device:>8.1f} {pred.mfu:>6.1%} {pred.peak_memory_bytes / 2**30:>8.1f} "
              f"{str(pred.fits):>5}  {parts:<38}{run.published_s:>11.2f} {error:>+6.1%}", flush=True)
    print(f"|error| over {len(errors)} runs: mean {statistics.mean(abs(e) for e in errors):.1%}, "
          f"max {max(abs(e) for e in errors):.1%}")
    if args.paper == "sc21" and "1T" in names:
        run = runs["1T"]
        graph = graphs[(run.heads, run.hidden, run.layers)]
        cluster = _cluster(run.gpus // 8, args.attention)
        plan = _plan(run, graph, cluster)
        times = []
        for _ in range(args.repeat):
            cm = CostModel(cluster)  # fresh model: no cached layer costs carried over
            t0 = time.perf_counter()
            cm.predict(graph, plan)
            times.append(time.perf_counter() - t0)
        print(f"simulate 1T on 3072 GPUs (t=8 p=64 d=6, batch 3072, mbs 1, m=512): median "
              f"{statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms over {args.repeat} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
