"""Host time to issue one call of each op a GPT block makes, at a tiny size and at a model's size, next to the
device time of the call: where a GPU step's host time goes beyond the profile's per-op figures, which `plan
profile` times on one-element tensors and 2 x 2 linears (`hardware_profiles.measure_overheads`).

    python benchmarks/host_calls.py [--tokens 4096] [--seq 1024] [--hidden 1600] [--heads 25] [--repeats 50]
        [--device cuda] [--precision bf16]

Each call runs `--repeats` times back to back after a warm-up. Host: the wall clock of issuing them, no
synchronisation in between (on CUDA the kernels run on after the call returns, so this is the host's own time as
long as the launch queue does not fill; on CPU it is the call). Device (CUDA): CUDA events around the same calls
queued behind a spin kernel, so the device never waits for a launch (the probe's own timing,
`hardware_profiles.measure.device_and_host_seconds`). Backward columns are forward + backward
(`torch.autograd.grad`) less the forward; they include autograd.grad's own start per call, which the first row
(one multiplication, one backward node) shows against the probe's per-node figure, timed on a chain. The defaults
are GPT-2 1.5B at micro-batch 4 (the GPU benchmark's `gpt-1.5B` run); `gpu_predicted_vs_measured.py` prints this
table for its GPT shapes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout, installed or not
from hardware_profiles.measure import device_and_host_seconds, plan_for  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def per_call(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float | None]:
    """(host seconds, device seconds or None on CPU) per call of `fn`: on CUDA the probe's own timing
    (`hardware_profiles.measure.device_and_host_seconds`), on CPU the wall clock of `repeats` calls."""
    plan = dataclasses.replace(plan_for(False, device.type == "cuda"), warmup=3, repeats=repeats)
    if device.type == "cuda":
        dev, host = device_and_host_seconds(fn, device, plan)
        return host, dev
    for _ in range(plan.warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats, None


def block_calls(tokens: int, seq: int, hidden: int, heads: int, dtype: torch.dtype, device: torch.device
                ) -> list[tuple[str, str, Callable[[], object], Callable[[], object] | None]]:
    """(op, size, forward call, forward + backward call or None) for the calls of a GPT block at this size, and the
    tiny calls the profile's per-op figures come from."""
    def t(*shape, dt=dtype, grad=False):
        return torch.randn(*shape, device=device, dtype=dt, requires_grad=grad)

    one = t(1, dt=torch.float32, grad=True)
    tiny_x, tiny_w, tiny_b = t(2, 2, dt=torch.float32, grad=True), t(2, 2, dt=torch.float32, grad=True), \
        t(2, dt=torch.float32, grad=True)
    x, h4 = t(tokens, hidden, grad=True), t(tokens, 4 * hidden, grad=True)
    w, b = t(4 * hidden, hidden, grad=True), t(4 * hidden, grad=True)
    w32, b32 = t(4 * hidden, hidden, dt=torch.float32, grad=True), t(4 * hidden, dt=torch.float32, grad=True)
    x32 = t(tokens, hidden, dt=torch.float32, grad=True)
    ln_w, ln_b = t(hidden, dt=torch.float32, grad=True), t(hidden, dt=torch.float32, grad=True)
    d = hidden // heads
    q, k, v = (t(tokens // seq, heads, seq, d, grad=True) for _ in range(3))
    g_x, g_h4 = torch.randn_like(x), torch.randn_like(h4)
    g_out = torch.randn(tokens, 4 * hidden, device=device, dtype=dtype)
    g_q = torch.randn_like(q)
    amp = device.type if dtype != torch.float32 else None

    def autocast_linear():
        with torch.autocast(device.type, dtype=dtype, enabled=amp is not None):
            return F.linear(x32, w32, b32)

    def grad(out_fn, inputs, g):
        return lambda: torch.autograd.grad(out_fn(), inputs, g)

    size = f"{tokens}x{hidden}"
    lin = f"{tokens}x{4 * hidden}x{hidden}"
    return [
        ("add (probe's op)", "1", lambda: one + 1.0, grad(lambda: one * 1.0, (one,), torch.ones_like(one))),
        ("linear (probe's)", "2x2x2 fp32", lambda: F.linear(tiny_x, tiny_w, tiny_b),
         grad(lambda: F.linear(tiny_x, tiny_w, tiny_b), (tiny_x, tiny_w, tiny_b), torch.ones(2, 2, device=device))),
        ("add", size, lambda: x + x, None),
        ("gelu", f"{tokens}x{4 * hidden}", lambda: F.gelu(h4), grad(lambda: F.gelu(h4), (h4,), g_h4)),
        ("layer_norm fp32", size, lambda: F.layer_norm(x32, (hidden,), ln_w, ln_b),
         grad(lambda: F.layer_norm(x32, (hidden,), ln_w, ln_b), (x32, ln_w, ln_b), torch.randn_like(x32))),
        ("mm", lin, lambda: torch.mm(x, w.t()), None),
        ("linear + bias", lin, lambda: F.linear(x, w, b), grad(lambda: F.linear(x, w, b), (x, w, b), g_out)),
        ("linear, autocast", lin + " fp32 w", autocast_linear,
         grad(autocast_linear, (x32, w32, b32), g_out.float())),
        ("sdpa causal", f"{tokens // seq}x{heads}x{seq}x{d}",
         lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         grad(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g_q)),
        ("to fp32", size, lambda: x.float(), None),
        ("sum (bias grad)", size, lambda: g_x.sum(0), None),
    ]


def table(tokens: int, seq: int, hidden: int, heads: int, precision: str, device: torch.device,
          repeats: int) -> str:
    """The rows as text: op, size, host and device microseconds per call, forward and backward."""
    dtype = DTYPES[precision]
    lines = [f"{'op':18} {'size':26} {'host fwd':>9} {'dev fwd':>8} {'host bwd':>9} {'dev bwd':>8}  (us per call)"]

    def us(x):
        return f"{x * 1e6:.1f}" if x is not None else "-"
    for name, size, fwd, fwd_bwd in block_calls(tokens, seq, hidden, heads, dtype, device):
        hf, df = per_call(fwd, device, repeats)
        hb = db = None
        if fwd_bwd is not None:
            h2, d2 = per_call(fwd_bwd, device, repeats)
            hb = max(h2 - hf, 0.0)
            db = max(d2 - df, 0.0) if d2 is not None and df is not None else None
        lines.append(f"{name:18} {size:26} {us(hf):>9} {us(df):>8} {us(hb):>9} {us(db):>8}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (batch x sequence)")
    ap.add_argument("--seq", type=int, default=1024, help="sequence length (SDPA)")
    ap.add_argument("--hidden", type=int, default=1600)
    ap.add_argument("--heads", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.tokens % args.seq:
        ap.error(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}; give whole sequences")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}; pick a head count that divides it")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    torch.set_num_threads(1) if args.device == "cpu" else None
    device = torch.device(args.device)
    print(f"host and device time per call on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
          f", torch {torch.__version__}, {args.precision}")
    print(table(args.tokens, args.seq, args.hidden, args.heads, args.precision, device, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
