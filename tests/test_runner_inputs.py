"""The runner's helpers that put a batch on the model's device and build its default optimizer."""
from __future__ import annotations

from collections import namedtuple

import torch

from executor.runner import _to, default_optimizer


def test_batches_move_to_the_device_whatever_their_structure():
    Pair = namedtuple("Pair", "ids mask")
    batch = ({"ids": torch.ones(2, 3, dtype=torch.long), "n": 3, "name": "x", "none": None},
             [Pair(torch.zeros(2), torch.ones(2, dtype=torch.bool)), 4.5])
    moved = _to(batch, torch.device("meta"))  # any device but the batch's own
    assert moved[0]["ids"].device.type == "meta" and moved[0]["ids"].dtype == torch.long
    assert (moved[0]["n"], moved[0]["name"], moved[0]["none"], moved[1][1]) == (3, "x", None, 4.5)
    assert isinstance(moved[1][0], Pair) and moved[1][0].mask.device.type == "meta"
    assert isinstance(moved[1], list) and isinstance(moved, tuple)


def test_default_optimizer_is_torchs_adamw_off_cuda():
    opt = default_optimizer(iter([torch.nn.Parameter(torch.ones(3))]))  # a generator, as module.parameters()
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 1e-3
    assert not opt.defaults.get("fused")  # fused=True only for CUDA parameters
