"""What a plan and its model file allow a trainer to run: the facts `plan export` reads from the model file
(`model_facts`: blocks, their Linears, embeddings, the LM head, the sequence length) and the checks every target
applies with them before writing a configuration (`planner.export`'s rules: a tp layout other than Megatron-LM's
column-then-row pairs, stages a trainer runs on other ranks, more block recomputation than planned, a model that is
not a language model). Each check raises PlanError (one line) or returns what the target may write."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from planner.errors import PlanError
from planner.plan import Plan


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What an export reads from the model file beyond the plan."""

    path: str
    """The model file."""
    fingerprint: str
    """`planner.plan.model_fingerprint` of the built model (a plan for another model is refused)."""
    blocks: tuple[str, ...]
    """Repeated block instances (`h.0`, ...), in model order."""
    block_classes: tuple[str, ...]
    """Class names of the blocks (Accelerate wraps each instance of these)."""
    block_linears: tuple[str, ...]
    """nn.Linear modules inside the blocks."""
    embeddings: tuple[tuple[str, int], ...]
    """(path, rows) of nn.Embedding modules outside the blocks."""
    head: str | None
    """The last nn.Linear after the blocks (the LM head), if any."""
    seq_len: int | None
    """Sequence length of `sample_batch` (dim 1 of its 2-D integer input), if it has one."""


def model_facts(path: str) -> ModelFacts:
    """Read what an export needs from a model file, built on the meta device (raises ModelError when it cannot)."""
    import torch
    from torch import nn

    from planner.blocks import find_blocks
    from planner.model_file import batch, build, load_model_file
    from planner.plan import model_fingerprint

    mf = load_model_file(path)
    model = build(mf, "meta")
    found = find_blocks(model)
    blocks = tuple(found)
    named = dict(model.named_modules())
    inside = lambda p: any(p == b or p.startswith(b + ".") for b in blocks)  # noqa: E731
    linears = [p for p, mod in named.items() if isinstance(mod, nn.Linear)]
    first = next((i for i, p in enumerate(named) if inside(p)), None)
    order = {p: i for i, p in enumerate(named)}
    after = [p for p in linears if not inside(p) and first is not None and order[p] > first]
    inputs, _ = batch(mf, 1)
    return ModelFacts(
        path=mf.path, fingerprint=model_fingerprint((n, p.shape) for n, p in model.named_parameters()),
        blocks=blocks, block_classes=tuple(dict.fromkeys(type(named[b]).__name__ for b in blocks)),
        block_linears=tuple(p for p in linears if inside(p)),
        embeddings=tuple((p, mod.num_embeddings) for p, mod in named.items()
                         if isinstance(mod, nn.Embedding) and not inside(p)),
        head=after[-1] if after else None, seq_len=_seq_len(inputs, torch))


def _seq_len(inputs, torch) -> int | None:
    """Dim 1 of the first 2-D integer tensor among the inputs (token ids), if any."""
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) \
        else [inputs]
    for t in values:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return int(t.shape[1])
    return None


# ---- the checks ------------------------------------------------------------------------------------------------

def _guess_blocks(names: Sequence[str]) -> set[str]:
    """Block instances guessed from module paths: `PREFIX.N` with at least two indices under one PREFIX."""
    by_prefix: dict[str, list[str]] = {}
    for n in names:
        hit = re.fullmatch(r"(.+)\.(\d+)", n)
        if hit:
            by_prefix.setdefault(hit.group(1), []).append(n)
    return {n for group in by_prefix.values() if len(group) >= 2 for n in group}


def stage_blocks(plan: Plan, facts: ModelFacts | None) -> tuple[list[int], bool]:
    """Blocks per pipeline stage, and whether a non-block module sits between two blocks."""
    names = [m for s in plan.stages for m in s.modules]
    blocks = set(facts.blocks) if facts is not None else _guess_blocks(names)
    counts = [sum(m in blocks for m in s.modules) for s in plan.stages]
    where = [i for i, n in enumerate(names) if n in blocks]
    between = bool(where) and any(n not in blocks for n in names[where[0]:where[-1] + 1])
    return counts, between


def tp_layout_problems(plan: Plan, facts: ModelFacts | None, target: str) -> list[str]:
    """How the plan's tp layout differs from the fixed one of Megatron-LM and torchtitan (every Linear of a block
    split colwise/rowwise, the vocabulary embedding split, the LM head colwise); empty when it does not."""
    if plan.mesh.tp == 1:
        return []
    if facts is None:
        raise PlanError(f"cannot export to {target}: tp={plan.mesh.tp} cannot be checked against {target}'s "
                        "tensor-parallel layout without the model file; pass it with --model MODEL.py")
    strategy = {p.module: p.strategy for p in plan.ops.values() if p.strategy in ("colwise", "rowwise", "vocab")}
    out = [f"module {path} (a Linear in a block) is replicated by the plan; {target} splits every Linear of a "
           "block" for path in facts.block_linears if strategy.get(path) not in ("colwise", "rowwise")]
    if facts.embeddings:
        vocab = max(facts.embeddings, key=lambda e: e[1])[0]
        if strategy.get(vocab) != "vocab":
            out.append(f"embedding {vocab} is replicated by the plan; {target} splits the vocabulary embedding")
        out += [f"embedding {p} is split by the plan; {target} splits only the vocabulary embedding"
                for p, _ in facts.embeddings if p != vocab and p in strategy]
    if facts.head is not None and strategy.get(facts.head) != "colwise":
        out.append(f"LM head {facts.head} is not colwise in the plan; {target}'s output layer is column-parallel")
    return out


def refuse_tp_layout(plan: Plan, facts: ModelFacts | None, target: str) -> None:
    problems = tp_layout_problems(plan, facts, target)
    if not problems and facts is not None and plan.mesh.tp > 1:
        problems = [p for p in [pairing_problem(plan, facts, target)] if p]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PlanError(f"cannot export to {target}: {problems[0]}{more}; this layout runs under shardwise's "
                        "executor only; re-plan with --force tp=1 to export")


def pairing_problem(plan: Plan, facts: ModelFacts, target: str) -> str | None:
    """Megatron-LM and torchtitan split a block's input projections by columns and the projection after them by
    rows: in each block, in the order the ops run, every rowwise Linear follows a colwise one since the last
    rowwise, and the block ends on a rowwise one. The first way the plan breaks that, else None."""
    linears = set(facts.block_linears)
    owner = {lin: b for b in facts.blocks for lin in linears if lin.startswith(b + ".")}
    runs: dict[str, list[tuple[str, str]]] = {}
    for p in plan.ops.values():
        if p.module in owner and p.strategy in ("colwise", "rowwise"):
            run = runs.setdefault(owner[p.module], [])
            if (p.module, p.strategy) not in run:  # a module's several ops (or calls) count once
                run.append((p.module, p.strategy))
    for block, run in runs.items():
        open_ = None
        for module, strategy in run:
            if strategy == "colwise":
                open_ = module
            elif open_ is None:
                return (f"module {module} is rowwise with no column-parallel Linear before it in block {block}; "
                        f"{target} splits a block's input projections by columns and the one after them by rows")
            else:
                open_ = None
        if open_ is not None:
            return (f"block {block} ends on column-parallel {open_}; {target} ends each pair of split Linears on a "
                    "row-parallel one")
    return None


def require_language_model(facts: ModelFacts | None, target: str) -> None:
    """Megatron-LM and torchtitan train transformer language models: refuse a model without a token embedding."""
    if facts is not None and not facts.embeddings:
        raise PlanError(f"cannot export to {target}: {facts.path} has no token embedding (nn.Embedding), and "
                        f"{target} trains transformer language models; run this plan with shardwise's executor "
                        "(executor.apply_plan) or export to deepspeed/accelerate")


def recompute_count(plan: Plan, facts: ModelFacts | None, target: str, uniform: bool) -> int | None:
    """The plan's full recomputation of the first blocks of each stage as `target` can run it: None when it covers
    every block (or the blocks are unknown); with `uniform` (one count for every stage: Megatron-LM's block
    method, DeepSpeed's single stage) that count. PlanError when the target would recompute more blocks than
    planned (torchtitan and Accelerate wrap every block)."""
    if plan.recompute != "full" or not plan.recompute_blocks:
        return None
    counts, _ = stage_blocks(plan, facts)
    if not any(counts):
        return max(plan.recompute_blocks) if uniform else None
    planned = [min(r, c) for r, c in zip(plan.recompute_blocks, counts)]
    if planned == counts:
        return None
    n = max(planned)
    if uniform and all(min(n, c) == r for r, c in zip(planned, counts)):
        return n
    ran = f"the first {n} of every stage" if uniform else "every block"
    raise PlanError(f"cannot export to {target}: the plan recomputes the first {planned} blocks of its stages "
                    f"(of {counts}) and {target} would recompute {ran}, more compute than planned; re-plan with "
                    f"--force recompute=full,recompute_blocks={n if uniform else max(counts)} (the same count in "
                    "every stage)")


def check_stage_ranks(plan: Plan, target: str) -> None:
    """Both Megatron-LM and torchtitan run stage k on pipeline rank k % pp."""
    bad = [k for k, s in enumerate(plan.stages) if s.rank != k % plan.mesh.pp]
    if bad:
        raise PlanError(f"cannot export to {target}: stage {bad[0]} runs on pipeline rank "
                        f"{plan.stages[bad[0]].rank}, {target} runs stage k on rank k % pp; re-plan without "
                        "hand-placed stage ranks")
