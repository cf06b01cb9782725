"""Predicted step time, TFLOP/s per GPU and memory per GPU for GPT 1.7B ... 1T on dgx-a100-80gb, with the
configurations of Narayanan et al. SC21 Table 1 (model shapes, t, p, number of GPUs, global batch; s = 2048,
V = 51200); plus the time one `CostModel.predict` of the 1T / 3072-GPU configuration takes.

Only the configurations come from the paper; no figure is tuned to its published throughputs. Micro-batch size 1,
1F1B schedule, full activation recomputation (the paper's setting), ZeRO-0, bf16 (same peak as the paper's fp16).
The attention kernel is the preset's (FlashAttention-2); `--attention unfused` prices SDPA as the separate kernels
Megatron-LM ran in 2021, before FlashAttention (batched GEMMs over the dense scores and a fused softmax).

    python3 benchmarks/cost_model_gpt.py [--only 1.7B,1T] [--repeat 20] [--attention unfused]
"""
from __future__ import annotations

import argparse
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
from hardware_profiles.schema import Cluster  # noqa: E402
from planner.defaults import default_plan  # noqa: E402
from planner.model_file import ModelFile, default_loss  # noqa: E402
from planner.trace import trace_model  # noqa: E402

# name: (heads, hidden, layers, t, p, GPUs, global batch) -- Narayanan et al. SC21 Table 1 (configurations only)
CONFIGS = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512),
    "18B": (48, 6144, 40, 8, 1, 256, 1024),
    "39B": (64, 8192, 48, 8, 2, 512, 1536),
    "76B": (80, 10240, 60, 8, 4, 1024, 1792),
    "145B": (96, 12288, 80, 8, 8, 1536, 2304),
    "310B": (128, 16384, 96, 8, 16, 1920, 2160),
    "530B": (128, 20480, 105, 8, 35, 2520, 2520),
    "1T": (160, 25600, 128, 8, 64, 3072, 3072),
}
SEQ, VOCAB = 2048, 51200


def model_file(heads: int, hidden: int, layers: int) -> ModelFile:
    """A ModelFile for examples/gpt.py's GPT with this shape (built on the meta device by the tracer)."""
    cfg = GPTConfig(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=VOCAB, block_size=SEQ)
    return ModelFile(path=os.path.join(ROOT, "examples", "gpt.py"), build_model=lambda: GPT(cfg),
                     sample_batch=lambda b: sample_batch(b, cfg), loss_fn=default_loss)


def _cluster(nodes: int, attention: str | None) -> Cluster:
    """dgx-a100-80gb with `nodes` nodes, its attention kernel replaced by `attention` when given."""
    cluster = load_cluster("dgx-a100-80gb", nodes=nodes)
    return cluster.with_attention_kernel(attention) if attention else cluster


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model names (default: all)")
    ap.add_argument("--repeat", type=int, default=20, help="predict() repetitions for the 1T timing")
    ap.add_argument("--attention", metavar="KERNEL",
                    help="attention kernel to price SDPA with (default: the preset's; unfused: separate kernels)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else list(CONFIGS)
    print(f"{'model':>6} {'t':>2} {'p':>3} {'d':>3} {'GPUs':>5} {'batch':>5} {'params':>8} {'trace s':>7} "
          f"{'step s':>8} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'fits':>5}  breakdown (compute/comm/bubble/opt s)")
    graphs = {}
    for name in names:
        heads, hidden, layers, t, p, gpus, batch = CONFIGS[name]
        t0 = time.perf_counter()
        graph = trace_model(model_file(heads, hidden, layers), batch_size=1, progress=False)
        trace_s = time.perf_counter() - t0
        graphs[name] = graph
        cluster = _cluster(gpus // 8, args.attention)
        d = gpus // (t * p)
        forced = {"dp": d, "tp": t, "pp": p, "zero": 0, "mbs": 1, "recompute": "full", "schedule": "1f1b",
                  "sp": 0}
        plan = default_plan(graph, cluster, batch, "bf16", forced, "examples/gpt.py")
        pred = CostModel(cluster).predict(graph, plan)
        b = pred.breakdown
        print(f"{name:>6} {t:>2} {p:>3} {d:>3} {gpus:>5} {batch:>5} {graph.num_parameters / 1e9:>7.1f}B "
              f"{trace_s:>7.1f} {pred.step_time_s:>8.2f} {pred.tflops_per_device:>8.1f} {pred.mfu:>6.1%} "
              f"{pred.peak_memory_bytes / 2**30:>8.1f} {str(pred.fits):>5}  "
              f"{b['compute_s']:.2f}/{b['exposed_comm_s']:.2f}/{b['bubble_s']:.2f}/{b['optimizer_s']:.3f}",
              flush=True)
    if "1T" in graphs:
        heads, hidden, layers, t, p, gpus, batch = CONFIGS["1T"]
        cluster = _cluster(gpus // 8, args.attention)
        forced = {"dp": gpus // (t * p), "tp": t, "pp": p, "zero": 0, "mbs": 1, "recompute": "full",
                  "schedule": "1f1b", "sp": 0}
        plan = default_plan(graphs["1T"], cluster, batch, "bf16", forced, "examples/gpt.py")
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
