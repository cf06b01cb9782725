"""Measuring a running plan: step times (warm-up excluded, median and spread), memory, and predicted vs measured.

Memory on CPU, where no allocator reports a peak, is what the memory model predicts, counted from the tensors this
rank holds: parameters, gradients and optimizer state (local shards of DTensors), plus the peak of the activations
autograd saves for backward, counted with `torch.autograd.graph.saved_tensors_hooks` (each storage once, parameters
excluded, released when autograd frees it). On GPU the peak is `torch.cuda.max_memory_allocated`.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn as nn

from planner.plan import Plan, write_atomic

if TYPE_CHECKING:
    from executor.runner import Runner


class _Held:
    """A saved tensor plus the bookkeeping that releases its bytes when autograd drops it."""

    __slots__ = ("t", "key", "owner")

    def __init__(self, t: torch.Tensor, key: int, owner: "SavedActivations"):
        self.t, self.key, self.owner = t, key, owner

    def __del__(self):
        self.owner._release(self.key)


class SavedActivations:
    """Live and peak bytes of activations saved for backward (see the module docstring)."""

    def __init__(self):
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor):
        base = t
        while base._base is not None:
            base = base._base
        if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
            return t
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        entry = self.live.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Held) else x

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    @contextlib.contextmanager
    def track(self):
        """Count saved activations while the block runs (the peak is kept across calls)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


@dataclass
class Timings:
    """Per-step wall times in seconds."""

    step: list[float] = field(default_factory=list)
    """Whole step."""
    forward_backward: list[float] = field(default_factory=list)
    """Forward and backward of all micro-batches (pipeline schedule included)."""
    optimizer: list[float] = field(default_factory=list)
    """Tied-gradient reduction and optimizer step."""

    def add(self, step: float, fb: float, opt: float) -> None:
        """Record one step."""
        self.step.append(step)
        self.forward_backward.append(fb)
        self.optimizer.append(opt)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measurement(runner: "Runner", warmup: int) -> dict[str, Any]:
    """The `measured` block of measured.json for this rank: step_time_s (median after warm-up), step_times_s
    (all), step_time_spread_s (max - min after warm-up), per-phase medians, and memory."""
    t = runner.timings
    kept = t.step[warmup:] or t.step
    mem = runner.memory_bytes()
    return {
        "step_time_s": _median(kept),
        "step_times_s": list(t.step),
        "warmup_steps": min(warmup, len(t.step)),
        "step_time_spread_s": (max(kept) - min(kept)) if kept else None,
        "forward_backward_s": _median(t.forward_backward[warmup:] or t.forward_backward),
        "optimizer_s": _median(t.optimizer[warmup:] or t.optimizer),
        "peak_memory_bytes": mem["peak"],
        "memory_bytes": mem,
        "notes": [runner.layout_note] if getattr(runner, "layout_note", "") else [],
    }


def _predicted_memory(pred: Mapping[str, Any]) -> float | None:
    for key in ("peak_memory_bytes", "memory_bytes", "memory_per_device_bytes"):
        v = pred.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, Mapping):
            for k in ("peak", "total", "max"):
                if isinstance(v.get(k), (int, float)):
                    return float(v[k])
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
            return float(max(v))
    return None


def compare(plan: Plan, measured: Mapping[str, Any]) -> dict[str, Any]:
    """measured.json's content: `predicted` (copied from the plan), `measured`, and `error` (relative:
    (measured - predicted) / predicted) for step time and peak memory where both exist."""
    pred = dict(plan.predicted)
    error: dict[str, float | None] = {}
    p_t, m_t = pred.get("step_time_s"), measured.get("step_time_s")
    error["step_time"] = (m_t - p_t) / p_t if p_t and m_t is not None else None
    p_m, m_m = _predicted_memory(pred), measured.get("peak_memory_bytes")
    error["peak_memory"] = (m_m - p_m) / p_m if p_m and m_m is not None else None
    return {"predicted": pred, "measured": dict(measured), "error": error,
            "plan": {"mesh": plan.to_dict()["mesh"], "zero_stage": plan.zero_stage,
                     "schedule": plan.schedule, "recompute": plan.recompute,
                     "num_microbatches": plan.num_microbatches, "global_batch_size": plan.global_batch_size}}


def _fmt_t(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def _fmt_b(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f} MiB"


def _fmt_e(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def format_report(plan: Plan, measured: Mapping[str, Any]) -> str:
    """Predicted vs measured side by side, with relative errors, as a rich table (plain text)."""
    from rich import box
    from rich.table import Table

    from planner.tables import render
    c = compare(plan, measured)
    p, m, e = c["predicted"], c["measured"], c["error"]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("")
    for name in ("predicted", "measured", "error"):
        table.add_column(name, justify="right")
    table.add_row("step time", _fmt_t(p.get("step_time_s")), _fmt_t(m.get("step_time_s")), _fmt_e(e["step_time"]))
    table.add_row("peak memory / rank", _fmt_b(_predicted_memory(p)), _fmt_b(m.get("peak_memory_bytes")),
                  _fmt_e(e["peak_memory"]))
    mem = m.get("memory_bytes", {})
    for k in ("parameters", "gradients", "optimizer_state", "activations"):
        if k in mem:
            table.add_row(f"  {k}", "", _fmt_b(mem[k]), "")
    if m.get("step_time_spread_s") is not None:
        table.add_row("step time spread", "", _fmt_t(m["step_time_spread_s"]), "")
    return "\n".join([render(table)] + [f"note: {n}" for n in m.get("notes", ())])


def write_calibration(path: str | os.PathLike, plan: Plan, result: Mapping[str, Any]) -> dict[str, Any]:
    """Record a measured step time next to the prediction in a calibration file (JSON), atomically.

    The file holds `entries` (one per measured plan: cluster, mesh, predicted and measured step time, their ratio)
    and `step_time_scale`, the median measured/predicted ratio over entries of the same cluster — the factor a
    later `plan` call on that profile multiplies its predicted step times by.
    """
    data: dict[str, Any] = {"entries": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    p, m = result["predicted"].get("step_time_s"), result["measured"].get("step_time_s")
    entry = {"cluster": plan.cluster.get("name", ""), "mesh": result["plan"]["mesh"],
             "zero_stage": plan.zero_stage, "predicted_step_time_s": p, "measured_step_time_s": m,
             "ratio": (m / p) if p and m else None}
    data.setdefault("entries", []).append(entry)
    ratios = [e["ratio"] for e in data["entries"] if e["ratio"] and e["cluster"] == entry["cluster"]]
    data["cluster"] = entry["cluster"]
    data["step_time_scale"] = statistics.median(ratios) if ratios else None
    write_atomic(path, json.dumps(data, indent=1) + "\n")
    return data
