"""What a model's blocks are: the units the pipeline cuts between, activation checkpointing re-runs and FSDP wraps.
One rule, read by the tracer (each op's `OpNode.block`, hence `OpGraph.layers()`, the search's stage cuts and the
cost model) and by the executor (executor.parallel.blocks, executor.pipeline's split), so both see the same layers.

*Repeated blocks* (`find_blocks`): structurally identical children of a `ModuleList`/`Sequential`/`ModuleDict`
(torchtitan keeps its layers in one), at any depth. Two children are identical when they have the same class and
the same parameter and buffer names, shapes and dtypes; only composite modules with parameters count (not a run of
ReLUs or the bare Linears of an MLP). A group of two or more identical children of one container is a block type
named `CONTAINER.*` (e.g. `transformer.h.*`); each child is an instance named by its path (`transformer.h.3`).
Blocks are not searched for inside other blocks: the outermost repetition is the one later stages reuse.

*Top-level units* (`top_level_units`), for a model without repeated blocks (an nn.Sequential of bare Linears): each
child of the root with parameters is a unit, an nn.Sequential or nn.ModuleList (the root or a child) standing for
its children. Each unit is a block of its own type (named by its path); parameterless children (ReLUs) are glue
between them. `layer_blocks` is the rule everything reads: the repeated blocks when there are any, else the units.
"""
from __future__ import annotations

from typing import Hashable

import torch.nn as nn


def _can_be_block(module: nn.Module) -> bool:
    """Blocks are composite modules with parameters: repeated ReLUs or bare Linears of an MLP are not blocks."""
    return next(module.children(), None) is not None and next(module.parameters(), None) is not None


def structure_signature(module: nn.Module) -> Hashable:
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
                    groups.setdefault(structure_signature(child), []).append(path)
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


CONTAINERS = (nn.Sequential, nn.ModuleList)
"""Containers that stand for their children when a model is cut into top-level units."""


def top_level_units(model: nn.Module) -> list[str]:
    """Paths of the top-level units of `model` (see the module docstring), in definition order; empty when there
    are fewer than two (one unit is the whole model: nothing to cut)."""
    out: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, CONTAINERS):
                walk(child, path)
            elif next(child.parameters(), None) is not None:
                out.append(path)
    walk(model, "")
    return out if len(out) >= 2 else []


def layer_blocks(model: nn.Module) -> dict[str, str]:
    """Block instance path -> block type: the repeated blocks (`find_blocks`) when the model has any, else its
    top-level units, each a type of its own named by its path."""
    return find_blocks(model) or {path: path for path in top_level_units(model)}


def layer_modules(model: nn.Module) -> list[list[str]]:
    """The model's modules as pipeline layers, in definition order: each block of `layer_blocks` alone, and each
    run of other modules between blocks together (a module holding a block stands for its children). A model that
    calls its modules in definition order gets the layers `OpGraph.layers()` cuts (without the root's own ops)."""
    blocks = layer_blocks(model)
    layers: list[list[str]] = []
    run: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        nonlocal run
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path in blocks:
                layers.extend([run, [path]] if run else [[path]])
                run = []
            elif any(b.startswith(path + ".") for b in blocks):
                walk(child, path)
            else:
                run.append(path)
    walk(model, "")
    return layers + ([run] if run else [])


def block_of(module_path: str, blocks: dict[str, str]) -> tuple[str | None, str | None]:
    """(instance, type) of the block containing `module_path`, or (None, None)."""
    path = module_path
    while path:
        if path in blocks:
            return path, blocks[path]
        path = path.rpartition(".")[0]
    return None, None
