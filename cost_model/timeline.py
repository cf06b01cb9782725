"""Write a predicted step as a Chrome trace (the JSON Trace Event Format Perfetto and chrome://tracing open).

Each `TraceEvent` becomes a complete event (`"ph": "X"`) with `ts`/`dur` in microseconds from the step's start; a
process per pipeline rank (`pid`), a thread per track (`tid`), and `process_name` / `thread_name` metadata events
(`"ph": "M"`) so the viewer labels them. The tracks are `TRACKS`, the same names `plan measure --trace` gives the
measured trace (executor.trace), so the two line up track by track. `bubble` spans are derived here: the times a
pipeline rank's compute stream is idle before its last pass. Format: "Trace Event Format" (Google,
docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).
"""
from __future__ import annotations

import json
import os

from cost_model.prediction import Prediction
from planner.plan import write_atomic

TRACKS = ("compute", "tp comm", "dp comm", "pp comm", "bubble", "optimizer")
"""Track (thread) names, in display order; a track's `tid` is its index. executor.trace uses the same names."""
STREAM_TRACKS = {"compute": "compute", "tp": "tp comm", "dp": "dp comm", "pp": "pp comm", "optimizer": "optimizer"}
"""Track of each simulator stream."""
STREAM_TIDS = {stream: TRACKS.index(track) for stream, track in STREAM_TRACKS.items()}
"""Thread id of each simulator stream."""


def _bubbles(prediction: Prediction) -> list[tuple[int, float, float]]:
    """(device, start, end) of every idle stretch of a pipeline rank's compute stream before its last F/B pass."""
    passes: dict[int, list[tuple[float, float]]] = {}
    for e in prediction.timeline:
        if e.stream == "compute":
            passes.setdefault(e.device, []).append((e.start_s, e.start_s + e.duration_s))
    if len(passes) < 2:  # no pipeline: nothing waits on another stage
        return []
    out = []
    for dev, spans in passes.items():
        t = 0.0
        for s, e in sorted(spans):
            if s - t > 1e-9:  # not float round-off between back-to-back passes
                out.append((dev, t, s))
            t = max(t, e)
    return out


def chrome_trace(prediction: Prediction, label: str = "predicted") -> dict:
    """The trace as a JSON-ready dict {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}:
    process `pid` = pipeline rank r, named "`label` pipeline rank r"; threads named by `TRACKS`."""
    spans = [(e.device, STREAM_TRACKS.get(e.stream, e.stream), e.name, e.start_s, e.duration_s)
             for e in prediction.timeline]
    spans += [(dev, "bubble", "bubble", s, e - s) for dev, s, e in _bubbles(prediction)]
    events: list[dict] = []
    tracks = list(TRACKS)
    seen = set()
    for dev, track, name, start, dur in spans:
        if track not in tracks:
            tracks.append(track)
        tid = tracks.index(track)
        if dev not in seen:
            seen.add(dev)
            events.append({"name": "process_name", "ph": "M", "pid": dev, "tid": 0,
                           "args": {"name": f"{label} pipeline rank {dev}"}})
        if (dev, tid) not in seen:
            seen.add((dev, tid))
            events.append({"name": "thread_name", "ph": "M", "pid": dev, "tid": tid, "args": {"name": track}})
        events.append({"name": name, "cat": track, "ph": "X", "ts": start * 1e6, "dur": max(0.0, dur) * 1e6,
                       "pid": dev, "tid": tid})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": prediction.step_time_s, "breakdown": dict(prediction.breakdown),
                          "source": "shardwise cost model (predicted)"}}


def write_chrome_trace(prediction: Prediction, path: str | os.PathLike) -> None:
    """Write the prediction's timeline to `path` atomically (predict with `timeline=True` first)."""
    write_atomic(path, json.dumps(chrome_trace(prediction)) + "\n")
