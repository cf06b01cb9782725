"""Recognising repeated blocks: structurally identical children of a `ModuleList`/`Sequential`/`ModuleDict`
(torchtitan keeps its layers in one), at any depth.

Two children are identical when they have the same class and the same parameter and buffer names, shapes and
dtypes; only composite modules with parameters count (not a run of ReLUs or the bare Linears of an MLP). A group of two or more identical children of one container is a block type named `CONTAINER.*` (e.g.
`transformer.h.*`); each child is an instance named by its path (`transformer.h.3`). Blocks are not searched for
inside other blocks: the outermost repetition is the one later stages reuse.
"""
from __future__ import annotations

from typing import Hashable

import torch.nn as nn


def _can_be_block(module: nn.Module) -> bool:
    """Blocks are composite modules with parameters: repeated ReLUs or bare Linears of an MLP are not blocks."""
    return next(module.children(), None) is not None and next(module.parameters(), None) is not None


def _signature(module: nn.Module) -> Hashable:
    """Class plus parameter and buffer names/shapes/dtypes: equal signatures mean structurally identical."""
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers())
    return (type(module), params, buffers)


def find_blocks(model: nn.Module) -> dict[str, str]:
    """Block instance path -> block type for every repeated block of `model`."""
    out: dict[str, str] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        children = [(f"{prefix}.{n}" if prefix else n, c) for n, c in module.named_children()]
        marked: set[str] = set()
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            groups: dict[Hashable, list[str]] = {}
            for path, child in children:
                if _can_be_block(child):
                    groups.setdefault(_signature(child), []).append(path)
            repeated = [paths for paths in groups.values() if len(paths) >= 2]
            base = f"{prefix}.*" if prefix else "*"
            for paths in repeated:
                cls = type(dict(children)[paths[0]]).__name__
                label = base if len(repeated) == 1 else f"{base}[{cls}]"
                if label in out.values():  # same class twice with different shapes
                    label = f"{label}#{len(set(out.values()))}"
                for path in paths:
                    out[path] = label
                    marked.add(path)
        for path, child in children:
            if path not in marked:
                walk(child, path)

    walk(model, "")
    return out


def block_of(module_path: str, blocks: dict[str, str]) -> tuple[str | None, str | None]:
    """(instance, type) of the block containing `module_path`, or (None, None)."""
    path = module_path
    while path:
        if path in blocks:
            return path, blocks[path]
        path = path.rpartition(".")[0]
    return None, None
