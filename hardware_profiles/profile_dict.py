"""The cluster profile as a plain dict (parsed YAML) and back: strict loading into `hardware_profiles.schema`'s
types, and the dict `save_cluster` writes. Unknown or missing keys, wrong types and non-positive sizes raise
`ProfileError` naming the field path.

YAML layout::

    cluster: {name: dgx-a100-80gb, nodes: 1, devices_per_node: 8}
    device:
      name: A100-SXM4-80GB
      memory_bytes: 85899345920
      usable_memory_fraction: 0.9
      peak_flops: {fp32: 19.5e12, tf32: 156e12, bf16: 312e12, fp16: 312e12}
      memory_bandwidth: 2.039e12
      matmul_efficiency: [[1.0e9, 0.2], [1.0e12, 0.8]]   # [FLOPs of one matmul, achieved fraction of peak]
      memory_efficiency: [[1.0e6, 0.3], [1.0e9, 0.9]]    # [bytes moved by one op, achieved fraction of peak]
      op_overhead: {forward: 4.0e-6, backward: 8.0e-6, optimizer: 6.0e-5}   # optional, measured; default 0
      kernel_costs: {gelu: [3.6e-9, 4.0e-9]}              # optional, measured: [forward, backward] s per element
      by_precision: {bf16: {linear_efficiency: [[6.6e4, 0.01], [3.4e7, 0.4]], kernel_costs: {gelu: [2e-9, 3e-9]},
                            attention_efficiency: {64: [[2.1e6, 0.2]]}}}   # optional, measured on CPU ranks
                                                          # at a 16-bit precision (SDPA curves by head dim)
      sms: 108                                            # optional: GEMM tiles / attention blocks run in waves
      matmul: {tiles: [[256, 128], [128, 128]], best_efficiency: 0.869}   # optional: GEMM efficiency by shape
      attention: {forward_efficiency: 0.73, backward_efficiency: 0.63, block: 128}   # optional: fused SDPA; or
                                                          # {kernel: K, kernels: {K: {...}, ...}}: K runs;
                                                          # {kernel: unfused}: SDPA as separate kernels
      kernel_floor: 3.8e-6                                # optional: minimum seconds per kernel
      async_host: true                                    # optional: host dispatch overlaps kernels (GPUs)
      threads: 1                                          # optional: CPU threads per rank (0: unknown / a GPU)
      comm_shares_compute: true                           # optional: collectives run on the compute threads
      sync_wait: [[2.0e-3, 1.0e-3], [8.0e-3, 1.8e-3]]     # optional, measured: [compute s, wait s] per collective
      matmul_shapes: [[1, 2048, 4096, 4096, bf16, 1.2e-4, nt]]  # optional, measured: [b, M, N, K, dtype, s, layout]
      attention_shapes: [[32, 2048, 2048, 128, true, bf16, 3.0e-4, 8.0e-4]]   # optional, measured
      norm_shapes: [[8192, 768, 2, layer_norm, fp32, 2.1e-5, 9.0e-5]]   # optional, measured (fwd s, bwd s)
      reduce_shapes: [[16384, 768, bf16, 3.0e-5]]   # optional, measured: a bias gradient's sum over rows (s)
    links:
      intra_node: {kind: nvswitch, bandwidth: 300e9, latency: 3.4e-6}
      inter_node: {kind: infiniband, bandwidth: 25e9, latency: 5.0e-6}
    collectives:                                          # optional, measured; they take precedence
      - {collective: all_reduce, level: intra_node, group_size: 8, points: [[1048576, 1.0e-4], ...]}
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Mapping

from hardware_profiles.schema import (COLLECTIVES, FLOP_DTYPES, GEMM_LAYOUTS, KERNELS, LEVELS, LINK_KINDS,
                                      NORM_FUNCTIONS, UNFUSED_ATTENTION, AttentionModel, Cluster, CollectiveCurve,
                                      DeviceSpec, LinkSpec, MatmulModel, OpOverhead, PrecisionRates, ProfileError)



def _keys(d: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected a mapping, got {type(d).__name__}")
    unknown = [k for k in d if k not in required and k not in optional]
    if unknown:
        raise ProfileError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(required + optional)})")
    missing = [k for k in required if k not in d]
    if missing:
        raise ProfileError(f"{where}.{missing[0]}: missing key")
    return d


def _pos(x: Any, where: str, integer: bool = False, unit: str = "") -> Any:
    if integer and isinstance(x, float) and x.is_integer():
        x = int(x)  # 80e9 bytes is a whole number written in float notation; accept it
    ok_types = (int,) if integer else (int, float)
    if isinstance(x, bool) or not isinstance(x, ok_types):
        if isinstance(x, str):
            raise ProfileError(f"{where}: got the string {x!r}; give a plain number{' in ' + unit if unit else ''}"
                               " (e.g. 80e9, not '80GB')")
        kind = "an integer" if integer else "a number"
        raise ProfileError(f"{where}: expected {kind}{' in ' + unit if unit else ''}, got {type(x).__name__}")
    if not math.isfinite(x) or x <= 0:
        raise ProfileError(f"{where}: must be > 0{' ' + unit if unit else ''}, got {x}")
    return x


def _fraction(x: Any, where: str) -> float:
    _pos(x, where)
    if x > 1:
        raise ProfileError(f"{where}: is a fraction and must be in (0, 1], got {x}")
    return float(x)


def _curve(pts: Any, where: str, y_fraction: bool) -> tuple[tuple[float, float], ...]:
    if not isinstance(pts, (list, tuple)) or not pts:
        raise ProfileError(f"{where}: expected a non-empty list of [size, value] pairs")
    out = []
    for i, p in enumerate(pts):
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ProfileError(f"{where}[{i}]: expected a [size, value] pair")
        x = _pos(p[0], f"{where}[{i}][0]")
        y = _fraction(p[1], f"{where}[{i}][1]") if y_fraction else float(_pos(p[1], f"{where}[{i}][1]"))
        out.append((x, y))
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        raise ProfileError(f"{where}: sizes must be strictly increasing")
    return tuple(out)


def _link(d: Any, where: str) -> LinkSpec:
    d = _keys(d, where, ("kind", "bandwidth", "latency"))
    if d["kind"] not in LINK_KINDS:
        raise ProfileError(f"{where}.kind: {d['kind']!r} is not one of {', '.join(LINK_KINDS)}")
    bw = _pos(d["bandwidth"], f"{where}.bandwidth", unit="bytes/s")
    if bw < 1e6:
        raise ProfileError(f"{where}.bandwidth: {bw} bytes/s is implausibly small; the unit is bytes/s "
                           "(e.g. 25e9 for 200 Gb/s InfiniBand)")
    lat = _pos(d["latency"], f"{where}.latency", unit="seconds")
    if lat > 1.0:
        raise ProfileError(f"{where}.latency: {lat} s is implausibly large; the unit is seconds (e.g. 5e-6)")
    return LinkSpec(kind=d["kind"], bandwidth=float(bw), latency=float(lat))


def _device(d: Any, where: str) -> DeviceSpec:
    d = _keys(d, where, ("name", "memory_bytes", "usable_memory_fraction", "peak_flops", "memory_bandwidth",
                         "matmul_efficiency", "memory_efficiency"),
              ("op_overhead", "kernel_costs", "linear_efficiency", "linear_backward_efficiency", "by_precision")
              + _GPU_KEYS)
    mem = _pos(d["memory_bytes"], f"{where}.memory_bytes", integer=True, unit="bytes")
    if mem < 2**26:
        raise ProfileError(f"{where}.memory_bytes: {mem} is under 64 MiB; the unit is bytes (80 GB = 80e9 "
                           "written as an integer, e.g. 85899345920)")
    peaks = d["peak_flops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise ProfileError(f"{where}.peak_flops: expected a mapping of dtype to FLOP/s")
    for k, v in peaks.items():
        if k not in FLOP_DTYPES:
            raise ProfileError(f"{where}.peak_flops.{k}: unknown dtype (allowed: {', '.join(FLOP_DTYPES)})")
        _pos(v, f"{where}.peak_flops.{k}", unit="FLOP/s")
    return DeviceSpec(
        name=str(d["name"]), memory_bytes=int(mem),
        usable_memory_fraction=_fraction(d["usable_memory_fraction"], f"{where}.usable_memory_fraction"),
        peak_flops={k: float(v) for k, v in peaks.items()},
        memory_bandwidth=float(_pos(d["memory_bandwidth"], f"{where}.memory_bandwidth", unit="bytes/s")),
        matmul_efficiency=_curve(d["matmul_efficiency"], f"{where}.matmul_efficiency", y_fraction=True),
        memory_efficiency=_curve(d["memory_efficiency"], f"{where}.memory_efficiency", y_fraction=True),
        op_overhead=_overhead(d.get("op_overhead"), f"{where}.op_overhead"),
        kernel_costs=_kernels(d.get("kernel_costs"), f"{where}.kernel_costs"),
        **{k: _curve(d[k], f"{where}.{k}", y_fraction=True) for k in ("linear_efficiency",
                                                                     "linear_backward_efficiency") if k in d},
        by_precision=_by_precision(d.get("by_precision"), f"{where}.by_precision"),
        **_gpu_fields(d, where))


_RATE_CURVES = ("matmul_efficiency", "linear_efficiency", "linear_backward_efficiency")
"""The curves a `by_precision` entry may carry (with its `kernel_costs` and _ATTENTION_CURVES)."""
_ATTENTION_CURVES = ("attention_efficiency", "attention_backward_efficiency")
"""A `by_precision` entry's SDPA curves: {head dim: curve}."""


def _by_precision(d: Any, where: str) -> dict[str, PrecisionRates]:
    """`by_precision: {bf16: {linear_efficiency: [...], ..., kernel_costs: {...}}}` (optional)."""
    if d is None:
        return {}
    d = _keys(d, where, (), ("bf16", "fp16"))
    out = {}
    for prec, v in d.items():
        w = f"{where}.{prec}"
        v = _keys(v, w, (), _RATE_CURVES + _ATTENTION_CURVES + ("kernel_costs",))
        out[prec] = PrecisionRates(kernel_costs=_kernels(v.get("kernel_costs"), f"{w}.kernel_costs"),
                                   **{k: _curve(v[k], f"{w}.{k}", y_fraction=True) for k in _RATE_CURVES if k in v},
                                   **{k: _by_head_dim(v[k], f"{w}.{k}") for k in _ATTENTION_CURVES if k in v})
    return out


def _by_head_dim(d: Any, where: str) -> dict[int, tuple[tuple[float, float], ...]]:
    """`{head dim: [[FLOPs, fraction], ...]}`."""
    if not isinstance(d, Mapping) or not d:
        raise ProfileError(f"{where}: expected a mapping of head dim to a curve, e.g. {{64: [[2.1e6, 0.02]]}}")
    out = {}
    for hd, curve in d.items():
        out[int(_pos(hd, f"{where}.{hd}", integer=True))] = _curve(curve, f"{where}.{hd}", y_fraction=True)
    return out


_GPU_KEYS = ("sms", "matmul", "attention", "kernel_floor", "async_host", "matmul_shapes", "attention_shapes",
             "norm_shapes", "reduce_shapes", "threads", "comm_shares_compute", "sync_wait")
"""Optional device keys of the shape-aware compute model and of how a rank's cores are used (profiles without them
load as before)."""
_PRECISIONS = ("fp32", "bf16", "fp16")
"""Precisions a measured shape row may name."""
_ATTN_EFFS = ("forward_efficiency", "backward_efficiency")
"""The keys of one attention kernel's figures."""


def _matmul(d: Any, where: str) -> MatmulModel:
    d = _keys(d, where, ("tiles", "best_efficiency"), ("k_overhead", "unaligned_efficiency"))
    tiles = d["tiles"]
    if not isinstance(tiles, list) or not tiles or any(not isinstance(t, list) or len(t) != 2 for t in tiles):
        raise ProfileError(f"{where}.tiles: expected a list of [rows, columns] pairs, e.g. [[256, 128]]")
    return MatmulModel(tiles=tuple((int(_pos(a, f"{where}.tiles", integer=True)),
                                    int(_pos(b, f"{where}.tiles", integer=True))) for a, b in tiles),
                       best_efficiency=_fraction(d["best_efficiency"], f"{where}.best_efficiency"),
                       k_overhead=float(_pos(d["k_overhead"], f"{where}.k_overhead")) if "k_overhead" in d else 0.0,
                       unaligned_efficiency=_fraction(d["unaligned_efficiency"], f"{where}.unaligned_efficiency")
                       if "unaligned_efficiency" in d else None)


def _attention_effs(d: Mapping[str, Any], where: str) -> tuple[float, float]:
    return (_fraction(d["forward_efficiency"], f"{where}.forward_efficiency"),
            _fraction(d["backward_efficiency"], f"{where}.backward_efficiency"))


def _head_dims(name: str, d: Mapping[str, Any], where: str) -> list[tuple[str, int, float, float]]:
    """A kernel's optional `head_dims: {head dim: [forward_efficiency, backward_efficiency]}`."""
    table = d.get("head_dims") or {}
    if not isinstance(table, Mapping):
        raise ProfileError(f"{where}.head_dims: expected a mapping like {{64: [0.37, 0.41]}}")
    return [(name, int(_pos(hd, f"{where}.head_dims.{hd}", integer=True)),
             *_effs_pair(effs, f"{where}.head_dims.{hd}")) for hd, effs in table.items()]


def _seq_lens(name: str, d: Mapping[str, Any], where: str) -> list[tuple[str, int, int, float, float]]:
    """A kernel's optional `seq_lens: {head dim: {sequence length: [forward_efficiency, backward_efficiency]}}`."""
    table = d.get("seq_lens") or {}
    example = "{128: {8192: [0.56, 0.54]}}"
    if not isinstance(table, Mapping) or any(not isinstance(v, Mapping) for v in table.values()):
        raise ProfileError(f"{where}.seq_lens: expected a mapping of head dim to sequence lengths, like {example}")
    return [(name, int(_pos(hd, f"{where}.seq_lens.{hd}", integer=True)),
             int(_pos(n, f"{where}.seq_lens.{hd}.{n}", integer=True)), *_effs_pair(effs, f"{where}.seq_lens.{hd}.{n}"))
            for hd, row in table.items() for n, effs in row.items()]


def _effs_pair(effs: Any, where: str) -> tuple[float, float]:
    if not isinstance(effs, list) or len(effs) != 2:
        raise ProfileError(f"{where}: expected [forward_efficiency, backward_efficiency]")
    return _fraction(effs[0], where), _fraction(effs[1], where)


_ATTN_TABLES = ("head_dims", "seq_lens")
"""A kernel's optional tables of efficiencies at other head dims and sequence lengths."""


def _attention(d: Any, where: str) -> AttentionModel:
    """`{forward_efficiency, backward_efficiency[, block, kernel, head_dim, seq_len, head_dims, seq_lens]}` (one
    kernel), or `{kernel, kernels: {name: {forward_efficiency, backward_efficiency[, head_dims, seq_lens]}, ...}[,
    block, head_dim, seq_len]}` (several; `kernel` names the one that runs). The efficiencies are for head dim
    `head_dim` (default 128) at sequence length `seq_len` (default 2048); `head_dims: {64: [forward, backward]}`
    gives a kernel's at other head dims (at `seq_len`), `seq_lens: {128: {8192: [forward, backward]}}` at other
    sequence lengths."""
    m = isinstance(d, Mapping)
    hd = int(_pos(d.get("head_dim", 128), f"{where}.head_dim", integer=True)) if m else 128
    sl = int(_pos(d.get("seq_len", 2048), f"{where}.seq_len", integer=True)) if m else 2048
    shared = ("block", "head_dim", "seq_len")

    def tables(ks: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple]:
        return {"head_dims": tuple(r for k, v in ks.items() for r in _head_dims(k, v, f"{where}.kernels.{k}")),
                "seq_lens": tuple(r for k, v in ks.items() for r in _seq_lens(k, v, f"{where}.kernels.{k}"))}

    if m and d.get("kernel") == UNFUSED_ATTENTION:
        # the attention's own kernels (GEMMs and memory-bound passes) price it: no efficiencies to give
        d = _keys(d, where, ("kernel",), (*shared, "kernels", *_ATTN_EFFS))
        ks = {str(k): _keys(v, f"{where}.kernels.{k}", _ATTN_EFFS, _ATTN_TABLES)
              for k, v in (d.get("kernels") or {}).items()}
        table = tuple((k, *_attention_effs(v, f"{where}.kernels.{k}")) for k, v in ks.items())
        return AttentionModel(forward_efficiency=0.0, backward_efficiency=0.0, kernel=UNFUSED_ATTENTION,
                              kernels=table, block=int(_pos(d.get("block", 128), f"{where}.block", integer=True)),
                              head_dim=hd, seq_len=sl, **tables(ks))
    if m and "kernels" in d:
        d = _keys(d, where, ("kernel", "kernels"), shared)
        ks = d["kernels"]
        if not isinstance(ks, Mapping) or not ks:
            raise ProfileError(f"{where}.kernels: expected a mapping of kernel name to "
                               "{forward_efficiency, backward_efficiency}")
        ks = {str(k): _keys(v, f"{where}.kernels.{k}", _ATTN_EFFS, _ATTN_TABLES) for k, v in ks.items()}
        table = tuple((k, *_attention_effs(v, f"{where}.kernels.{k}")) for k, v in ks.items())
        chosen = [t for t in table if t[0] == str(d["kernel"])]
        if not chosen:
            raise ProfileError(f"{where}.kernel: {d['kernel']!r} is not one of the listed kernels "
                               f"({', '.join(t[0] for t in table)}) nor {UNFUSED_ATTENTION!r}")
        name, f, b = chosen[0]
        extra = tables(ks)
    else:
        if m and "kernel" in d and not set(_ATTN_EFFS) & set(d):  # a name alone prices nothing but `unfused`
            raise ProfileError(f"{where}.kernel: {d['kernel']!r} comes without its forward_efficiency and "
                               f"backward_efficiency; give them beside it, or use kernel: {UNFUSED_ATTENTION} "
                               "(separate GEMMs and softmax)")
        d = _keys(d, where, _ATTN_EFFS, (*shared, "kernel", *_ATTN_TABLES))
        (f, b), name, table = _attention_effs(d, where), str(d.get("kernel", "")), ()
        extra = {"head_dims": tuple(_head_dims(name, d, where)), "seq_lens": tuple(_seq_lens(name, d, where))}
    return AttentionModel(forward_efficiency=f, backward_efficiency=b, kernel=name, kernels=table,
                          block=int(_pos(d.get("block", 128), f"{where}.block", integer=True)), head_dim=hd,
                          seq_len=sl, **extra)


def _attention_dict(a: AttentionModel) -> dict[str, Any]:
    """Plain-data form of an AttentionModel that `_attention` reads back to an equal one."""
    def dims(kernel: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        table = {d: [f, b] for k, d, f, b in a.head_dims if k == kernel}
        if table:
            out["head_dims"] = table
        for k, d, n, f, b in a.seq_lens:
            if k == kernel:
                out.setdefault("seq_lens", {}).setdefault(d, {})[n] = [f, b]
        return out

    head = {"head_dim": a.head_dim} if a.head_dim != 128 else {}
    if a.seq_len != 2048:
        head["seq_len"] = a.seq_len
    if a.kernel == UNFUSED_ATTENTION and not a.kernels:
        return {"kernel": a.kernel, "block": a.block, **head}
    if a.kernels:
        return {"kernel": a.kernel, "block": a.block, **head,
                "kernels": {k: {"forward_efficiency": f, "backward_efficiency": b, **dims(k)}
                            for k, f, b in a.kernels}}
    out: dict[str, Any] = {"forward_efficiency": a.forward_efficiency, "backward_efficiency": a.backward_efficiency,
                           "block": a.block, **head, **dims(a.kernel)}
    if a.kernel:
        out["kernel"] = a.kernel
    return out


def _rows(rows: Any, where: str, ints: int, flags: int, secs: int, example: str) -> tuple:
    """A measured shape table: each row `ints` positive integers, `flags` booleans, a precision, `secs` seconds."""
    if not isinstance(rows, list):
        raise ProfileError(f"{where}: expected a list of rows like {example}")
    out = []
    for i, r in enumerate(rows):
        w = f"{where}[{i}]"
        if not isinstance(r, list) or len(r) != ints + flags + 1 + secs:
            raise ProfileError(f"{w}: expected a row like {example}")
        row: list[Any] = [int(_pos(x, w, integer=True)) for x in r[:ints]]
        for x in r[ints:ints + flags]:
            if not isinstance(x, bool):
                raise ProfileError(f"{w}: expected true/false for causal, got {x!r}")
            row.append(x)
        if r[ints + flags] not in _PRECISIONS:
            raise ProfileError(f"{w}: precision {r[ints + flags]!r} is not one of {', '.join(_PRECISIONS)}")
        row.append(r[ints + flags])
        row.extend(_seconds(x, w) for x in r[ints + flags + 1:])
        out.append(tuple(row))
    return tuple(out)


def _gemm_rows(rows: Any, where: str) -> tuple:
    """`matmul_shapes`: rows [batch, M, N, K, precision, seconds], each optionally ending in its layout."""
    example = "[batch, M, N, K, bf16, seconds, nt]"
    if not isinstance(rows, list):
        raise ProfileError(f"{where}: expected a list of rows like {example}")
    layouts = []
    for i, r in enumerate(rows):
        if isinstance(r, list) and len(r) == 7:
            if r[6] not in GEMM_LAYOUTS:
                raise ProfileError(f"{where}[{i}]: layout {r[6]!r} is not one of {', '.join(GEMM_LAYOUTS)}")
            layouts.append((r[6],))
        else:
            layouts.append(())
    bare = [r[:6] if isinstance(r, list) and len(r) == 7 else r for r in rows]
    return tuple(row + extra for row, extra in zip(_rows(bare, where, 4, 0, 1, example), layouts))


def _norm_rows(rows: Any, where: str) -> tuple:
    """`norm_shapes`: rows [rows, width, parameters 0-2, function, precision, forward s, backward s]."""
    example = "[8192, 768, 2, layer_norm, fp32, fwd_s, bwd_s]"
    named = []
    for i, r in enumerate(rows if isinstance(rows, list) else []):
        if isinstance(r, list) and len(r) == 7:
            if r[2] not in (0, 1, 2) or isinstance(r[2], bool):
                raise ProfileError(f"{where}[{i}]: parameters must be 0, 1 or 2 (weight, bias), got {r[2]!r}")
            if r[3] not in NORM_FUNCTIONS:
                raise ProfileError(f"{where}[{i}]: function {r[3]!r} is not one of {', '.join(NORM_FUNCTIONS)}")
        named.append(tuple(r[2:4]) if isinstance(r, list) and len(r) == 7 else ())
    bare = [[*r[:2], *r[4:]] if isinstance(r, list) and len(r) == 7 else r for r in rows] \
        if isinstance(rows, list) else rows
    return tuple((*row[:2], *extra, *row[2:]) for row, extra in zip(_rows(bare, where, 2, 0, 2, example), named))


def _gpu_fields(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The optional shape-aware compute fields present in a device mapping, validated."""
    out: dict[str, Any] = {}
    if "sms" in d:
        out["sms"] = int(_pos(d["sms"], f"{where}.sms", integer=True))
    if "matmul" in d:
        out["matmul"] = _matmul(d["matmul"], f"{where}.matmul")
    if "attention" in d:
        out["attention"] = _attention(d["attention"], f"{where}.attention")
    if "kernel_floor" in d:
        out["kernel_floor"] = _seconds(d["kernel_floor"], f"{where}.kernel_floor")
    for k in ("async_host", "comm_shares_compute"):
        if k in d:
            if not isinstance(d[k], bool):
                raise ProfileError(f"{where}.{k}: expected true or false")
            out[k] = d[k]
    if "threads" in d:
        out["threads"] = int(_pos(d["threads"], f"{where}.threads", integer=True))
    if "sync_wait" in d:
        out["sync_wait"] = _sync_wait(d["sync_wait"], f"{where}.sync_wait")
    if "matmul_shapes" in d:
        out["matmul_shapes"] = _gemm_rows(d["matmul_shapes"], f"{where}.matmul_shapes")
    if "attention_shapes" in d:
        out["attention_shapes"] = _rows(d["attention_shapes"], f"{where}.attention_shapes", 4, 1, 2,
                                        "[batch*heads, s_q, s_k, head_dim, causal, bf16, fwd_s, bwd_s]")
    if "norm_shapes" in d:
        out["norm_shapes"] = _norm_rows(d["norm_shapes"], f"{where}.norm_shapes")
    if "reduce_shapes" in d:
        out["reduce_shapes"] = _rows(d["reduce_shapes"], f"{where}.reduce_shapes", 2, 0, 1,
                                     "[rows, width, bf16, seconds]")
    return out


def _sync_wait(pts: Any, where: str) -> tuple[tuple[float, float], ...]:
    """[[compute seconds, wait seconds], ...]: both in seconds (a wait may be 0), compute strictly increasing."""
    if not isinstance(pts, list) or not pts or any(not isinstance(p, list) or len(p) != 2 for p in pts):
        raise ProfileError(f"{where}: expected a list of [compute seconds, wait seconds] pairs, "
                           "e.g. [[2.0e-3, 1.0e-3]]")
    out = tuple((_seconds(x, f"{where}[{i}][0]"), _seconds(y, f"{where}[{i}][1]")) for i, (x, y) in enumerate(pts))
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        raise ProfileError(f"{where}: compute seconds must be strictly increasing")
    return out


def _gpu_dict(dev: DeviceSpec) -> dict[str, Any]:
    """The shape-aware compute fields of a device that differ from their defaults, as plain data."""
    out: dict[str, Any] = {}
    if dev.sms:
        out["sms"] = dev.sms
    if dev.matmul is not None:
        out["matmul"] = {"tiles": [list(t) for t in dev.matmul.tiles], "best_efficiency": dev.matmul.best_efficiency,
                         **({"k_overhead": dev.matmul.k_overhead} if dev.matmul.k_overhead else {}),
                         **({"unaligned_efficiency": dev.matmul.unaligned_efficiency}
                            if dev.matmul.unaligned_efficiency is not None else {})}
    if dev.attention is not None:
        out["attention"] = _attention_dict(dev.attention)
    if dev.kernel_floor:
        out["kernel_floor"] = dev.kernel_floor
    if dev.async_host:
        out["async_host"] = True
    if dev.threads:
        out["threads"] = dev.threads
    if dev.comm_shares_compute:
        out["comm_shares_compute"] = True
    if dev.sync_wait:
        out["sync_wait"] = [list(p) for p in dev.sync_wait]
    if dev.matmul_shapes:
        out["matmul_shapes"] = [list(r) for r in dev.matmul_shapes]
    if dev.attention_shapes:
        out["attention_shapes"] = [list(r) for r in dev.attention_shapes]
    if dev.norm_shapes:
        out["norm_shapes"] = [list(r) for r in dev.norm_shapes]
    if dev.reduce_shapes:
        out["reduce_shapes"] = [list(r) for r in dev.reduce_shapes]
    return out


def _seconds(x: Any, where: str) -> float:
    """A non-negative number of seconds under one second (0 is allowed: no overhead)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0:
        return 0.0
    s = float(_pos(x, where, unit="seconds"))
    if s >= 1.0:
        raise ProfileError(f"{where}: {s} s is implausibly large; the unit is seconds (e.g. 5e-6)")
    return s


def _overhead(d: Any, where: str) -> OpOverhead:
    if d is None:
        return OpOverhead()
    names = tuple(f.name for f in fields(OpOverhead))
    d = _keys(d, where, (), names)
    return OpOverhead(**{k: _seconds(v, f"{where}.{k}") for k, v in d.items()})


def _kernels(d: Any, where: str) -> dict[str, tuple[float, float]]:
    if d is None:
        return {}
    d = _keys(d, where, (), KERNELS)
    out = {}
    for k, v in d.items():
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise ProfileError(f"{where}.{k}: expected [forward, backward] seconds per element")
        out[k] = (_seconds(v[0], f"{where}.{k}[0]"), _seconds(v[1], f"{where}.{k}[1]"))
    return out


def _collective(d: Any, where: str) -> CollectiveCurve:
    d = _keys(d, where, ("collective", "level", "group_size", "points"))
    if d["collective"] not in COLLECTIVES:
        raise ProfileError(f"{where}.collective: {d['collective']!r} is not one of {', '.join(COLLECTIVES)}")
    if d["level"] not in LEVELS:
        raise ProfileError(f"{where}.level: {d['level']!r} is not one of {', '.join(LEVELS)}")
    pts = _curve(d["points"], f"{where}.points", y_fraction=False)
    return CollectiveCurve(collective=d["collective"], level=d["level"],
                           group_size=int(_pos(d["group_size"], f"{where}.group_size", integer=True)),
                           points=tuple((int(x), float(y)) for x, y in pts))


def cluster_from_dict(d: Any, where: str = "profile") -> Cluster:
    """Build a Cluster from parsed YAML; raises ProfileError naming the field path on any problem."""
    d = _keys(d, where, ("cluster", "device", "links"), ("collectives",))
    c = _keys(d["cluster"], f"{where}.cluster", ("name", "nodes", "devices_per_node"))
    links = _keys(d["links"], f"{where}.links", LEVELS)
    curves = d.get("collectives") or []
    if not isinstance(curves, list):
        raise ProfileError(f"{where}.collectives: expected a list")
    return Cluster(
        name=str(c["name"]),
        nodes=int(_pos(c["nodes"], f"{where}.cluster.nodes", integer=True)),
        devices_per_node=int(_pos(c["devices_per_node"], f"{where}.cluster.devices_per_node", integer=True)),
        device=_device(d["device"], f"{where}.device"),
        intra_node=_link(links["intra_node"], f"{where}.links.intra_node"),
        inter_node=_link(links["inter_node"], f"{where}.links.inter_node"),
        collectives=tuple(_collective(x, f"{where}.collectives[{i}]") for i, x in enumerate(curves)))


def cluster_to_dict(c: Cluster) -> dict[str, Any]:
    """Plain-data form that `cluster_from_dict` reads back to an equal Cluster."""
    def link(l: LinkSpec) -> dict[str, Any]:
        return {f.name: getattr(l, f.name) for f in fields(l)}
    dev = c.device
    return {
        "cluster": {"name": c.name, "nodes": c.nodes, "devices_per_node": c.devices_per_node},
        "device": {"name": dev.name, "memory_bytes": dev.memory_bytes,
                   "usable_memory_fraction": dev.usable_memory_fraction, "peak_flops": dict(dev.peak_flops),
                   "memory_bandwidth": dev.memory_bandwidth,
                   "matmul_efficiency": [list(p) for p in dev.matmul_efficiency],
                   "memory_efficiency": [list(p) for p in dev.memory_efficiency],
                   **({"op_overhead": {f.name: getattr(dev.op_overhead, f.name) for f in fields(OpOverhead)}}
                      if dev.op_overhead != OpOverhead() else {}),
                   **({"kernel_costs": {k: list(v) for k, v in dev.kernel_costs.items()}}
                      if dev.kernel_costs else {}),
                   **{k: [list(p) for p in getattr(dev, k)] for k in ("linear_efficiency",
                                                                     "linear_backward_efficiency") if getattr(dev, k)},
                   **({"by_precision": {p: _rates_dict(r) for p, r in dev.by_precision.items()}}
                      if dev.by_precision else {}),
                   **_gpu_dict(dev)},
        "links": {"intra_node": link(c.intra_node), "inter_node": link(c.inter_node)},
        "collectives": [{"collective": k.collective, "level": k.level, "group_size": k.group_size,
                         "points": [list(p) for p in k.points]} for k in c.collectives],
    }


def _rates_dict(r: PrecisionRates) -> dict[str, Any]:
    """One `by_precision` entry as plain data (its empty fields left out)."""
    out: dict[str, Any] = {k: [list(p) for p in getattr(r, k)] for k in _RATE_CURVES if getattr(r, k)}
    out.update({k: {hd: [list(p) for p in c] for hd, c in getattr(r, k).items()} for k in _ATTENTION_CURVES
                if getattr(r, k)})
    if r.kernel_costs:
        out["kernel_costs"] = {k: list(v) for k, v in r.kernel_costs.items()}
    return out
