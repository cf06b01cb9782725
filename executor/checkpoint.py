"""Checkpoints that move between plans, written with torch.distributed.checkpoint (DCP).

Every tensor is stored under the model's own parameter name — the first name `named_parameters()` gives it, so a
tied weight is stored once (`wte.weight`, never `lm_head.weight`) — whatever wrapper, stage or shard holds it:

    model/<name>             the parameter (a DTensor shard, a replica, or a pipeline stage's copy)
    optim/<name>/<state>     the optimizer's per-parameter state (e.g. exp_avg, exp_avg_sq, step)
    buffer/<name>            buffers
    meta/step                steps taken
    extra/<key>/...          what `extra` passed to save held (a learning-rate scheduler's state_dict(), ...)

DCP records each DTensor's global shape and shard offsets, and on load reads exactly the slices the new plan's
shards cover, so a run saved with ZeRO-3 on dp=2 resumes with tp=2 x pp=2 (or on one process). Of the optimizer's
hyper-parameters only each parameter group's current learning rate is stored (`meta/lr`: a scheduler moved it, and
a scheduler's own state does not put it back); the rest come from the optimizer factory given to `apply_plan`.
"""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn

from executor.errors import ExecutorError, first_line

if TYPE_CHECKING:
    from executor.runner import Runner


def _modules(runner: "Runner") -> Iterator[nn.Module]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    for part in runner.parts:
        yield part.module if isinstance(part, DDP) else part


def _params(runner: "Runner") -> Iterator[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) for every parameter name on this rank, tied aliases included."""
    for mod in _modules(runner):
        for name, p in mod.named_parameters(remove_duplicate=False):
            yield runner.canonical.get(name, name), p


def _state_dict(runner: "Runner", for_save: bool) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    names_here = {n for mod in _modules(runner) for n, _ in mod.named_parameters(remove_duplicate=False)}
    for canon, p in _params(runner):
        if for_save and canon not in names_here:
            continue  # a tied copy whose canonical owner lives in another stage saves it
        sd[f"model/{canon}"] = p.detach()
        for k, v in runner.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                sd[f"optim/{canon}/{k}"] = v
    for mod in _modules(runner):
        for name, b in mod.named_buffers():
            sd[f"buffer/{name}"] = b
    return sd


def _extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """`extra`'s objects under `extra/<key>`; each must have state_dict() and load_state_dict() (DCP's Stateful:
    DCP calls them)."""
    out = {}
    for key, obj in (extra or {}).items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ExecutorError(f"checkpoint extra[{key!r}] is a {type(obj).__name__}, which has no state_dict() and "
                                "load_state_dict(); pass objects that do (a learning-rate scheduler, a data "
                                "loader's sampler state, ...)")
        out[f"extra/{key}"] = obj
    return out


def save(runner: "Runner", folder: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> None:
    """Write this rank's share of the model and optimizer state, and the state of `extra`'s objects (every rank
    calls it, with the same keys)."""
    sd: dict[str, Any] = {**_state_dict(runner, for_save=True), **_extra(extra)}
    sd["meta/step"] = torch.tensor(runner.step_count)
    sd["meta/lr"] = _group_lrs(runner.optimizer)
    # written whole beside the folder, then swapped in: DCP writes its files in place, so a save interrupted over an
    # existing checkpoint would leave its old .metadata over new, partial shards
    folder = os.fspath(folder).rstrip(os.sep) or os.sep
    if os.path.lexists(folder) and not os.path.isdir(folder):  # said on every rank, before any collective
        raise ExecutorError(f"{folder}: exists and is not a folder; save the checkpoint to a folder")
    staging = folder + STAGING_SUFFIX
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first and os.path.isdir(staging):
        shutil.rmtree(staging)  # what an interrupted save left
    _barrier()
    dcp.save(sd, checkpoint_id=staging)
    _barrier()
    if first:
        swap_in(staging, folder)
    _barrier()


STAGING_SUFFIX = ".saving"
"""`save` writes the checkpoint into FOLDER.saving, then renames it FOLDER."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def swap_in(staging: str, folder: str) -> None:
    """Put the complete checkpoint `staging` at `folder`: an existing one is renamed aside first and removed last,
    so that an interruption leaves one whole checkpoint under one of the two names."""
    old = None
    if os.path.lexists(folder):
        if not os.path.isdir(folder):
            raise ExecutorError(f"{folder}: exists and is not a folder; save the checkpoint to a folder")
        old = folder + ".old"
        if os.path.isdir(old):
            shutil.rmtree(old)
        os.rename(folder, old)
    os.rename(staging, folder)
    if old is not None:
        shutil.rmtree(old)


def _group_lrs(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Each parameter group's learning rate now (a scheduler's, which its own state does not put back on load)."""
    return torch.tensor([float(g["lr"]) for g in optimizer.param_groups], dtype=torch.float64)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state without changing any parameter: one step with zero gradients
    and learning rate 0 (what torch.distributed.checkpoint.state_dict does before loading optimizer state)."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def saved_metadata(folder: str) -> Mapping[str, Any]:
    """The checkpoint's state-dict metadata (key -> what DCP saved: sizes, dtypes), or one line saying why it
    cannot be read."""
    try:
        return dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as e:  # a truncated or foreign .metadata: pickle's errors
        raise ExecutorError(f"{folder}: its .metadata cannot be read ({type(e).__name__}: {first_line(str(e))}); the "
                            "checkpoint is damaged or was not written by runner.save()") from None


def _rank_failure(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (its `failures`: rank -> (exception,
    traceback)), else `e`."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return inner
    return e


def _model_mismatch(saved: Mapping[str, Any], sd: Mapping[str, Any]) -> str:
    """The first model parameter this rank loads that the checkpoint lacks or holds in another shape ("" if none):
    said before DCP, whose own error names neither."""
    for key, t in sd.items():
        if not key.startswith("model/"):
            continue
        if key not in saved:
            return f"the checkpoint has no parameter {key[len('model/'):]!r}"
        size = getattr(saved[key], "size", None)
        if size is not None and tuple(size) != tuple(t.shape):  # a DTensor's shape is the whole parameter's
            return f"parameter {key[len('model/'):]!r} is {tuple(size)} there and {tuple(t.shape)} here"
    return ""


def load(runner: "Runner", folder: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> None:
    """Read a checkpoint written by `save` under any plan into this rank's shards, in place, and into `extra`'s
    objects (load_state_dict) the state saved under the same keys."""
    folder = os.fspath(folder)
    if not os.path.exists(os.path.join(folder, ".metadata")):
        raise ExecutorError(f"{folder}: not a checkpoint (no .metadata); pass a folder runner.save() wrote")
    init_optimizer_state(runner.optimizer)
    sd: dict[str, Any] = {**_state_dict(runner, for_save=False), **_extra(extra)}
    step = torch.tensor(0)
    sd["meta/step"] = step
    lrs = _group_lrs(runner.optimizer)
    saved = saved_metadata(folder)
    problem = _model_mismatch(saved, sd)
    if problem:
        raise ExecutorError(f"{folder}: cannot load into this model: {problem}; was it saved from the same model?")
    held = sorted({k.split("/")[1].split(".")[0] for k in saved if k.startswith("extra/")})
    missing = [k for k in (extra or {}) if k not in held]
    if missing:
        raise ExecutorError(f"{folder}: the checkpoint holds no extra {missing[0]!r} (it holds "
                            f"{', '.join(map(repr, held)) or 'none'}); pass the keys runner.save(extra=...) was given")
    if "meta/lr" in saved and tuple(saved["meta/lr"].size) == tuple(lrs.shape):  # (older checkpoints lack it)
        sd["meta/lr"] = lrs
    try:
        with torch.no_grad():
            dcp.load(sd, checkpoint_id=folder)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        cause = _rank_failure(e)
        raise ExecutorError(f"{folder}: cannot load into this model/plan ({type(cause).__name__}: "
                            f"{first_line(str(cause))}); was it saved from the same model, and written whole?") \
            from None
    runner.step_count = int(step)
    if "meta/lr" in sd:
        for g, lr in zip(runner.optimizer.param_groups, lrs.tolist()):
            g["lr"] = lr
