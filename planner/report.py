"""Text report of a search result: the plan, its predicted step time and breakdown, throughput, memory, and the
assumptions behind the numbers."""
from __future__ import annotations

import os

from typing import Any

from planner.plan import block_counts, recompute_counts


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def format_plan(plan) -> str:
    """One line describing a plan's configuration."""
    m = plan.mesh
    sched = plan.schedule + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")
    return (f"dp={m.dp} tp={m.tp} pp={m.pp}  zero={plan.zero_stage}  mbs={plan.microbatch_size} x "
            f"{plan.num_microbatches} micro-batches  recompute={plan.recompute}{_blocks(plan)}  schedule={sched}  "
            f"sp={int(plan.sequence_parallel)}  {plan.precision}"
            + (f"  max_grad_norm={plan.max_grad_norm:g}" if plan.max_grad_norm > 0 else ""))


def _blocks(plan) -> str:
    """Partial full recomputation's blocks per stage, as format_plan says them."""
    counts = block_counts(plan)
    if not counts:
        return ""
    full = "full on " if plan.recompute == "selective" else ""
    if len(plan.recompute_blocks) == 1:
        return f" ({full}the first {counts} blocks)"
    return f" ({full}the first blocks of each stage: {counts})"


SHOWN_RANKS = 8
"""Pipeline ranks whose memory the report lists (a deep pipeline's others are elided)."""


def format_prediction(pred, usable_bytes: float | None = None) -> list[str]:
    """Lines with a prediction's step time, breakdown, throughput and memory."""
    b = pred.breakdown
    lines = [f"predicted step time: {_ms(pred.step_time_s)}"]
    parts = ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")
    total = pred.step_time_s or 1.0
    lines.append("  " + "  ".join(f"{k[:-2].replace('_', ' ')} {_ms(b.get(k, 0.0))} ({b.get(k, 0.0) / total:.0%})"
                                  for k in parts))
    extra = [k for k in ("tp_comm_s", "dp_comm_s", "pp_comm_s", "recompute_s") if k in b]
    if extra:
        lines.append("  totals: " + "  ".join(f"{k[:-2].replace('_', ' ')} {_ms(b[k])}" for k in extra))
    passes = [p for p in ("forward", "backward") if b.get(f"{p}_host_s") and b.get(f"{p}_kernels_s")]
    if passes:
        # a pass's compute is the sum of kernels and host dispatch on CPU ranks, less where they overlap (GPUs)
        if any(b.get(f"{p}_compute_s", 0.0) < 0.999 * (b[f"{p}_kernels_s"] + b[f"{p}_host_s"]) for p in passes):
            # a GPU's host runs ahead of its kernels; a pass whose dispatch takes longer leaves the device idle
            lines.append("  kernels / host dispatch (overlapped): " + "  ".join(
                f"{p} {_ms(b[f'{p}_kernels_s'])} / {_ms(b[f'{p}_host_s'])}"
                + (" (host-bound)" if b[f"{p}_host_s"] > b[f"{p}_kernels_s"] else "") for p in passes))
        else:  # CPU ranks run each op's kernel as they dispatch it
            lines.append("  kernels + host dispatch (in turn): " + "  ".join(
                f"{p} {_ms(b[f'{p}_kernels_s'])} + {_ms(b[f'{p}_host_s'])}" for p in passes))
    lines.append(f"throughput: {pred.tflops_per_device:.1f} TFLOP/s per device, MFU {pred.mfu:.1%}")
    fits = "fits" if pred.fits else "DOES NOT FIT"
    usable = f" of {_gib(usable_bytes)} usable" if usable_bytes else ""
    per_rank = list(pred.memory_per_device_bytes)
    peak_rank = max(range(len(per_rank)), key=per_rank.__getitem__, default=0)
    lines.append(f"memory per device: {_gib(pred.peak_memory_bytes)} peak{usable} ({fits}); per pipeline rank: "
                 + ", ".join(_gib(x) for x in per_rank[:SHOWN_RANKS])
                 + (" ..." if len(per_rank) > SHOWN_RANKS else "")
                 # the peak rank is named when the ranks shown do not hold it
                 + (f" (peak: rank {peak_rank} of {len(per_rank)})" if peak_rank >= SHOWN_RANKS else ""))
    mb = pred.memory_breakdown
    if mb:
        lines.append("  " + "  ".join(f"{k} {_gib(v)}" for k, v in mb.items()))
    return lines


PARTS = ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")
"""Breakdown parts that add up to the step time."""
TOTALS = ("tp_comm_s", "dp_comm_s", "pp_comm_s", "recompute_s")
"""Informative totals (partly overlapped with compute)."""


def _config(plan) -> dict[str, str]:
    m = plan.mesh
    return {"mesh": f"{m.dp}x{m.tp}x{m.pp}", "ZeRO": str(plan.zero_stage),
            "mbs": f"{plan.microbatch_size}x{plan.num_microbatches}",
            "recompute": plan.recompute + recompute_counts(plan),
            "schedule": "-" if m.pp == 1 else plan.schedule + (f"(v{plan.virtual_stages})"
                                                                if plan.virtual_stages > 1 else ""),
            "sp": "on" if plan.sequence_parallel else "off"}


TOP_COLUMNS = ("#", "mesh dpxtpxpp", "ZeRO", "mbs x m", "recompute", "schedule", "sp", "step", "TFLOP/s", "MFU",
               "mem/device")
"""Header of the `--top K` table."""


def format_top(candidates: list, k: int | None = None, title: str | None = None) -> list[str]:
    """The `--top K` table (rich, as plain text lines): mesh (dp x tp x pp), ZeRO, micro-batch size x count,
    recompute, schedule, sequence parallelism, predicted step, TFLOP/s per device, MFU and peak memory per device,
    best first."""
    from rich import box
    from rich.table import Table

    from planner.tables import render
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", show_edge=False, pad_edge=False)
    for j, name in enumerate(TOP_COLUMNS):
        table.add_column(name, justify="right" if j in (0, 7, 8, 9, 10) else "left", no_wrap=True)
    for i, (plan, pred) in enumerate(candidates[:k] if k else candidates, 1):
        c = _config(plan)
        table.add_row(str(i), c["mesh"], c["ZeRO"], c["mbs"], c["recompute"], c["schedule"], c["sp"],
                      _ms(pred.step_time_s), f"{pred.tflops_per_device:.1f}", f"{pred.mfu:.1%}",
                      _gib(pred.peak_memory_bytes))
    return render(table).splitlines()


def explain(best, pred, other, other_pred) -> list[str]:
    """Why `best` beats `other`: what differs in the configuration, and the breakdown parts that differ, largest
    first (positive = the runner-up spends longer)."""
    a, b = _config(best), _config(other)
    diff = [f"{k} {b[k]} (winner: {a[k]})" for k in a if a[k] != b[k]]
    gap = other_pred.step_time_s - pred.step_time_s
    lines = [f"why this plan: the runner-up ({', '.join(diff) or 'same configuration, other placements'}) is "
             f"predicted {_ms(gap)} slower per step ({gap / max(pred.step_time_s, 1e-30):.1%})"]
    if gap <= pred.step_time_s * 1e-6:
        lines.append("  they tie on step time; the winner is the simpler plan (less ZeRO sharding, less "
                     "recompute, fewer pipeline and tensor splits)")
    deltas = []
    for key in PARTS + TOTALS:
        d = other_pred.breakdown.get(key, 0.0) - pred.breakdown.get(key, 0.0)
        if abs(d) > 1e-12:
            deltas.append((abs(d), key, d))
    for _, key, d in sorted(deltas, reverse=True):
        where = "" if key in PARTS else " (total, partly overlapped)"
        verb = "more" if d > 0 else "less"
        lines.append(f"  {key[:-2].replace('_', ' ')}: runner-up spends {_ms(abs(d))} {verb}{where}")
    dm = other_pred.peak_memory_bytes - pred.peak_memory_bytes
    lines.append(f"  memory per device: runner-up {_gib(other_pred.peak_memory_bytes)} vs "
                 f"{_gib(pred.peak_memory_bytes)} ({'+' if dm >= 0 else '-'}{_gib(abs(dm))})")
    return lines


def _shown_path(path: str | None) -> str:
    """A model path as the user most likely gave it: relative to the working folder when under it (plan.json keeps
    the absolute one, which `plan measure` reads from anywhere)."""
    if not path:
        return "?"
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith(os.pardir) else rel


def format_result(result: Any, explain: bool = False, top: int | None = None) -> str:
    """The report `plan` prints: the chosen plan, its prediction, the `--top K` table of candidates (and, with
    `explain`, why the winner beats the runner-up), search statistics, notes and assumptions."""
    best, pred = result.best, result.best_prediction
    cl = getattr(best, "cluster", {}) or {}
    lines = [f"plan for {_shown_path(best.model.get('path'))} on {cl.get('name', '?')} "
             f"({cl.get('nodes', '?')} node(s) x {cl.get('devices_per_node', '?')} devices), "
             f"global batch {best.global_batch_size}",
             "  " + format_plan(best)]
    if best.stages and best.mesh.pp > 1:
        lines.append("  stages (layers): " + " ".join(f"[{s.start_layer},{s.end_layer})" for s in best.stages))
    if best.ops:
        counts: dict[str, int] = {}
        for p in best.ops.values():
            counts[p.strategy] = counts.get(p.strategy, 0) + 1
        lines.append("  per-op placements: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    lines += format_prediction(pred, None)
    shown = result.candidates[:top] if top else result.candidates
    if len(shown) > 1:
        lines.append(f"top {len(shown)} candidates:")
        lines += ["  " + row for row in format_top(result.candidates, top)]
    if explain:
        if len(result.candidates) > 1:
            lines += _explain(best, pred, *result.candidates[1])
        else:
            lines.append(NO_RUNNER_UP)
    stats = getattr(result, "stats", None) or {}
    if stats:
        lines.append(f"search: {stats.get('groups_evaluated', 0)} of {stats.get('groups', 0)} candidate groups "
                     f"evaluated, {stats.get('predictions', 0)} predictions, {stats.get('ilp_solves', 0)} placement "
                     f"ILPs, {stats.get('seconds', 0.0):.1f} s")
    for n in result.notes:
        lines.append(f"note: {n}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in pred.assumptions]
    return "\n".join(lines)


_explain = explain
NO_RUNNER_UP = "why this plan: no runner-up (no other candidate fits; with --force, the forced keys leave one)"


def report_dict(result: Any, explain: bool = False, top: int | None = None) -> dict[str, Any]:
    """What `format_result` prints, as plain data (`plan --json`): `plan` (exactly what `-o` writes),
    `prediction` (step time, breakdown, memory, throughput, assumptions), `candidates` (the `--top K`, best first,
    configuration and prediction each), `search` (statistics), `notes`, `assumptions`, and with `explain` the
    `explain` lines."""
    from planner.search.outer import candidate_label
    best, pred = result.best, result.best_prediction
    cands = []
    for i, (plan, p) in enumerate(result.candidates[:top] if top else result.candidates, 1):
        d = plan.to_dict()
        cands.append({"rank": i, "label": candidate_label(plan), "mesh": d["mesh"], "zero_stage": plan.zero_stage,
                      "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches,
                      "recompute": plan.recompute, "recompute_blocks": list(plan.recompute_blocks),
                      "schedule": plan.schedule,
                      "virtual_stages": plan.virtual_stages, "sequence_parallel": plan.sequence_parallel,
                      "step_time_s": p.step_time_s, "tflops_per_device": p.tflops_per_device, "mfu": p.mfu,
                      "peak_memory_bytes": p.peak_memory_bytes, "fits": p.fits})
    out = {"plan": best.to_dict(), "prediction": pred.to_dict(), "candidates": cands,
           "search": dict(getattr(result, "stats", None) or {}), "notes": list(result.notes),
           "assumptions": list(pred.assumptions)}
    if explain:
        out["explain"] = (_explain(best, pred, *result.candidates[1]) if len(result.candidates) > 1 else
                          [NO_RUNNER_UP])
    return out


def format_json(result: Any, explain: bool = False, top: int | None = None) -> str:
    """`report_dict` as JSON text (`plan --json`)."""
    import json
    return json.dumps(report_dict(result, explain, top), indent=1)
