"""The searched plan against three hand baselines, predicted by the cost model, for the GPT sizes of Megatron-LM's
Table 1 (1.7B -> 1T, with that table's GPU counts and global batches) on dgx-a100-80gb and dgx-h100:

- DDP: dp = all GPUs, ZeRO-0;
- ZeRO-3: dp = all GPUs, ZeRO-3 (FSDP);
- TP=node, PP across nodes: tp = GPUs per node, pp = the largest divisor of the node count not above the layer
  count, dp = the rest (Megatron placements, even stages, 1F1B).

Baselines use `planner.defaults.default_plan` (micro-batch 1, no recompute); a baseline that does not fit is shown
as OOM. The last column is the chosen plan's speed-up over the best baseline that fits.

    python3 benchmarks/search_baselines.py [--models 1.7B,18B] [--clusters dgx-a100-80gb]
"""
from __future__ import annotations

import argparse

from search_common import MEGATRON_TABLE1, gpt_graph

from cost_model.model import CostModel
from hardware_profiles.load import load_cluster
from planner.defaults import default_plan
from planner.errors import PlanError
from planner.plan import recompute_counts
from planner.search import search


def baselines(graph, cluster, batch: int, layers: int) -> dict[str, dict]:
    """Forced keys of the three baselines."""
    world, dpn, nodes = cluster.world_size, cluster.devices_per_node, cluster.nodes
    pp = max(d for d in range(1, nodes + 1) if nodes % d == 0 and d <= layers)
    return {"DDP": {"dp": world, "tp": 1, "pp": 1, "zero": 0}, "ZeRO-3": {"dp": world, "tp": 1, "pp": 1, "zero": 3},
            "TP=node,PP=nodes": {"dp": world // (dpn * pp), "tp": dpn, "pp": pp}}


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MEGATRON_TABLE1))
    ap.add_argument("--clusters", default="dgx-a100-80gb,dgx-h100")
    ap.add_argument("--time-budget", type=float, default=60.0)
    args = ap.parse_args()
    print(f"{'model':<6} {'cluster':<14} {'GPUs':>5} {'DDP':>9} {'ZeRO-3':>9} {'TP=node,PP':>11} {'chosen':>9}  "
          "speed-up  chosen plan")
    for name in args.models.split(","):
        layers, hidden, heads, gpus, batch = MEGATRON_TABLE1[name]
        graph = gpt_graph(layers, hidden, heads)
        for preset in args.clusters.split(","):
            cluster = load_cluster(preset)
            cluster = cluster.with_nodes(gpus // cluster.devices_per_node)
            cm = CostModel(cluster)
            times = {}
            for label, forced in baselines(graph, cluster, batch, layers).items():
                try:
                    pred = cm.predict(graph, default_plan(graph, cluster, batch, "bf16", forced, ""))
                    times[label] = pred.step_time_s if pred.fits else None
                except PlanError:
                    times[label] = None
            res = search(graph, cluster, cm, batch_size=batch, time_budget_s=args.time_budget)
            best = res.best_prediction.step_time_s
            fitting = [t for t in times.values() if t is not None]
            speedup = f"{min(fitting) / best:7.2f}x" if fitting else "    n/a"
            p = res.best
            plan = " ".join(filter(None, (
                f"dp={p.mesh.dp} tp={p.mesh.tp} pp={p.mesh.pp} z{p.zero_stage} mbs{p.microbatch_size}",
                f"{p.recompute}{recompute_counts(p)}", p.schedule if p.mesh.pp > 1 else "",
                "sp" if p.sequence_parallel else "")))
            cell = lambda t: f"{t:9.3f}" if t is not None else f"{'OOM':>9}"  # noqa: E731
            print(f"{name:<6} {preset:<14} {gpus:>5} {cell(times['DDP'])} {cell(times['ZeRO-3'])} "
                  f"{cell(times['TP=node,PP=nodes']):>11} {best:9.3f}  {speedup}  {plan}", flush=True)


if __name__ == "__main__":
    main()
