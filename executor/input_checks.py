"""What a training script hands the Runner, checked where a mistake would otherwise train wrongly or fail deep in
torch: the optimizer its factory builds, and, on the first step, the batch (the same on every rank of a tp or pp
group) and its shapes (those of the example the model was exported with). Each problem is one ExecutorError line
naming the fix."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from executor.errors import ExecutorError

if TYPE_CHECKING:
    from executor.runner import Runner


def takes_names(factory: Callable) -> bool:
    """Whether an optimizer factory takes (params, names): two or more positional parameters without defaults."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is p.empty) >= 2


def check_optimizer(optimizer: Any, params: list) -> None:
    """ExecutorError unless the factory's optimizer holds only parameters it was given: one built from the model's
    own parameters (`model.named_parameters()` read inside the factory) holds the unsharded originals, which
    sharding replaced, and trains nothing, silently."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ExecutorError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    given = {id(p) for p in params}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in given)
    if foreign:
        raise ExecutorError(f"the optimizer holds {foreign} tensor(s) that are not the parameters its factory was given "
                            "(sharding replaces the model's parameters, so the model's own no longer train): build it "
                            "from the factory's argument; for groups by name take two, "
                            "optimizer=lambda params, names: ..., names[i] being params[i]'s name in the model")


def check_example_shapes(micro_batch: Any, example: Any) -> None:
    """ExecutorError unless a micro-batch of the first step has the shapes and dtypes of the example the model was
    exported with (export fixes them: another sequence length failed deep in torch with a guard error per rank)."""
    from torch.utils._pytree import tree_leaves

    def meta(x):
        return [(tuple(t.shape), t.dtype) for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
    got, want = meta(micro_batch), meta(example)
    if got != want:
        def say(m):
            return ", ".join(f"{list(s)} {str(d).removeprefix('torch.')}" for s, d in m)
        raise ExecutorError(f"step()'s micro-batch inputs are {say(got)} but example_inputs was {say(want)}: the "
                            "model runs as the graph exported with example_inputs, which keeps its shapes and "
                            "dtypes; pass example_inputs shaped as one micro-batch of the batches you train on")


def check_same_batch(runner: "Runner", inputs: Any, targets: Any) -> None:
    """ExecutorError unless the ranks of each tp and pp group got the same replica's batch (a DistributedSampler
    over every rank gives each its own, and tp or pipeline ranks would then train one batch's activations against
    another's, silently). One small all-gather per group; the dry run's fake tensors are skipped."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._pytree import tree_leaves
    leaves = [t for t in tree_leaves((inputs, targets)) if isinstance(t, torch.Tensor)]
    if not leaves or any(is_fake(t) for t in leaves):  # fake tensors hold no values
        return
    mine = torch.tensor([sum(float(t.double().sum()) + float((t.double() ** 2).sum()) for t in leaves)],
                        dtype=torch.float64, device=runner.device)
    for axis in ("tp", "pp"):
        n = getattr(runner.plan.mesh, axis)
        if n < 2:
            continue
        got = [torch.zeros_like(mine) for _ in range(n)]
        dist.all_gather(got, mine, group=runner.mesh[axis].get_group())
        if len({float(g) for g in got}) > 1:
            raise ExecutorError(f"the ranks of one {axis} group got different batches in step(): every rank "
                                "passes the same global batch (or its dp replica's share), e.g. drawn from one "
                                "seeded generator; a DistributedSampler over all ranks gives each rank its own "
                                "(give it num_replicas=dp and rank=the dp rank, runner.mesh['dp'].get_local_rank())")
