"""Pictures of a measured plan (matplotlib, the optional `plot` extra): the predicted and measured step as swim
lanes (`plan measure --trace DIR` writes DIR/compare.png), and predicted vs measured step time with its breakdown
(`plan measure --plot FILE.png`). Both read only data (Chrome traces, measured.json content), never the cost model.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from executor.errors import ExecutorError
from executor.trace import MEASURED_PID, TRACKS
from hardware_profiles.files import atomic_output

COLORS = {"compute": "#4C72B0", "tp comm": "#DD8452", "dp comm": "#55A868", "pp comm": "#C44E52",
          "bubble": "#BBBBBB", "optimizer": "#8172B3", "exposed comm": "#DD8452"}
"""One color per track / category (seaborn's 'deep' palette)."""
CATEGORIES = (("compute", "compute_s"), ("exposed comm", "exposed_comm_s"), ("bubble", "bubble_s"),
              ("optimizer", "optimizer_s"))
"""Breakdown categories of a step (label, key in the predicted breakdown / measured categories)."""


def have_matplotlib() -> bool:
    """Whether matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str | os.PathLike) -> None:
    """Save as PNG via `atomic_output` (a failed write leaves the old file; a symlink's target is written)."""
    try:
        with atomic_output(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    except OSError as e:
        raise ExecutorError(f"--plot {os.fspath(path)}: cannot write it ({e.strerror or e}); give a file path in a "
                            "folder you can write to") from None


def _lanes(doc: Mapping[str, Any]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(pid, track) -> spans (start, duration) in ms."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    out: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault((e["pid"], names[(e["pid"], e["tid"])]), []).append((e["ts"] / 1e3, e["dur"] / 1e3))
    return out


def _process_names(doc: Mapping[str, Any]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "process_name"}


def swimlanes(compare: Mapping[str, Any], path: str | os.PathLike, title: str = "") -> None:
    """Draw a merged predicted+measured trace (executor.trace.merge) as one lane per (process, track): the
    predicted pipeline ranks on top, the measured ranks below, on one time axis from the step's start."""
    plt = _pyplot()
    lanes = _lanes(compare)
    procs = _process_names(compare)
    used = [t for t in TRACKS if any(tr == t for _, tr in lanes)] + sorted({t for _, t in lanes} - set(TRACKS))
    rows = [(pid, t) for pid in sorted(procs) for t in used if (pid, t) in lanes]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.3))
    for i, (pid, track) in enumerate(rows):
        y = len(rows) - 1 - i
        ax.broken_barh(lanes[(pid, track)], (y - 0.4, 0.8), facecolors=COLORS.get(track, "#999999"),
                       edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs[pid]} · {t}" for pid, t in reversed(rows)], fontsize=7)
    other = compare.get("otherData") or {}
    ends = {pid: (other.get("predicted") or {}).get("step_time_s") for pid in procs if pid < MEASURED_PID}
    ends.update({MEASURED_PID + m.get("rank", 0): (m.get("step_time_s") or 0.0) + (m.get("step_offset_s") or 0.0)
                 for m in other.get("measured") or []})
    for pid, end in ends.items():  # a dashed line where each process's step ends
        ys = [len(rows) - 1 - i for i, (p, _) in enumerate(rows) if p == pid]
        if end and ys:
            ax.vlines(end * 1e3, min(ys) - 0.45, max(ys) + 0.45, colors="black", linestyles="dashed", linewidth=0.8)
    split = sum(1 for pid, _ in rows if pid < MEASURED_PID)
    if 0 < split < len(rows):
        ax.axhline(len(rows) - split - 0.5, color="black", linewidth=0.8)
    ax.set_xlabel("ms from the step's start")
    ax.set_xlim(left=0)
    ax.grid(axis="x", linewidth=0.3)
    ax.set_title((title or "predicted (top) vs measured (bottom), one step") + "; dashed: step end", fontsize=9)
    _save(fig, path)
    plt.close(fig)


def measure_bars(results: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Predicted vs measured per plan: step time bars, and the step split into compute / exposed comm / bubble /
    optimizer. `results` are measured.json contents; a result's measured split comes from its `trace` block
    (`plan measure --trace`); without one only the measured total is drawn, and the picture says so."""
    if not results:
        raise ExecutorError("--plot: nothing was measured")
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2 + 0.2 * len(results)),
                                      gridspec_kw={"width_ratios": [1, 2]})
    labels = [_label(r) for r in results]
    ys = [len(results) - 1 - i for i in range(len(results))]  # the first plan on top, as on the right
    pred = [r["predicted"].get("step_time_s") or 0.0 for r in results]
    meas = [r["measured"].get("step_time_s") or 0.0 for r in results]
    left.barh([y + 0.2 for y in ys], [p * 1e3 for p in pred], 0.4, color="#999999", label="predicted")
    left.barh([y - 0.2 for y in ys], [m * 1e3 for m in meas], 0.4, color="#4C72B0", label="measured")
    for y, p, m in zip(ys, pred, meas):
        left.text(p * 1e3, y + 0.2, f" {p * 1e3:.1f}", va="center", fontsize=7)
        left.text(m * 1e3, y - 0.2, f" {m * 1e3:.1f}", va="center", fontsize=7)
    left.margins(x=0.2)
    left.set_yticks(ys)
    left.set_yticklabels(labels, fontsize=8)
    left.set_xlabel("step time (ms; measured: median)")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    missing = False
    ticks, names = [], []
    for i, r in enumerate(results):
        split = (r.get("trace") or {}).get("measured_categories")
        missing |= split is None
        for j, (side, cats) in enumerate((("predicted", r["predicted"].get("breakdown") or {}), ("measured", split))):
            y = 2.5 * (len(results) - 1 - i) + (1 - j)
            ticks.append(y)
            names.append(f"{labels[i]} {side}")
            if cats is None:
                right.barh(y, meas[i] * 1e3, 0.8, color="white", edgecolor="black", hatch="//")
                right.text(meas[i] * 1e3, y, "  total only (no --trace)", va="center", fontsize=7)
                continue
            x = 0.0
            for name, key in CATEGORIES:
                v = (cats.get(key) or 0.0) * 1e3
                right.barh(y, v, 0.8, left=x, color=COLORS[name], label=name if i == 0 and j == 0 else None)
                x += v
    right.set_yticks(ticks)
    right.set_yticklabels(names, fontsize=8)
    right.set_xlabel("ms per step")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(CATEGORIES), frameon=False)
    note = "measured split: the median profiled step (torch.profiler trace)" if not missing else \
        "measured split needs --trace DIR (torch.profiler); without it only the measured total is shown"
    right.set_title(note, fontsize=8)
    fig.suptitle("plan measure: predicted vs measured", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _label(result: Mapping[str, Any]) -> str:
    p = result.get("plan", {})
    mesh = p.get("mesh", {})
    return (f"dp{mesh.get('dp', 1)} tp{mesh.get('tp', 1)} pp{mesh.get('pp', 1)}"
            + (f" z{p['zero_stage']}" if p.get("zero_stage") else ""))
