"""Gradient clipping by the global norm over every rank's share, as `torch.nn.utils.clip_grad_norm_` over the whole
model in one process.

Each rank holds pieces of the gradients: a DTensor gradient its local shard, a plain one the whole tensor (DDP's,
identical on every dp and tp rank of its stage), and pipeline stages different parameters. A piece held by `c` ranks
of its stage's (dp, tp) grid adds its squared norm divided by `c`, so one all-reduce over all ranks sums every
element once; a tied weight whose copies sit on several stages is counted on the first only. Every rank then
scales all its gradients by min(1, max_norm / (norm + 1e-6)), torch's coefficient. The sums run on the local
tensors (one foreach norm and one foreach multiply per dtype, as torch's own clipping), so no DTensor dispatch is
paid per gradient.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

try:  # FSDP2's shard of a tp shard; not a Shard subclass in torch 2.13
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = ()

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grads_with_norm_'s epsilon: coefficient max_norm / (total_norm + 1e-6)."""


def holders(grad: torch.Tensor, stage_ranks: int) -> int:
    """How many of the `stage_ranks` ranks of a stage's (dp, tp) grid hold the same piece of `grad`: all of them
    for a plain tensor, fewer by the size of each mesh dim a DTensor is sharded over (FSDP2's strided shards
    included)."""
    if not isinstance(grad, DTensor):
        return stage_ranks
    split = 1
    for i, pl in enumerate(grad.placements):
        if pl.is_shard() or isinstance(pl, _StridedShard):
            split *= grad.device_mesh.size(i)
    return max(1, stage_ranks // split)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm(grads: Iterable[tuple[torch.Tensor, bool]], max_norm: float, stage_ranks: int,
                   device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip in place every gradient in `grads` ((gradient, counted) pairs: `counted` False for a copy another stage
    counts) to the global norm `max_norm`; returns the norm before clipping (an fp32 scalar on `device`, the rank's
    device, the same on every rank, also where this rank holds no gradient). `group`: all the ranks (default: the
    world)."""
    with torch.no_grad():
        pairs = [(_local(g), holders(g, stage_ranks), counted) for g, counted in grads if g is not None]
        by_kind: dict = defaultdict(list)
        for t, c, counted in pairs:
            by_kind[(t.device, t.dtype)].append((t, c if counted else 0))
        total = torch.zeros((), dtype=torch.float32, device=device)
        for (dev, _), items in by_kind.items():
            kept = [(t, c) for t, c in items if c and t.numel()]
            if not kept:
                continue
            norms = torch._foreach_norm([t for t, _ in kept], 2)
            weights = torch.tensor([1.0 / c for _, c in kept], dtype=torch.float32, device=dev)
            total += (torch.stack(norms).float().square() * weights).sum().to(device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
        for (dev, _), items in by_kind.items():
            torch._foreach_mul_([t for t, _ in items], coef.to(dev))
    return norm
