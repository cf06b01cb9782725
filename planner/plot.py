"""`plan ... --plot FILE.png`: every candidate the search predicted, as predicted step time against peak memory
per device, with the device's usable memory, the Pareto front, the chosen plan and the `--top K` labelled.

matplotlib is an optional extra (`pip install 'shardwise[plot]'`); `require_matplotlib` is called before the
search so a missing install costs nothing. PNG, SVG or PDF by the file's extension.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence

from planner.errors import PlanError

HINT = "--plot needs matplotlib, which is not installed: pip install 'shardwise[plot]'"
"""The one line `plan --plot` prints without matplotlib."""


FORMATS = (".png", ".svg", ".pdf")
"""File types `--plot` writes, by extension."""


def check_plot_path(path: str) -> None:
    """Before the search: raise PlanError when matplotlib is missing (with the install hint) or `path` does not
    end in one of FORMATS."""
    if os.path.splitext(path)[1].lower() not in FORMATS:
        raise PlanError(f"--plot {path}: the file name must end in {', '.join(FORMATS)} (e.g. --plot search.png)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlanError(HINT) from None


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, time) points no other point beats on both (less or equal memory and strictly less time, or
    vice versa), by increasing memory."""
    front: list[tuple[float, float]] = []
    for mem, t in sorted(points):
        if not front or t < front[-1][1]:
            if front and front[-1][0] == mem:
                front[-1] = (mem, t)
            else:
                front.append((mem, t))
    return front


def _seconds_unit(values: Sequence[float]) -> tuple[float, str]:
    return (1.0, "s") if max(values) >= 1 else (1e3, "ms")


def plot_search(result: Any, usable_bytes: float, path: str | os.PathLike, top_k: int | None = None,
                title: str = "") -> None:
    """Draw `result.evaluated` (a SearchResult's predicted candidates) to `path` (PNG, written atomically)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2 ** 30
    ev = list(result.evaluated)
    top = list(result.candidates[:top_k] if top_k else result.candidates)
    if not ev:  # a result built without the search's record (e.g. a single forced prediction elsewhere)
        ev = [_as_point(plan, pred) for plan, pred in top]
    scale, unit = _seconds_unit([e.step_time_s for e in ev])
    fit = [e for e in ev if e.fits]
    over = [e for e in ev if not e.fits]
    limit = usable_bytes / gib

    fig, ax = plt.subplots(figsize=(9.5, 5.6), dpi=100)
    ax.axvspan(limit, max([limit * 1.05] + [e.peak_memory_bytes / gib * 1.05 for e in over]), color="0.93", lw=0)
    ax.axvline(limit, color="tab:red", ls="--", lw=1.2, label=f"usable memory per device ({limit:.1f} GiB)")
    if over:
        ax.scatter([e.peak_memory_bytes / gib for e in over], [e.step_time_s * scale for e in over], marker="x",
                   s=14, lw=0.8, color="0.55", label=f"does not fit ({len(over)})")
    if fit:
        ax.scatter([e.peak_memory_bytes / gib for e in fit], [e.step_time_s * scale for e in fit], s=14,
                   color="tab:blue", alpha=0.55, lw=0, label=f"fits ({len(fit)})")
        front = pareto_front([(e.peak_memory_bytes / gib, e.step_time_s * scale) for e in fit])
        ax.step([m for m, _ in front], [t for _, t in front], where="post", color="tab:orange", lw=1.6,
                label="Pareto front (fitting)")
    _mark_top(ax, top, scale, unit)
    times = [e.step_time_s * scale for e in ev]
    if max(times) / max(min(times), 1e-30) > 8:
        _log_axis(ax.yaxis, ax.set_yscale)
    mems = [e.peak_memory_bytes / gib for e in ev] + [limit]
    if max(mems) / max(min(mems), 1e-30) > 20:
        _log_axis(ax.xaxis, ax.set_xscale)
    ax.set_xlabel("predicted peak memory per device (GiB)")
    ax.set_ylabel(f"predicted step time ({unit})")
    ax.set_title(title or "plan search: every candidate predicted", fontsize=11, loc="left")
    ax.grid(True, which="major", color="0.88", lw=0.6)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _log_axis(axis: Any, set_scale: Any) -> None:
    """A log scale with ticks at 1, 2, 5 x 10^k written as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    set_scale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _mark_top(ax: Any, top: list, scale: float, unit: str) -> None:
    """Number the top-k points on the plot and list them in a box (label, step, memory): the top candidates
    usually sit within a few percent of each other, too close for labels beside the points."""
    from planner.search.outer import candidate_label
    gib = 2 ** 30
    lines = []
    for i, (plan, pred) in enumerate(top, 1):
        x, y = pred.peak_memory_bytes / gib, pred.step_time_s * scale
        if i == 1:
            ax.scatter([x], [y], marker="*", s=260, color="tab:green", edgecolor="black", lw=0.7, zorder=5,
                       label="chosen plan (#1)")
        else:
            ax.scatter([x], [y], marker="o", s=46, facecolor="none", edgecolor="black", lw=1.0, zorder=4)
        ax.annotate(str(i), (x, y), xytext=(5, 4 + 7 * ((i - 1) % 2)), textcoords="offset points", fontsize=8,
                    fontweight="bold", zorder=6)
        lines.append(f"#{i}  {candidate_label(plan):<24} {pred.step_time_s * scale:#8.4g} {unit}  "
                     f"{pred.peak_memory_bytes / gib:5.1f} GiB")
    if lines:
        ax.text(0.01, 0.985, f"top {len(lines)} (dp x tp x pp, ZeRO, mbs x micro-batches, ...)\n" + "\n".join(lines),
                transform=ax.transAxes, va="top", ha="left", fontsize=7.5, family="monospace", zorder=7,
                bbox=dict(boxstyle="round,pad=0.4", facecolor="white", edgecolor="0.7", alpha=0.92))


def _as_point(plan: Any, pred: Any) -> Any:
    from planner.search.outer import Evaluated, candidate_label
    return Evaluated(pred.step_time_s, pred.peak_memory_bytes, pred.fits, candidate_label(plan))


def _save(fig: Any, path: str | os.PathLike) -> None:
    """savefig to a temp file in the target folder, then rename (a failed write leaves the old file)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    ext = os.path.splitext(path)[1].lower()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=ext, dir=folder)
    os.close(fd)
    try:
        fig.savefig(tmp, format=ext[1:] if ext in FORMATS else "png")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a picture is for sharing
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
