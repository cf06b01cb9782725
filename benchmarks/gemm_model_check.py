"""How well a profile's GEMM model predicts the GEMMs `plan profile --model` timed (`matmul_shapes`): each row's
measured time next to what the model gives that shape without the row, and the mean and worst miss.

The model is the profile's `matmul` block where it has one (tiles and waves, `best_efficiency`, `k_overhead`: a
preset's figures, or what `plan profile --backend nccl` measured with its GEMM depth sweep), else the square-matmul
curve by FLOPs. Neither is fitted to the model's rows, so on a GPU this is a component check of the GEMM term:

    plan profile --nproc 1 --links-from dgx-h100 --model examples/gpt2_xl.py -o gpu.yaml
    python benchmarks/gemm_model_check.py gpu.yaml [--top 20]

Error is measured / predicted - 1 (positive: the GEMM ran slower than the model says).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cost_model import kernels  # noqa: E402
from hardware_profiles.load import load_cluster  # noqa: E402
from hardware_profiles.schema import DeviceSpec, ProfileError  # noqa: E402


def checked_rows(device: DeviceSpec) -> list[tuple[tuple, float, float]]:
    """[(row, measured s, model s)] for each of the profile's `matmul_shapes` rows, the model priced without them."""
    bare = dataclasses.replace(device, matmul_shapes=())
    return [(row, row[5], kernels.gemm_time(bare, tuple(row[:4]), row[4])) for row in device.matmul_shapes]


def model_line(device: DeviceSpec) -> str:
    """The GEMM model in use, in words."""
    mm = device.matmul
    if mm is None:
        return "GEMM model: no matmul block, so the square-matmul curve by FLOPs (matmul_efficiency)"
    tiles = ", ".join(f"{a}x{b}" for a, b in mm.tiles)
    return (f"GEMM model: tiles {tiles} in waves of {device.sms} SMs, best_efficiency {mm.best_efficiency:.3f}, "
            f"k_overhead {mm.k_overhead:.0f}")


def report(device: DeviceSpec, top: int = 0) -> str:
    """The GEMM model in use, each `matmul_shapes` row (or the `top` it misses most) beside it, and the misses."""
    rows = checked_rows(device)
    shown = sorted(rows, key=lambda r: -abs(r[1] / r[2] - 1))[:top] if top else rows
    lines = [model_line(device),
             f"{'batch':>5} {'M':>6} {'N':>6} {'K':>6} {'dtype':>5} {'layout':>6} {'measured us':>11} "
             f"{'model us':>9} {'TFLOP/s':>8} {'error':>7}"]
    for row, measured, model in shown:
        b, m, n, k, prec = row[:5]
        layout = row[6] if len(row) > 6 else "-"
        lines.append(f"{b:>5} {m:>6} {n:>6} {k:>6} {prec:>5} {layout:>6} {measured * 1e6:>11.1f} "
                     f"{model * 1e6:>9.1f} {2.0 * b * m * n * k / measured / 1e12:>8.1f} {measured / model - 1:>+7.1%}")
    errors = [measured / model - 1 for _, measured, model in rows]
    lines.append(f"{len(rows)} GEMMs: mean |error| {statistics.mean(abs(e) for e in errors):.1%}, signed mean "
                 f"{statistics.mean(errors):+.1%}, worst {max(errors, key=abs):+.1%}")
    return "\n".join(lines)


def _bad(what: str) -> int:
    """Bad input: one line on stderr, exit status 2."""
    print(f"gemm_model_check.py: error: {what}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a profile written by `plan profile --model ...` (or a preset name)")
    ap.add_argument("--top", type=int, default=0, help="print only the N rows the model misses most (default: all)")
    args = ap.parse_args(argv)
    if args.top < 0:
        return _bad(f"--top {args.top}: must be 0 (all) or more")
    try:
        device = load_cluster(args.profile).device
    except ProfileError as e:
        return _bad(str(e))
    if not device.matmul_shapes:
        return _bad(f"{args.profile} has no matmul_shapes; profile with `plan profile --model MODEL.py` to time the "
                    "model's own GEMMs")
    print(report(device, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
