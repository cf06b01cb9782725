"""Write a predicted step as a Chrome trace (the JSON Trace Event Format Perfetto and chrome://tracing open).

Each `TraceEvent` becomes a complete event (`"ph": "X"`) with `ts`/`dur` in microseconds; a process per pipeline
rank (`pid`), a thread per stream (`tid`: compute, tp, dp, pp), and `process_name` / `thread_name` metadata events
(`"ph": "M"`) so the viewer labels them. Format: "Trace Event Format" (Google, docs.google.com/document/d/
1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).
"""
from __future__ import annotations

import json
import os

from cost_model.prediction import Prediction
from planner.plan import write_atomic

STREAM_TIDS = {"compute": 0, "tp": 1, "dp": 2, "pp": 3}
"""Thread id of each stream."""


def chrome_trace(prediction: Prediction) -> dict:
    """The trace as a JSON-ready dict {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    events: list[dict] = []
    seen_pid, seen_tid = set(), set()
    tids = dict(STREAM_TIDS)
    for e in prediction.timeline:
        tid = tids.setdefault(e.stream, len(tids))
        if e.device not in seen_pid:
            seen_pid.add(e.device)
            events.append({"name": "process_name", "ph": "M", "pid": e.device, "tid": 0,
                           "args": {"name": f"pipeline rank {e.device}"}})
        if (e.device, tid) not in seen_tid:
            seen_tid.add((e.device, tid))
            events.append({"name": "thread_name", "ph": "M", "pid": e.device, "tid": tid,
                           "args": {"name": e.stream}})
        events.append({"name": e.name, "cat": e.stream, "ph": "X", "ts": e.start_s * 1e6,
                       "dur": max(0.0, e.duration_s) * 1e6, "pid": e.device, "tid": tid})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": prediction.step_time_s, "source": "shardwise cost model (predicted)"}}


def write_chrome_trace(prediction: Prediction, path: str | os.PathLike) -> None:
    """Write the prediction's timeline to `path` atomically (predict with `timeline=True` first)."""
    write_atomic(path, json.dumps(chrome_trace(prediction)) + "\n")
