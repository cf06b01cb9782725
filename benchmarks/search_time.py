"""Search wall time on this machine (targets from issue 5, on a 2-core machine): GPT-2 1.5B on 8 GPUs <= 3 s,
GPT-3 175B on 1024 GPUs <= 20 s, MT-NLG 530B on 2520 GPUs <= 30 s. Tracing is timed separately.

    python3 benchmarks/search_time.py
"""
from __future__ import annotations

import os
import time

from search_common import gpt_graph

from cost_model.model import CostModel
from hardware_profiles.load import load_cluster
from planner.plan import recompute_counts
from planner.search import search

CASES = [
    # name, (layers, hidden, heads, seq), preset, nodes, global batch, target seconds
    ("GPT-2 1.5B / 8 GPUs", (48, 1600, 25, 1024), "dgx-a100-80gb", 1, 512, 3.0),   # Radford et al. 2019
    ("GPT-3 175B / 1024 GPUs", (96, 12288, 96, 2048), "dgx-a100-80gb", 128, 1536, 20.0),  # Brown et al. 2020
    ("MT-NLG 530B / 2520 GPUs", (105, 20480, 128, 2048), "dgx-a100-80gb", 315, 1920, 30.0),  # Smith et al. 2022
]


def main() -> None:
    """Trace each model, run the search with the real cost model, print the wall times against the targets."""
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (wall times grow with other work)")
    print(f"{'case':<26} {'trace s':>8} {'search s':>9} {'target s':>9}  groups evaluated/total  predictions  "
          "ILPs  chosen plan")
    for name, (layers, hidden, heads, seq), preset, nodes, batch, target in CASES:
        t0 = time.perf_counter()
        graph = gpt_graph(layers, hidden, heads, seq)
        t1 = time.perf_counter()
        cluster = load_cluster(preset, nodes=nodes)
        res = search(graph, cluster, CostModel(cluster), batch_size=batch, time_budget_s=120.0)
        t2 = time.perf_counter()
        p, s = res.best, res.stats
        chosen = (f"dp={p.mesh.dp} tp={p.mesh.tp} pp={p.mesh.pp} zero={p.zero_stage} mbs={p.microbatch_size} "
                  f"{p.recompute}{recompute_counts(p)} {p.schedule}{'(v%d)' % p.virtual_stages if p.virtual_stages > 1 else ''} "
                  f"sp={int(p.sequence_parallel)}: {res.best_prediction.step_time_s:.3f} s/step")
        print(f"{name:<26} {t1 - t0:8.1f} {t2 - t1:9.2f} {target:9.0f}  {s['groups_evaluated']:>8}/{s['groups']:<13} "
              f"{s['predictions']:>11} {s['ilp_solves']:>5}  {chosen}  (load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
