"""The measured step as a trace with the predicted timeline's tracks (`plan measure --trace DIR`).

The runner names each forward and backward pass of a micro-batch with `torch.profiler.record_function` (`F mb3`,
`B mb3`, with ` c1` for the second chunk of an interleaved rank, as the simulator names them); torch.optim names
the optimizer's `step` and `zero_grad`; the worker names each step (`shardwise step N`). The worker profiles the
steps after warm-up with `torch.profiler`; `measured_trace` then keeps one step of the raw trace, with time from
that step's start, on the tracks cost_model.timeline writes: compute (the F/B spans), tp / dp / pp comm (the
collectives as they ran: gloo's work on its worker threads, NCCL's kernels on the GPU), bubble (a pipeline rank's
compute idle before its last pass) and optimizer; `align` puts the ranks on one time axis.

A collective's process group: point-to-point transfers are pipeline traffic (pp); NCCL events carry their process
group's name, which maps to a mesh dimension; gloo's carry none, but each process group runs its work on its own
threads (gloo) or CUDA streams (NCCL), so before the first profiled step `mark_groups` runs a few tiny all-reduces
on every group under a `shardwise group LABEL` span, and the threads or streams that ran them name the group.
"""
from __future__ import annotations

import re
import time
from typing import Any, Iterable, Mapping

TRACKS = ("compute", "tp comm", "dp comm", "pp comm", "bubble", "optimizer")
"""Track names, in display order (tid = index); the same as cost_model.timeline.TRACKS."""
STEP_SPAN = "shardwise step"
"""Prefix of the span around one `Runner.step` (followed by the step number)."""
OPTIMIZER_SPANS = ("Optimizer.step#", "Optimizer.zero_grad#")
"""Prefixes of the spans torch.optim.Optimizer records around `step` and `zero_grad`."""
GROUP_SPAN = "shardwise group"
"""Prefix of the marker span that names a process group's threads."""
MARKS_PER_GROUP = 8
"""Marker all-reduces per group: issued together, so each of a gloo group's worker threads (2 by default) runs one
(4 once went all to one thread in a CI run of the suite, its two workers and the job's two ranks on 2 cores)."""
GLOO_MARK_DELAY_S = 0.05
"""How late the other ranks of a gloo group join each marking round (`mark_groups`): marker all-reduces issued at
once still went all to one worker thread in CI runs of the suite (two pytest workers and two ranks on 2 cores)."""
MARK_ELEMS = 2**18
"""Elements of each marker all-reduce: 1 MiB of fp32, about 1-3 ms on gloo between local ranks, so that a worker
thread busy with one leaves the next to another thread, which has long woken up by then (tiny ones were once all
taken by one thread on a loaded machine, and 256 KiB ones once in a CI run of the test suite, leaving the other
thread's collectives unattributed)."""
MEASURED_PID = 100
"""Measured rank r is process MEASURED_PID + r in the merged compare.json (predicted pipeline ranks are 0..pp-1)."""

_PASS = re.compile(r"^[FB] mb\d+( c\d+)?$")
_COMM = re.compile(r"^(gloo|nccl):|nccl.*kernel|ncclDevKernel|ncclKernel", re.IGNORECASE)
_P2P = re.compile(r"send|recv|sendrecv", re.IGNORECASE)


def record(name: str):
    """A profiler span named `name` (free when no profiler runs)."""
    from torch.profiler import record_function
    return record_function(name)


def pass_name(kind: str, microbatch: int, chunk: int | None = None) -> str:
    """`F mb3` / `B mb3 c1`: the simulator's name for a pass."""
    return f"{kind} mb{microbatch}" + (f" c{chunk}" if chunk is not None else "")


def annotate_stage(stage: Any, chunk: int | None) -> None:
    """Wrap a torch.distributed.pipelining stage's forward/backward of one micro-batch in F/B spans."""
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(i, *args, **kwargs):
        with record(pass_name("F", i, chunk)):
            return fwd(i, *args, **kwargs)

    def backward_one_chunk(i, *args, **kwargs):
        with record(pass_name("B", i, chunk)):
            return bwd(i, *args, **kwargs)
    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def process_groups(runner: Any) -> dict[str, list]:
    """Track label -> the process groups whose traffic belongs on it (mesh tp/dp/pp, tied-weight groups as pp;
    the world group as dp when dp spans the world); groups of one rank are left out."""
    import torch.distributed as dist
    out: dict[str, list] = {}
    for dim in ("tp", "dp", "pp"):
        if runner.mesh[dim].size() > 1:
            out.setdefault(f"{dim} comm", []).append(runner.mesh[dim].get_group())
    out.setdefault("pp comm", []).extend(g for g in getattr(runner, "tied_groups", []) if g is not None)
    world = dist.group.WORLD
    if all(world is not g for gs in out.values() for g in gs) and dist.get_world_size() > 1:
        out.setdefault("dp comm" if runner.mesh["dp"].size() > 1 else "pp comm", []).append(world)
    return {k: v for k, v in out.items() if v}


def mark_groups(groups: Mapping[str, Iterable]) -> dict[str, str]:
    """Run MARKS_PER_GROUP tiny all-reduces on every group (all ranks, same order) under a `shardwise group LABEL`
    span; returns {process group name: label} for the NCCL events that carry it."""
    import torch
    import torch.distributed as dist
    names = {}
    for label, gs in groups.items():
        for g in gs:
            names[g.group_name] = label
            with record(f"{GROUP_SPAN} {label}"):
                # gloo: one round per rank of the group, the others joining GLOO_MARK_DELAY_S late, so that on the
                # early rank the first marker blocks a worker thread and the next ones go to the other workers
                rounds = dist.get_world_size(g) if dist.get_backend(g) == "gloo" else 1
                for early in range(rounds):
                    if rounds > 1 and dist.get_rank(g) != early:
                        time.sleep(GLOO_MARK_DELAY_S)
                    t = [torch.zeros(MARK_ELEMS, device=_device(g)) for _ in range(MARKS_PER_GROUP)]
                    works = [dist.all_reduce(x, group=g, async_op=True) for x in t]
                    for w in works:
                        w.wait()
                    if t[0].is_cuda:
                        torch.cuda.synchronize()
    return names


def _device(group) -> str:
    import torch
    import torch.distributed as dist
    return "cuda" if dist.get_backend(group) == "nccl" and torch.cuda.is_available() else "cpu"


def start_profiler():
    """A started torch.profiler over CPU (and CUDA when present); `stop()` it, then `export_chrome_trace`."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts)
    prof.start()
    return prof


def _spans(raw: Mapping[str, Any]) -> list[dict]:
    return [e for e in raw.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _thread_labels(spans: list[dict]) -> dict[Any, str]:
    """gloo worker thread -> the label of the marker span its collectives ran under."""
    marks = [e for e in spans if str(e["name"]).startswith(GROUP_SPAN + " ")]
    out: dict[Any, str] = {}
    for m in marks:
        label = m["name"][len(GROUP_SPAN) + 1:]
        t0, t1 = m["ts"], m["ts"] + m["dur"]
        for e in spans:
            if _COMM.search(str(e["name"])) and t0 <= e["ts"] <= t1:
                out.setdefault((e["pid"], e["tid"]), label)
    return out


def _comm_label(e: dict, threads: Mapping, pg_names: Mapping[str, str], fallback: str) -> str:
    name = str(e["name"])
    if _P2P.search(name):
        return "pp comm"
    args = e.get("args") or {}
    pg = args.get("Process Group Name", args.get("pg_name"))
    if pg is not None and str(pg) in pg_names:
        return pg_names[str(pg)]
    return threads.get((e["pid"], e["tid"]), fallback)


def _is_comm(name: str, cat: Any, gpu_comm: bool) -> bool:
    """NCCL on GPUs: the kernel is the collective (its CPU-side `nccl:` span only launches it); gloo: its work."""
    if gpu_comm:
        return cat == "kernel" and "nccl" in name.lower()
    return name.startswith(("gloo:", "nccl:"))


def step_windows(raw: Mapping[str, Any]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every `shardwise step` span in a raw trace, in order."""
    steps = [e for e in _spans(raw) if str(e["name"]).startswith(STEP_SPAN) and e.get("cat") != "gpu_user_annotation"]
    return [(e["ts"], e["ts"] + e["dur"]) for e in sorted(steps, key=lambda e: e["ts"])]


def measured_trace(raw: Mapping[str, Any], rank: int, step: int, *, pipelined: bool,
                   pg_names: Mapping[str, str] | None = None, fallback: str = "dp comm", label: str = "") -> dict:
    """One step (`step`-th profiled one) of a raw torch.profiler trace as a Chrome trace on TRACKS, time from
    the step's start in microseconds (`align` puts several ranks on one axis); process `rank` named
    "measured rank R`label`". `pipelined` derives bubble spans; `fallback` is the track of a collective whose
    group could not be told."""
    spans = _spans(raw)
    windows = step_windows(raw)
    if not windows:
        raise ValueError("no `shardwise step` span in the profiler trace")
    t0, t1 = windows[min(step, len(windows) - 1)]
    threads = _thread_labels(spans)
    gpu = any(e.get("cat") == "gpu_user_annotation" and _PASS.match(str(e["name"])) for e in spans)
    gpu_comm = any(e.get("cat") == "kernel" and _COMM.search(str(e["name"])) for e in spans)
    out: list[tuple[str, str, float, float]] = []
    unattributed = 0
    for e in spans:
        s, d, name, cat = e["ts"], e["dur"], str(e["name"]), e.get("cat")
        if not t0 <= s <= t1:
            continue
        if _PASS.match(name) and (cat == "gpu_user_annotation") == gpu:
            out.append(("compute", name, s, d))
        elif name.startswith(OPTIMIZER_SPANS) and cat != "gpu_user_annotation":
            out.append(("optimizer", name, s, d))
        elif _is_comm(name, cat, gpu_comm):
            track = _comm_label(e, threads, pg_names or {}, "")
            unattributed += not track
            out.append((track or fallback, name, s, d))
    if pipelined:
        out += [("bubble", "bubble", s, e - s) for s, e in _gaps([(s, s + d) for t, _, s, d in out if t == "compute"],
                                                                  t0)]
    doc = _chrome(out, rank, f"measured rank {rank}{label}", t0)
    doc["otherData"] = {"step_time_s": (t1 - t0) / 1e6, "rank": rank, "profiled_step": step, "step_start_us": t0,
                        "clock": raw.get("baseTimeNanoseconds"), "step_offset_s": 0.0,
                        "unattributed_collectives": unattributed, "source": "torch.profiler (measured)"}
    return doc


def _gaps(spans: list[tuple[float, float]], t0: float) -> list[tuple[float, float]]:
    out, t = [], t0
    for s, e in sorted(spans):
        if s > t:
            out.append((t, s))
        t = max(t, e)
    return out


def _chrome(spans: list[tuple[str, str, float, float]], pid: int, process: str, t0: float) -> dict:
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}}]
    tracks = list(TRACKS)
    seen = set()
    for track, name, s, d in sorted(spans, key=lambda x: x[2]):
        if track not in tracks:
            tracks.append(track)
        tid = tracks.index(track)
        if tid not in seen:
            seen.add(tid)
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        events.append({"name": name, "cat": track, "ph": "X", "ts": max(0.0, s - t0), "dur": max(0.0, d),
                       "pid": pid, "tid": tid})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def track_names(doc: Mapping[str, Any]) -> set[str]:
    """The thread (track) names of a Chrome trace."""
    return {e["args"]["name"] for e in doc["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}


def categories(doc: Mapping[str, Any]) -> dict[str, float]:
    """Seconds of the slowest process's step split like the predicted breakdown: compute_s (F/B spans less the
    tp collectives inside them), optimizer_s, bubble_s, exposed_comm_s (the rest) and step_time_s."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    per: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for e in _spans(doc):
        track = names.get((e["pid"], e["tid"]), "")
        per.setdefault(e["pid"], {}).setdefault(track, []).append((e["ts"], e["ts"] + e["dur"]))
    best: dict[str, float] = {}
    for tracks in per.values():
        end = max(e for spans in tracks.values() for _, e in spans)
        comp = _union(tracks.get("compute", []))
        tp_inside = _union(_intersect(tracks.get("compute", []), tracks.get("tp comm", [])))
        c = {"step_time_s": end / 1e6, "compute_s": (comp - tp_inside) / 1e6,
             "optimizer_s": _union(tracks.get("optimizer", [])) / 1e6,
             "bubble_s": _union(tracks.get("bubble", [])) / 1e6}
        c["exposed_comm_s"] = max(0.0, c["step_time_s"] - c["compute_s"] - c["optimizer_s"] - c["bubble_s"])
        if c["step_time_s"] > best.get("step_time_s", -1.0):
            best = c
    return best


def _union(spans: list[tuple[float, float]]) -> float:
    total, t = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > t:
            total += e - max(s, t)
            t = e
    return total


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(s1, s2), min(e1, e2)) for s1, e1 in a for s2, e2 in b if min(e1, e2) > max(s1, s2)]


def align(measured: list[Mapping[str, Any]]) -> list[dict]:
    """The measured ranks on one time axis: 0 is the earliest rank's step start, each rank shifted by how much
    later its step started (`step_offset_s`). Ranks whose profiler clocks differ (other hosts) stay as they are."""
    clocks = {d.get("otherData", {}).get("clock") for d in measured}
    starts = [d.get("otherData", {}).get("step_start_us") for d in measured]
    if len(clocks) != 1 or None in clocks or None in starts:
        return [dict(d) for d in measured]
    first = min(starts)
    out = []
    for d, start in zip(measured, starts):
        shift = start - first
        events = [dict(e, ts=e["ts"] + shift) if e.get("ph") == "X" else e for e in d["traceEvents"]]
        out.append(dict(d, traceEvents=events, otherData=dict(d["otherData"], step_offset_s=shift / 1e6)))
    return out


def merge(predicted: Mapping[str, Any] | None, measured: list[Mapping[str, Any]]) -> dict:
    """One Chrome trace with the predicted pipeline ranks (pid 0..) and the measured ranks (pid MEASURED_PID + r),
    for opening both in one Perfetto window."""
    events: list[dict] = []
    if predicted is not None:
        events += [dict(e) for e in predicted["traceEvents"]]
    for doc in measured:
        rank = doc.get("otherData", {}).get("rank", 0)
        events += [dict(e, pid=MEASURED_PID + rank) for e in doc["traceEvents"]]
    other = {"predicted": dict(predicted.get("otherData", {})) if predicted else None,
             "measured": [dict(d.get("otherData", {})) for d in measured]}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
