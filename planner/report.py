"""Text report of a search result: the plan, its predicted step time and breakdown, throughput, memory, and the
assumptions behind the numbers."""
from __future__ import annotations

from typing import Any


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def format_plan(plan) -> str:
    """One line describing a plan's configuration."""
    m = plan.mesh
    sched = plan.schedule + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")
    return (f"dp={m.dp} tp={m.tp} pp={m.pp}  zero={plan.zero_stage}  mbs={plan.microbatch_size} x "
            f"{plan.num_microbatches} micro-batches  recompute={plan.recompute}  schedule={sched}  "
            f"sp={int(plan.sequence_parallel)}  {plan.precision}")


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
    lines.append(f"throughput: {pred.tflops_per_device:.1f} TFLOP/s per device, MFU {pred.mfu:.1%}")
    fits = "fits" if pred.fits else "DOES NOT FIT"
    usable = f" of {_gib(usable_bytes)} usable" if usable_bytes else ""
    lines.append(f"memory per device: {_gib(pred.peak_memory_bytes)} peak{usable} ({fits}); per pipeline rank: "
                 + ", ".join(_gib(x) for x in pred.memory_per_device_bytes[:8])
                 + (" ..." if len(pred.memory_per_device_bytes) > 8 else ""))
    mb = pred.memory_breakdown
    if mb:
        lines.append("  " + "  ".join(f"{k} {_gib(v)}" for k, v in mb.items()))
    return lines


def format_result(result: Any, explain: bool = False) -> str:
    """The report `plan` prints: the chosen plan, its prediction, the runners-up (and, with `explain`, why the
    winner beats the runner-up), notes and assumptions."""
    best, pred = result.best, result.best_prediction
    usable = None
    cl = getattr(best, "cluster", {}) or {}
    lines = [f"plan for {best.model.get('path', '?')} on {cl.get('name', '?')} "
             f"({cl.get('nodes', '?')} node(s) x {cl.get('devices_per_node', '?')} devices), "
             f"global batch {best.global_batch_size}",
             "  " + format_plan(best)]
    if best.stages and best.mesh.pp > 1:
        lines.append("  stages (layers): " + " ".join(f"[{s.start_layer},{s.end_layer})" for s in best.stages))
    lines += format_prediction(pred, usable)
    others = [(p, q) for p, q in result.candidates if p is not best and p != best]
    if others:
        lines.append("runners-up:")
        for p, q in others:
            lines.append(f"  {_ms(q.step_time_s):>10}  {format_plan(p)}")
    if explain and others:
        p, q = others[0]
        lines.append(f"why: {_ms(q.step_time_s - pred.step_time_s)} faster than the runner-up; breakdown difference: "
                     + "  ".join(f"{k} {_ms(pred.breakdown.get(k, 0) - q.breakdown.get(k, 0))}"
                                 for k in ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")))
    for n in result.notes:
        lines.append(f"note: {n}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in pred.assumptions]
    return "\n".join(lines)
