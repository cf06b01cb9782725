"""Trace GPT-3 175B (examples/gpt3_175b.py) on the meta device and print wall time, peak RSS, ops, parameters and
FLOPs per sample. Target (issue 2): under 20 s and under 2 GB peak RSS on a 2-core machine.

    python3 benchmarks/trace_175b.py
"""
from __future__ import annotations

import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner.model_file import load_model_file  # noqa: E402
from planner.trace import trace_model  # noqa: E402


def main() -> None:
    """Run the benchmark and print its figures."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    graph = trace_model(load_model_file(os.path.join(ROOT, "examples", "gpt3_175b.py")), batch_size=1,
                        progress=False)
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    blocks = ", ".join(f"{t} x {len(v)}" for t, v in graph.block_types.items())
    print(f"trace wall time      {wall:.2f} s (includes building the model on meta and importing torch.export)")
    print(f"peak RSS             {peak_kib / 2**20:.2f} GiB")
    print(f"ops                  {len(graph.ops)} ({graph.tracer})")
    print(f"parameters           {graph.num_parameters:,} ({graph.num_parameters / 1e9:.2f} B)")
    print(f"FLOPs per sample     {graph.flops_per_sample():.4e} (fwd+bwd, seq 2048)")
    print(f"activations/sample   {graph.saved_bytes_per_sample() / 2**30:.2f} GiB saved for backward (fp32)")
    print(f"repeated blocks      {blocks}")
    print(f"layers               {len(graph.layers())}")


if __name__ == "__main__":
    main()
