"""`plan MODEL.py --summary`: what the tracer found, as a readable table."""
from __future__ import annotations

import os
from collections import Counter

from rich.table import Table

from planner.graph import OpGraph
from planner.tables import render


def _si(x: float, unit: str) -> str:
    """1.2345e12 -> '1.23 T' + unit."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _bytes(n: float) -> str:
    """Bytes in binary units."""
    for scale, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {prefix}"
    return f"{n:.0f} B"


def format_summary(graph: OpGraph) -> str:
    """A table of the traced model: parameters, FLOPs and activation memory per sample, ops, repeated blocks."""
    ops = graph.ops
    fwd = sum(op.fwd_flops for op in ops) / graph.batch_size
    bwd = sum(op.bwd_flops for op in ops) / graph.batch_size
    dtypes = Counter(p.dtype for p in graph.parameters)
    kinds = Counter(op.kind for op in ops)
    name = graph.model_name
    if os.path.isabs(name) and os.path.abspath(name).startswith(os.getcwd() + os.sep):
        name = os.path.relpath(name)
    table = Table(title=f"Model summary: {name}", show_header=False, title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("value")
    table.add_row("parameters", f"{graph.num_parameters:,} ({_si(graph.num_parameters, '')}), "
                                f"{_bytes(graph.parameter_bytes)} at {', '.join(dtypes) or '-'}")
    table.add_row("FLOPs per sample", f"{_si(fwd + bwd, 'FLOP')} fwd+bwd (fwd {_si(fwd, 'FLOP')}, "
                                      f"bwd {_si(bwd, 'FLOP')})")
    table.add_row("activation memory per sample", f"{_bytes(graph.saved_bytes_per_sample())} saved for backward "
                                                  "(traced dtypes, no recomputation)")
    table.add_row("ops", f"{len(ops)} (" + ", ".join(f"{k} {n}" for k, n in kinds.most_common()) + ")")
    blocks = graph.block_types
    if blocks and all(len(names) == 1 for names in blocks.values()):  # planner.blocks' top-level units
        table.add_row("repeated blocks", "none found; pipeline units: " + ", ".join(blocks) + " (top-level modules)")
    elif blocks:
        lines = []
        for block_type, names in blocks.items():
            first = [op for op in ops if op.block == names[0]]
            params = sum(p.numel for op in first for p in {q.name: q for q in op.params}.values())
            lines.append(f"{block_type} x {len(names)} ({len(first)} ops, {_si(params, '')} params, "
                         f"{_si(sum(op.flops for op in first) / graph.batch_size, 'FLOP')}/sample each)")
        table.add_row("repeated blocks", "\n".join(lines))
    else:
        table.add_row("repeated blocks", "none found")
    table.add_row("pipeline layers", f"{len(graph.layers())} (pre, blocks, post)")
    table.add_row("inputs", ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in graph.inputs) or "-")
    table.add_row("tracer", f"{'torch.fx' if graph.tracer == 'fx' else 'torch.export'} "
                            f"(traced with batch size {graph.batch_size} on the meta device)")
    return render(table, width=110)
