"""A batch as the Runner cuts it: its sample count, a replica's share or a micro-batch of it (tensors sliced on
their first dim, in dicts, lists, tuples and namedtuples), on a device, and as positional arguments."""
from __future__ import annotations

import torch

from executor.errors import ExecutorError


def batch_len(x) -> int:
    """Samples in a batch: the first dim of its first tensor (in dicts, lists and tuples)."""
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    values = list(x.values()) if isinstance(x, dict) else list(x) if isinstance(x, (list, tuple)) else []
    for v in values:
        if isinstance(v, (torch.Tensor, dict, list, tuple)):
            try:
                return batch_len(v)
            except ExecutorError:
                continue
    raise ExecutorError("the batch holds no tensor: sample_batch must return tensors (in a tuple or dict) whose "
                        "first dim is the batch")


def slice_batch(x, start: int, n: int):
    """Samples start .. start+n of a batch: tensors sliced on their first dim (in dicts, lists, tuples and
    namedtuples); other values (a float keyword argument, a flag) as they are."""
    if isinstance(x, torch.Tensor):
        return x[start:start + n]
    if isinstance(x, dict):
        return {k: slice_batch(v, start, n) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return _like(x, [slice_batch(v, start, n) for v in x])
    return x


def to_device(x, device):
    """`x`'s tensors (in dicts, lists and tuples) on `device`; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return _like(x, [to_device(v, device) for v in x])
    return x


def _like(x: list | tuple, parts: list) -> list | tuple:
    """`parts` in a sequence of `x`'s type (a namedtuple takes them as positional arguments)."""
    return type(x)(*parts) if hasattr(x, "_fields") else type(x)(parts)


def as_args(x) -> tuple:
    if isinstance(x, dict):
        raise ExecutorError("dict inputs are passed as keyword arguments, which pipeline stages do not support; "
                            "make sample_batch return a tensor or a tuple of tensors, or use pp=1")
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)
