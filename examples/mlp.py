"""A plain MLP classifier: 64 features -> 256 -> 256 -> 10 classes with ReLU, cross-entropy loss.

Model-file convention: `build_model()` and `sample_batch(batch_size)`; the targets are class ids, so the default
loss is cross-entropy.
"""
from __future__ import annotations

import torch
import torch.nn as nn

IN_FEATURES, HIDDEN, CLASSES = 64, 256, 10
"""Input features, hidden width, output classes."""


def build_model() -> nn.Module:
    """Linear -> ReLU -> Linear -> ReLU -> Linear."""
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features (batch_size, 64) and class ids (batch_size,)."""
    return torch.randn(batch_size, IN_FEATURES), torch.randint(0, CLASSES, (batch_size,))
