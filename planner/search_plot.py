"""`plan ... --plot FILE.png`: every candidate the search predicted, as predicted step time against peak memory
per device, with the device's usable memory, the Pareto front, the chosen plan and the `--top K` labelled (in a
zoom beside the overview: the best candidates often lie within a few percent of each other).

matplotlib is an optional extra (`pip install 'shardwise[plot]'`); `check_plot_path` is called before the
search so a missing install costs nothing. PNG, SVG or PDF by the file's extension.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from planner.errors import PlanError
from hardware_profiles.files import atomic_output

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
    """The (memory, time) points that no other point beats on both (no more memory and less time), by
    increasing memory."""
    front: list[tuple[float, float]] = []
    for mem, t in sorted(points):
        if not front or t < front[-1][1]:
            front.append((mem, t))
    return front


def plot_search(result: Any, usable_bytes: float, path: str | os.PathLike, top_k: int | None = None,
                title: str = "") -> None:
    """Draw `result.evaluated` (every candidate a SearchResult predicted) to `path`, written atomically: on the
    left all of them, on the right a zoom on the `top_k` best with their configurations written beside them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = list(result.evaluated)
    top = list(result.candidates[:top_k] if top_k else result.candidates)
    if not ev:  # a result built without the search's record
        ev = [_as_point(plan, pred) for plan, pred in top]
    scale, unit = (1.0, "s") if max(e.step_time_s for e in ev) >= 1 else (1e3, "ms")
    pts = _Points(ev, top, usable_bytes, scale)
    fig, (ax, az) = plt.subplots(1, 2, figsize=(13, 5.6), dpi=100, gridspec_kw={"width_ratios": [1.3, 1]})
    pts.draw(ax, legend=True)
    times = [t for _, t in pts.fit + pts.over]
    log_y = max(times) / max(min(times), 1e-30) > 8
    if log_y:
        _log_axis(ax.yaxis, ax.set_yscale)
    if max(pts.mems) / max(min(pts.mems), 1e-30) > 20:
        _log_axis(ax.xaxis, ax.set_xscale)
    pts.draw(az, legend=False)
    window = pts.zoom_window()
    az.set_xlim(*window[0])
    az.set_ylim(*window[1])
    from matplotlib.patches import Rectangle
    ax.add_patch(Rectangle((window[0][0], window[1][0]), window[0][1] - window[0][0], window[1][1] - window[1][0],
                           fill=False, ls=":", lw=1.0, color="0.25", zorder=6))
    key = ("labels: dp x tp x pp, Z = ZeRO stage, micro-batch size x count,\n"
           "recompute attn/sel/full (full[N]: the first N blocks of each stage),\n"
           "intV = interleaved (v = V), sp = sequence parallel")
    for a, sub in ((ax, f"all {len(ev)} candidates predicted\n\n"), (az, f"zoom: the top {len(top)}\n{key}")):
        a.set_xlabel("predicted peak memory per device (GiB)")
        a.set_ylabel(f"predicted step time ({unit})")
        a.set_title(sub, fontsize=8.5, loc="left")
        a.grid(True, which="major", color="0.88", lw=0.6)
    fig.suptitle(title or "plan search", fontsize=11, x=0.01, ha="left")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    fig.tight_layout()  # the final layout, before the labels are placed in pixels
    pts.label_top(az, unit)
    _save(fig, path)
    plt.close(fig)


class _Points:
    """The plot's data in plot units (GiB, seconds or ms): fitting and non-fitting candidates, the usable limit,
    the Pareto front, the top k."""

    def __init__(self, ev: list, top: list, usable_bytes: float, scale: float):
        gib = 2 ** 30
        self.fit = [(e.peak_memory_bytes / gib, e.step_time_s * scale) for e in ev if e.fits]
        self.over = [(e.peak_memory_bytes / gib, e.step_time_s * scale) for e in ev if not e.fits]
        self.limit = usable_bytes / gib
        self.front = pareto_front(self.fit)
        self.top = [((pred.peak_memory_bytes / gib, pred.step_time_s * scale), plan) for plan, pred in top]
        self.mems = [m for m, _ in self.fit + self.over] + [self.limit]

    def draw(self, ax: Any, legend: bool) -> None:
        """Every point, the limit (line, and the region beyond it shaded), the front and the top-k markers."""
        lab = (lambda text: text) if legend else (lambda text: None)
        ax.axvspan(self.limit, max(self.mems) * 1.05, color="0.93", lw=0)
        ax.axvline(self.limit, color="tab:red", ls="--", lw=1.2,
                   label=lab(f"usable memory per device ({self.limit:.1f} GiB)"))
        if self.over:
            ax.scatter(*zip(*self.over), marker="x", s=14, lw=0.8, color="0.55",
                       label=lab(f"does not fit ({len(self.over)})"))
        if self.fit:
            ax.scatter(*zip(*self.fit), s=14, color="tab:blue", alpha=0.55, lw=0, label=lab(f"fits ({len(self.fit)})"))
            ax.step(*zip(*self.front), where="post", color="tab:orange", lw=1.6, label=lab("Pareto front (fitting)"))
        if self.top:
            ax.scatter(*self.top[0][0], marker="*", s=260, color="tab:green", edgecolor="black", lw=0.7, zorder=5,
                       label=lab("chosen plan"))
        if len(self.top) > 1:
            ax.scatter(*zip(*(p for p, _ in self.top[1:])), marker="o", s=46, facecolor="none", edgecolor="black",
                       lw=1.0, zorder=4, label=lab(f"top {len(self.top)}"))

    def zoom_window(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """x and y limits around the top k (and the usable limit when it is near), with room for labels."""
        xs = [p[0] for p, _ in self.top]
        ys = [p[1] for p, _ in self.top]
        x0, x1 = min(xs), max(xs)
        if x1 < self.limit < x1 * 1.25:
            x1 = self.limit
        span = max(x1 - x0, 0.1 * x1)
        y0, y1 = min(ys), max(ys)
        yspan = max(y1 - y0, 0.01 * y1)
        return (x0 - 0.12 * span, x1 + 0.55 * span), (y0 - 0.25 * yspan, y1 + 0.6 * yspan)

    def label_top(self, ax: Any, unit: str) -> None:
        """Write each top-k candidate's rank, configuration and step time beside it (to the left of points in the
        right half), moved up, with a line to its point, until it overlaps no earlier label and no top-k marker."""
        from matplotlib.transforms import Bbox

        from planner.search.outer import candidate_label
        renderer = ax.figure.canvas.get_renderer()
        (left, _), (right, _) = ax.transAxes.transform([(0, 0), (1, 1)])
        taken = [Bbox.from_bounds(px - 6, py - 6, 12, 12) for px, py in ax.transData.transform([p for p, _ in self.top])]
        for i, ((x, y), plan) in enumerate(self.top, 1):
            on_left = ax.transData.transform((x, y))[0] > (left + right) / 2
            kw = dict(textcoords="offset pixels", ha="right" if on_left else "left", fontsize=8,
                      fontweight="bold" if i == 1 else "normal", zorder=7,
                      bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8))
            text, dx, dy = f"#{i} {candidate_label(plan)}  {y:#.4g} {unit}", -9 if on_left else 9, -4
            for _ in range(40):
                probe = ax.annotate(text, (x, y), xytext=(dx, dy), **kw)
                box = probe.get_window_extent(renderer).expanded(1.0, 1.15)
                probe.remove()
                if not any(box.overlaps(b) for b in taken):
                    break
                dy += 12
            taken.append(box)
            ax.annotate(text, (x, y), xytext=(dx, dy), **kw,
                        arrowprops=dict(arrowstyle="-", lw=0.5, color="0.35") if dy > 8 else None)


def _log_axis(axis: Any, set_scale: Any) -> None:
    """A log scale with ticks at 1, 2, 5 x 10^k (1 x 10^k over more than 3 decades) written as plain numbers."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    set_scale("log")
    lo, hi = axis.get_data_interval()
    decades = math.log10(hi / lo) if lo > 0 else 0
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _as_point(plan: Any, pred: Any) -> Any:
    from planner.search.outer import Evaluated, candidate_label
    return Evaluated(pred.step_time_s, pred.peak_memory_bytes, pred.fits, candidate_label(plan))


def _save(fig: Any, path: str | os.PathLike) -> None:
    """savefig via `atomic_output` (a failed write leaves the old file; a symlink's target is written)."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    try:
        with atomic_output(path, suffix=ext) as tmp:
            fig.savefig(tmp, format=ext[1:] if ext in FORMATS else "png")
    except OSError as e:
        raise PlanError(f"--plot {path}: cannot write it ({e.strerror or e}); give a file path in a folder you can "
                        "write to") from None
