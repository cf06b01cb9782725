"""Dry-run wall time and memory per bundled example: what the check before `plan -o` adds (`executor.dry_run`).

Each example is planned as `plan` would (trace, search with the real cost model; forced keys where given) and the
chosen plan is dry-run twice (the first run also pays one-off imports and DTensor's rule caches). Prints the
second run's time, how far the two runs raised the process's peak RSS, and the plan checked.

    python3 benchmarks/dry_run_time.py [NAME ...]     # default: every case
"""
from __future__ import annotations

import os
import resource
import sys
import time

from cost_model.model import CostModel
from executor.dry_run import dry_run, run_plan
from hardware_profiles.load import load_cluster
from planner.model_file import load_model_file
from planner.plan import recompute_counts
from planner.search import search
from planner.trace import trace_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    # name, model file, preset, nodes, global batch, precision, forced keys
    ("gpt tp=2", "examples/gpt.py", "cpu-local", 1, 8, "fp32", {"tp": 2}),
    ("gpt dp=2 x tp=2", "examples/gpt.py", "cpu-local", 2, 8, "fp32", {"dp": 2, "tp": 2}),
    ("gpt tp=2 x pp=2", "examples/gpt.py", "cpu-local", 2, 8, "fp32", {"tp": 2, "pp": 2}),
    ("llama tp=2", "examples/llama.py", "cpu-local", 1, 8, "fp32", {"tp": 2}),
    ("resnet dp=2 zero=3", "examples/resnet.py", "cpu-local", 1, 8, "fp32", {"dp": 2, "zero": 3}),
    ("mlp dp=2", "examples/mlp.py", "cpu-local", 1, 8, "fp32", {"dp": 2}),
    ("hf_llama tp=2", "examples/hf_llama.py", "cpu-local", 1, 8, "fp32", {"tp": 2}),
    ("hf_gpt2 dp=2", "examples/hf_gpt2.py", "cpu-local", 1, 8, "fp32", {"dp": 2}),
    ("gpt2_xl (README plan)", "examples/gpt2_xl.py", "dgx-a100-80gb", 1, 512, None, {}),
    ("gpt2_xl dp=4 x pp=2", "examples/gpt2_xl.py", "dgx-a100-80gb", 1, 512, None, {"dp": 4, "pp": 2}),
    ("gpt3_175b (README plan)", "examples/gpt3_175b.py", "dgx-a100-80gb", 128, 1536, None, {}),
    ("gpt3_175b dp=32 tp=4 pp=8", "examples/gpt3_175b.py", "dgx-a100-80gb", 128, 1536, None,
     {"dp": 32, "tp": 4, "pp": 8}),
]
"""GPT-2 XL (25 heads, vocabulary 50257) gets no tp from the planner at any degree a node holds."""


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(names: list[str]) -> None:
    """Plan and dry-run each case; print one row each."""
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (wall times grow with other work)")
    print(f"{'case':<28} {'world':>6} {'dry run s':>10} {'peak RSS +MiB':>14}  result / plan")
    for name, path, preset, nodes, batch, precision, forced in CASES:
        if names and not any(n in name for n in names):
            continue
        mf = load_model_file(os.path.join(ROOT, path))
        cluster = load_cluster(preset, nodes=nodes)
        graph = trace_model(mf, progress=False)
        kwargs = {"precision": precision} if precision else {}
        try:
            plan = search(graph, cluster, CostModel(cluster), batch_size=batch, forced=forced, top_k=1,
                          model_path=mf.path, **kwargs).best
        except Exception as e:  # noqa: BLE001 — an optional dependency or a refused forcing: say so, go on
            print(f"{name:<28} skipped: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rss0 = _rss_mib()
        dry_run(plan, mf)  # warm-up
        t0 = time.perf_counter()
        problems = dry_run(plan, mf)
        took = time.perf_counter() - t0
        m, run = plan.mesh, run_plan(plan).mesh
        desc = (f"dp={m.dp}{f' (run as {run.dp})' if run.dp != m.dp else ''} tp={m.tp} pp={m.pp} "
                f"v={plan.virtual_stages} zero={plan.zero_stage} sp={int(plan.sequence_parallel)} "
                f"recompute={plan.recompute}{recompute_counts(plan)} mbs={plan.microbatch_size} {plan.precision}")
        print(f"{name:<28} {plan.world_size:>6} {took:>10.2f} {_rss_mib() - rss0:>14.0f}  "
              f"{'ok' if not problems else problems[0][:100]}  {desc}  (load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
