"""Where a profiled GPU step's device time went, by kernel: reads the raw torch.profiler trace that
`plan measure --trace DIR` writes (DIR/profiler_rank0.json) and prints the device time per profiled step by kernel
family (GEMM, attention, elementwise and reductions, copies, optimizer, communication, other), the kernels that
took the most, and how much of each step the device sat idle between kernels (waiting for the host: the profiler
slows the host, so profiled steps idle more than plain ones), to lay beside the predicted breakdown.

    python benchmarks/kernel_summary.py DIR/profiler_rank0.json [--steps N] [--top 15]

`--steps`: how many steps the trace holds (plan measure profiles the steps after warm-up), to print per-step times.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

FAMILIES = (  # first match wins; names as CUDA kernels appear in torch.profiler traces on NVIDIA GPUs
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn.*(sdpa|mha)|sdpa", re.I)),
    ("optimizer", re.compile(r"adam|fused_optim|multi_tensor", re.I)),
    ("gemm", re.compile(r"gemm|xmma|cutlass|cublas|sm\d+_.*(mma|tensorop)|nvjet|matmul", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|cat_|CatArray|transpose", re.I)),
    ("elementwise/reduce", re.compile(r"elementwise|vectorized|reduce|softmax|norm|loss|nll|unrolled|index", re.I)),
)


def family(name: str) -> str:
    """The kernel family of a CUDA kernel's name."""
    return next((f for f, pat in FAMILIES if pat.search(name)), "other")


def summarize(trace: dict) -> tuple[Counter, Counter, int]:
    """(seconds by family, seconds by kernel name, kernel count) over the trace's device kernels."""
    by_family: Counter = Counter()
    by_name: Counter = Counter()
    n = 0
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        s = float(e["dur"]) / 1e6
        by_family[family(str(e["name"]))] += s
        by_name[str(e["name"])] += s
        n += 1
    return by_family, by_name, n


def device_steps(trace: dict) -> list[tuple[str, float, float]]:
    """[(step, seconds the step spans on the device, seconds some kernel ran within it)] for each step the executor
    annotated ("shardwise step N", as the profiler projects it onto the GPU timeline)."""
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace.get("traceEvents", [])
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "gpu_user_annotation" or not str(e.get("name", "")).startswith("shardwise step"):
            continue
        lo, hi = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        busy, end = 0.0, lo
        for a, b in kernels:  # the union of kernel intervals inside the step
            a, b = max(a, end), min(b, hi)
            if b > a:
                busy += b - a
                end = b
        out.append((str(e["name"]), (hi - lo) / 1e6, busy / 1e6))
    return sorted(out)


def report(trace: dict, steps: int = 1, top: int = 15) -> str:
    """The printed summary: per-step device seconds by family, then the `top` kernels."""
    by_family, by_name, n = summarize(trace)
    if not n:
        return "no device kernels in this trace (a CPU run, or the profiler saw no CUDA activity)"
    total = sum(by_family.values())
    lines = [f"{n} kernels, {total / steps * 1e3:.2f} ms of device time per step ({steps} step(s) profiled)"]
    lines += [f"  {f:20} {s / steps * 1e3:9.2f} ms  {s / total:6.1%}" for f, s in by_family.most_common()]
    lines.append(f"top {top} kernels (ms per step):")
    lines += [f"  {s / steps * 1e3:9.3f}  {family(k):20} {k[:110]}" for k, s in by_name.most_common(top)]
    lines += [f"{name} on the device: {span * 1e3:.2f} ms, kernels running {busy * 1e3:.2f} ms, idle "
              f"{(span - busy) * 1e3:.2f} ms" for name, span, busy in device_steps(trace)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="profiler_rankR.json written by plan measure --trace DIR")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (default 1)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        print(f"kernel_summary: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    print(report(trace, max(1, args.steps), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
