"""benchmarks/host_calls.py: host and device time per call of a GPT block's ops (run tiny, on CPU)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from host_calls import block_calls, per_call, table  # noqa: E402


def test_block_calls_run_forward_and_backward_at_the_given_shape():
    calls = block_calls(16, 8, 32, 4, torch.float32, torch.device("cpu"))
    names = [c[0] for c in calls]
    assert "linear + bias" in names and "sdpa causal" in names and "add (probe's op)" in names
    for name, size, fwd, fwd_bwd in calls:
        out = fwd()
        if name == "linear + bias":
            assert out.shape == (16, 128)
        if name == "sdpa causal":
            assert out.shape == (2, 4, 8, 8)
        if fwd_bwd is not None:
            grads = fwd_bwd()
            assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_per_call_times_the_host_and_on_cpu_no_device():
    host, dev = per_call(lambda: torch.ones(4) + 1, torch.device("cpu"), 5)
    assert host > 0 and dev is None
    text = table(16, 8, 32, 4, "fp32", torch.device("cpu"), 3).splitlines()
    assert len(text) == 1 + len(block_calls(16, 8, 32, 4, torch.float32, torch.device("cpu")))
    linear = next(l for l in text if l.startswith("linear + bias"))
    assert linear.split()[-4] != "-" and linear.split()[-1] == "-"  # host measured; no device on CPU
