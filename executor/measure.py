"""Measuring a running plan: step times (warm-up excluded, median and spread), memory, and predicted vs measured.

Memory comes from an allocator-level view of this rank's tensors, never from the memory model's own sums: the
second and third steps run under torch's `MemTracker` (torch.distributed._tools.mem_tracker, a TorchDispatchMode
that follows every tensor storage an op creates or touches until it is freed, DTensor local shards and FSDP2's
resized buffers included, and sorts them into parameters, buffers, gradients, activations, temporaries and
optimizer state). The first tracked step finds the storages made before tracking began; the second is measured: its peak
total and the categories at that moment. Both are left out of the median step time (the tracker's Python dispatch
slows them). On GPU the peak is `torch.cuda.max_memory_allocated`, with the tracker's categories. The activations
autograd saves in the first step are still counted (`saved_tensors_hooks`) as an extra figure, `saved_activations`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn as nn

from executor.errors import ExecutorError
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


MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
"""Measured memory categories, as the memory model names them (`cost_model.memory`)."""
_TRACKER_CATEGORIES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer_state",
                       "Activation": "activations", "Temp": "temporaries", "Buffer": "temporaries",
                       "Other": "temporaries"}
"""MemTracker's reference types (`_MemRefType` values) -> our categories: module buffers and untyped storages count
with the temporaries (the model's buffers/temporaries)."""


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass


def _memory_tracker():
    """torch's MemTracker, except that a frozen parameter (requires_grad=False) gets no gradient hook: MemTracker
    registers one on every parameter of each module it enters, which raises for a frozen one ("cannot register a
    hook on a tensor that doesn't require gradient"), so any model with frozen weights crashed on its 2nd step.
    It also keeps only the step's own peak after each op, not every active module's (`_update_peak_stats`): the
    per-module peaks are never read here, and walking every tracked module after every op made a tracked step
    several times a plain one."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())  # cleared on exit, as its own
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():  # MemTracker's global half; ints: copy = deepcopy
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
    return Tracker()


@contextlib.contextmanager
def _released_input_hooks():
    """MemTracker's module tracker (torch.distributed._tools.mod_tracker) hooks each module's inputs that need a
    gradient with `register_multi_grad_hook`, whose hooks hold the inputs' gradient nodes; a leaf input's node (a
    pipeline stage's received activation) holds the input, and the input its hooks, so every stage input of a
    tracked step outlived it, and the second tracked step's peak counted the first's (a pp2 interleaved stage on 2
    CPU ranks: sixteen 64 KiB inputs a step). Here each such hook goes once it has run, at the end of its backward
    (an engine callback), and the rest when the step ends."""
    try:
        import torch.distributed._tools.mod_tracker as mod_tracker
        register = mod_tracker.register_multi_grad_hook
    except (ImportError, AttributeError):
        yield
        return
    handles = []

    def released(tensors, fn, *, mode="all"):
        handle = None

        def once(grads):
            fn(grads)
            torch.autograd.Variable._execution_engine.queue_callback(handle.remove)
        handle = register(tensors, once, mode=mode)
        handles.append(handle)
        return handle
    mod_tracker.register_multi_grad_hook = released
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()


class StepMemory:
    """Peak memory of one training step by category, from torch's MemTracker (see the module docstring).

    The runner asks `wants_step()` at every step; its second and third steps (or the two after `track_next()`)
    then run through `tracked_step`. Not the first: it initialises lazily (optimizer state, FSDP2, and the pipeline
    stages' shape inference, whose `autograd.grad` the tracker's module hooks break). `auto=False`: no step is
    tracked until `track_next()`."""

    STEPS = 2
    """Tracked steps: one to find storages made before tracking began, one measured."""

    def __init__(self, auto: bool = True):
        self.first = 1 if auto else math.inf
        self.calls = 0
        self.tracked = 0
        self.result: dict[str, int | None] = dict.fromkeys(MEMORY_CATEGORIES + ("peak",))
        """The last tracked step's peak and categories (None before one ran)."""
        self._tracker = None
        self._inside = False

    def track_next(self) -> None:
        """Track the next two steps."""
        self.first = self.calls

    def wants_step(self) -> bool:
        """Whether the step about to run should run under the tracker (counts the runner's steps)."""
        if self._inside:
            return False
        self.calls += 1
        return self.first <= self.calls - 1 < self.first + self.STEPS

    def tracked_step(self, runner: "Runner", inputs, targets) -> float:
        """One `runner.step` under MemTracker, marked in the runner's timings as tracked (left out of medians).
        `result` becomes this step's peak (the CUDA allocator's on GPU) and the categories at that peak."""
        if self._tracker is None:
            self._tracker = _memory_tracker()
            self._tracker.track_external(*runner.parts, runner.optimizer)
        mt = self._tracker
        roots = {id(p) for p in runner.parts}

        def new_micro_batch(mod, args):
            # MemTracker refuses a root module called twice (micro-batches, pipeline stages); its per-module
            # statistics are not used here, so forget the root's own (`memory_tracking`) when it starts another
            # forward; its submodules' stay, for the backward hooks of micro-batches still in flight
            if id(mod) in roots and torch._C._current_graph_task_id() == -1:
                mt.memory_tracking.pop(mod, None)

        hook = nn.modules.module.register_module_forward_pre_hook(new_micro_batch)  # runs before MemTracker's
        self._inside = True
        try:
            with mt, _released_input_hooks():  # entering resets the peak to what is live now
                loss = runner.step(inputs, targets)
        finally:
            self._inside = False
            hook.remove()
            mt.reset_mod_stats()
        runner.timings.tracked.append(len(runner.timings.step) - 1)
        self.tracked += 1
        self.result = self._read(mt, runner.device)
        return loss

    def _read(self, mt, device: torch.device) -> dict[str, int]:
        """Peak and categories of the last tracked step. Storages made in a forward that outlive the step (DDP
        rebuilds its buckets in its second forward) are buffers, not activations: moved to the temporaries."""
        def by_category(snap):
            dev = snap.get(device) or (next(iter(snap.values())) if snap else {})
            out = dict.fromkeys(MEMORY_CATEGORIES, 0)
            for k, v in dev.items():
                name = _TRACKER_CATEGORIES.get(getattr(k, "value", k))
                if name:
                    out[name] += int(v)
            return out, int(dev.get("Total", sum(out.values())))
        out, peak = by_category(mt.get_tracker_snapshot("peak"))
        left, _ = by_category(mt.get_tracker_snapshot("current"))
        moved = min(left["activations"], out["activations"])
        out["activations"] -= moved
        out["temporaries"] += moved
        out["peak"] = peak
        if device.type == "cuda":
            out["tracker_peak"] = peak
            out["peak"] = int(torch.cuda.max_memory_allocated(device))
        out["tracked_steps"] = self.tracked
        return out


@dataclass
class Timings:
    """Per-step wall times in seconds."""

    step: list[float] = field(default_factory=list)
    """Whole step."""
    forward_backward: list[float] = field(default_factory=list)
    """Forward and backward of all micro-batches (pipeline schedule included)."""
    optimizer: list[float] = field(default_factory=list)
    """Tied-gradient reduction and optimizer step."""
    passes: list[dict[str, float] | None] = field(default_factory=list)
    """Per step, `PassClock.totals` (None under a pipeline schedule, whose passes interleave across stages)."""
    tracked: list[int] = field(default_factory=list)
    """Indices of the steps run under the memory tracker (slower; left out of the medians)."""

    def kept(self, series: list, warmup: int) -> list:
        """The entries of `series` after `warmup` steps, tracked steps left out (all of them if none remain)."""
        out = [x for i, x in enumerate(series) if i >= warmup and i not in self.tracked]
        return out or list(series)

    def add(self, step: float, fb: float, opt: float, passes: dict[str, float] | None = None) -> None:
        """Record one step."""
        self.step.append(step)
        self.forward_backward.append(fb)
        self.optimizer.append(opt)
        self.passes.append(passes)


class PassClock:
    """Where a step's forward and backward passes spend their time: the host's seconds from the start of each pass
    to the start of the next (on CUDA the time to issue its kernels, which then run on their own; on CPU the
    pass itself, whose ops run as they are issued) and, on CUDA, the device's seconds between the same points
    (CUDA events: what the device ran plus the time it waited for the host). A device pass no longer than its
    host issue time waited for the host (host-bound); one longer ran its kernels behind a host that was ahead."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, float, Any]] = []

    def mark(self, kind: str) -> None:
        """A pass of `kind` ("F" or "B") starts now, or ("end") the last one ended."""
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((kind, time.perf_counter(), event))

    def totals(self) -> dict[str, float]:
        """Seconds summed over the step's micro-batches: forward_host_s, backward_host_s and, on CUDA,
        forward_device_s, backward_device_s. Call after the device has synchronised."""
        out = {"forward_host_s": 0.0, "backward_host_s": 0.0}
        if self.cuda:
            out.update(forward_device_s=0.0, backward_device_s=0.0)
        for (kind, t, ev), (_, t_next, ev_next) in zip(self.marks, self.marks[1:]):
            name = {"F": "forward", "B": "backward"}.get(kind)
            if name is None:
                continue
            out[f"{name}_host_s"] += t_next - t
            if ev is not None:
                out[f"{name}_device_s"] += ev.elapsed_time(ev_next) / 1e3
        return out


PASS_FIELDS = ("forward_host_s", "backward_host_s", "forward_device_s", "backward_device_s")
"""Per-pass measurements (`PassClock.totals`) in measured.json, each a median over the kept steps."""


def _pass_medians(t: Timings, warmup: int) -> dict[str, float | None]:
    kept = [p for p in t.kept(t.passes, warmup) if p]
    return {k: _median([p[k] for p in kept if k in p]) for k in PASS_FIELDS}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measurement(runner: "Runner", warmup: int) -> dict[str, Any]:
    """The `measured` block of measured.json for this rank: step_time_s (median after warm-up, memory steps left
    out), step_times_s (all), memory_steps (their indices), step_time_spread_s (max - min after warm-up),
    per-phase medians, and memory (`Runner.memory_bytes`)."""
    t = runner.timings
    kept = t.kept(t.step, warmup)
    mem = runner.memory_bytes()
    notes = list(getattr(runner, "notes", []))
    if t.step and not [i for i in range(warmup, len(t.step)) if i not in t.tracked]:
        notes.append(f"all {len(t.step)} step(s) so far are warm-up ({min(warmup, len(t.step))}) or memory-tracked "
                     f"steps ({len(t.tracked)}), which the step time leaves out: it is their median; run at least "
                     f"{max(warmup, 3) + 1} steps for a measured step time")
    return {
        "step_time_s": _median(kept),
        "step_times_s": list(t.step),
        "warmup_steps": min(warmup, len(t.step)),
        "step_time_spread_s": (max(kept) - min(kept)) if kept else None,
        "forward_backward_s": _median(t.kept(t.forward_backward, warmup)),
        "optimizer_s": _median(t.kept(t.optimizer, warmup)),
        **_pass_medians(t, warmup),
        "peak_memory_bytes": mem["peak"],
        "memory_bytes": mem,
        "memory_steps": list(t.tracked),
        "notes": notes,
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


PREDICTED_CATEGORIES = {"parameters": ("parameters",), "gradients": ("gradients",),
                        "optimizer_state": ("optimizer",), "activations": ("activations",),
                        "temporaries": ("buffers", "temporaries")}
"""Measured memory category -> the keys of the prediction's `memory_breakdown` it compares with."""


def _rel(pred, meas) -> float | None:
    return (meas - pred) / pred if pred and meas is not None else None


def memory_by_category(pred: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Predicted vs measured bytes per memory category (each at its own peak), and the total peak: {category:
    {"predicted", "measured", "error"}}."""
    breakdown = pred.get("memory_breakdown") or {}
    mem = measured.get("memory_bytes") or {}
    out = {}
    for cat, keys in PREDICTED_CATEGORIES.items():
        p = sum(breakdown[k] for k in keys if k in breakdown) if any(k in breakdown for k in keys) else None
        out[cat] = {"predicted": p, "measured": mem.get(cat), "error": _rel(p, mem.get(cat))}
    p, m = _predicted_memory(pred), measured.get("peak_memory_bytes")
    out["peak"] = {"predicted": p, "measured": m, "error": _rel(p, m)}
    return out


def compare(plan: Plan, measured: Mapping[str, Any]) -> dict[str, Any]:
    """measured.json's content: `predicted` (copied from the plan), `measured`, `error` (relative:
    (measured - predicted) / predicted) for step time and peak memory where both exist, and `memory`, predicted vs
    measured per memory category (`memory_by_category`)."""
    pred = dict(plan.predicted)
    error: dict[str, float | None] = {}
    p_t, m_t = pred.get("step_time_s"), measured.get("step_time_s")
    error["step_time"] = _rel(p_t, m_t)
    memory = memory_by_category(pred, measured)
    error["peak_memory"] = memory["peak"]["error"]
    return {"predicted": pred, "measured": dict(measured), "error": error, "memory": memory,
            "passes": passes(pred, measured),
            "plan": {"mesh": plan.to_dict()["mesh"], "zero_stage": plan.zero_stage,
                     "schedule": plan.schedule, "recompute": plan.recompute,
                     "recompute_blocks": list(plan.recompute_blocks),
                     "num_microbatches": plan.num_microbatches, "global_batch_size": plan.global_batch_size}}


def passes(pred: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, dict]:
    """On CUDA, where the host issues kernels ahead of the device: per pass (forward, backward; summed over the
    step's micro-batches), predicted vs measured `device` time (the pass's compute; measured between CUDA events,
    so it includes waits for the host), `host` issue time, and the predicted `kernels` alone (measured only by a
    profiler trace). The measured pass also holds what the compute stream waits for: tp collectives, and a dp
    reduction still running when the backward ends; the predicted compute does not. Empty without device timings
    (CPU ranks, pipeline schedules) or a prediction that splits them (plans written before these fields)."""
    b = pred.get("breakdown") or {}
    out: dict[str, dict] = {}
    for name in ("forward", "backward"):
        dev, host = measured.get(f"{name}_device_s"), measured.get(f"{name}_host_s")
        if dev is None or f"{name}_compute_s" not in b:
            continue
        rows = {"device": (b[f"{name}_compute_s"], dev), "kernels": (b.get(f"{name}_kernels_s"), None),
                "host": (b.get(f"{name}_host_s"), host)}
        out[name] = {k: {"predicted": p, "measured": m, "error": _rel(p, m)} for k, (p, m) in rows.items()}
    return out


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
    for k, row in c["memory"].items():
        if k != "peak" and (row["predicted"] is not None or row["measured"] is not None):
            table.add_row(f"  {k.replace('_', ' ')}", _fmt_b(row["predicted"]), _fmt_b(row["measured"]),
                          _fmt_e(row["error"]))
    if m.get("step_time_spread_s") is not None:
        table.add_row("step time spread", "", _fmt_t(m["step_time_spread_s"]), "")
    labels = {"device": "pass on the device", "kernels": "  kernels alone", "host": "  host issue time"}
    for name, rows in c["passes"].items():
        for k, row in rows.items():
            table.add_row(f"{name} {labels[k]}" if k == "device" else labels[k], _fmt_t(row["predicted"]),
                          _fmt_t(row["measured"]), _fmt_e(row["error"]))
    return "\n".join([render(table)] + [f"note: {n}" for n in m.get("notes", ())])


def read_calibration_file(path: str | os.PathLike) -> dict[str, Any]:
    """The calibration file `path` holds ({"entries": []} when it does not exist yet); ExecutorError (one line) when
    it is not one (`plan measure` checks this before it runs anything)."""
    if not os.path.exists(path):
        return {"entries": []}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ExecutorError(f"--calibrate {path}: not a calibration file ({type(e).__name__}); give a new file "
                            "name or one an earlier `plan measure --calibrate` wrote") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list) or \
            set(data) - {"entries", "cluster", "step_time_scale"}:  # another JSON file: never rewritten
        raise ExecutorError(f"--calibrate {path}: not a calibration file (a JSON object with an entries list, and "
                            "only cluster and step_time_scale beside it); "
                            "give a new file name or one an earlier `plan measure --calibrate` wrote")
    for i, entry in enumerate(data.get("entries", [])):  # write_calibration reads these after the run
        why = _entry_problem(entry)
        if why:
            raise ExecutorError(f"--calibrate {path}: entries[{i}] {why}; give a new file name or one an earlier "
                                "`plan measure --calibrate` wrote")
    return data


def _entry_problem(entry: Any) -> str | None:
    """What makes one entry of a calibration file unusable by `write_calibration`, or None."""
    if not isinstance(entry, dict):
        return f"is not an object ({type(entry).__name__})"
    missing = [k for k in ("cluster", "ratio") if k not in entry]
    if missing:
        return f"has no {' and no '.join(missing)}"
    if not isinstance(entry["cluster"], str):
        return f"cluster is {entry['cluster']!r}, not a profile name"
    ratio = entry["ratio"]
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not 0 < ratio < float("inf")):
        return f"ratio is {str(ratio)[:40]!r}, not a positive number (or null)"
    return None


def write_calibration(path: str | os.PathLike, plan: Plan, result: Mapping[str, Any]) -> dict[str, Any]:
    """Record a measured step time next to the prediction in a calibration file (JSON), atomically.

    The file holds `entries` (one per measured plan: cluster, mesh, predicted and measured step time, their ratio)
    and `step_time_scale`, the median measured/predicted ratio over entries of the same cluster — the factor a
    later `plan` call on that profile multiplies its predicted step times by.
    """
    data = read_calibration_file(path)
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
