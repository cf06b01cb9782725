"""The runner's helpers that put a batch on the model's device and build its default optimizer."""
from __future__ import annotations

from collections import namedtuple

import torch

import pytest

from executor.errors import ExecutorError
from executor.batches import batch_len as _batch_len, slice_batch as _slice, to_device as _to
from executor.runner import Runner, default_optimizer


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


def test_batches_slice_their_tensors_and_pass_other_values_on():
    # a float keyword argument failed the dp slicing ("'float' object is not iterable"); namedtuples lost their type
    Pair = namedtuple("Pair", "ids mask")
    batch = ({"scale": 2.0, "x": torch.arange(8).reshape(4, 2)}, Pair(torch.arange(4), None))
    assert _batch_len(batch) == 4 and _batch_len({"flag": True, "x": torch.zeros(6, 1)}) == 6
    part = _slice(batch, 1, 2)
    assert part[0]["scale"] == 2.0 and part[0]["x"].tolist() == [[2, 3], [4, 5]]
    assert isinstance(part[1], Pair) and part[1].ids.tolist() == [1, 2] and part[1].mask is None
    with pytest.raises(ExecutorError, match="holds no tensor"):
        _batch_len({"scale": 2.0})


def test_pipeline_stages_refuse_inputs_that_are_not_tensors():
    runner = Runner.__new__(Runner)  # only what stage_args reads
    runner.flat_inputs = True
    assert len(runner.stage_args({"x": torch.zeros(2), "y": torch.ones(2)})) == 2
    with pytest.raises(ExecutorError, match=r"tensors only.*a float \(2.0\).*or use pp=1"):
        runner.stage_args({"x": torch.zeros(2), "scale": 2.0})


def test_checkpoint_extra_needs_state_dict_and_load_state_dict():
    import torch

    from executor.checkpoint import _extra
    from executor.errors import ExecutorError
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert _extra({"scheduler": sched}) == {"extra/scheduler": sched}
    with pytest.raises(ExecutorError, match=r"^checkpoint extra\['epoch'\] is a int, which has no state_dict\(\)"):
        _extra({"epoch": 3})


def test_default_loss_counts_the_global_batchs_targets():
    """Runner._token_scale: None without padding or with a loss of one's own; dp x micro-batches over the global
    batch's counted targets with padding; nan when none is counted (one process's 0/0)."""
    import math

    from planner.model_file import default_loss
    from planner.plan import Mesh, Plan
    runner = Runner.__new__(Runner)  # only what _token_scale reads
    runner.plan = Plan(mesh=Mesh(dp=1), global_batch_size=4, microbatch_size=2, num_microbatches=2)
    runner.device, runner.loss_fn = torch.device("cpu"), default_loss
    x, y = torch.zeros(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long)
    assert runner._token_scale(x, y) is None
    y[0, 1:] = -100  # 10 of 12 counted, 2 micro-batches
    assert runner._token_scale(x, y) == 2 / 10
    runner.loss_fn = lambda out, tgt: default_loss(out, tgt)
    assert runner._token_scale(x, y) is None
    runner.loss_fn = default_loss
    assert math.isnan(runner._token_scale(x, torch.full_like(y, -100)))


def test_default_loss_takes_any_integer_targets():
    from planner.model_file import default_loss, summed_cross_entropy
    logits, ids = torch.randn(2, 3, 5), torch.tensor([[1, 4, 0], [2, -100, 3]])
    # int32 ids raised in F.cross_entropy (int64 or uint8 only)
    assert torch.equal(default_loss(logits, ids.int()), default_loss(logits, ids))
    assert torch.equal(summed_cross_entropy(logits, ids.short()), summed_cross_entropy(logits, ids))


def test_a_damaged_or_foreign_checkpoint_is_one_line(tmp_path):
    """A truncated .metadata raised pickle's UnpicklingError as a traceback on every rank; a checkpoint of another
    model said only DCP's 'CheckpointException ranks:dict_keys([0, 1])'."""
    import torch.distributed.checkpoint as dcp

    from executor.checkpoint import _model_mismatch, _rank_failure, saved_metadata
    folder = tmp_path / "ckpt"
    dcp.save({"model/w": torch.zeros(3, 4), "model/b": torch.zeros(4)}, checkpoint_id=str(folder))
    saved = saved_metadata(str(folder))
    assert _model_mismatch(saved, {"model/w": torch.ones(3, 4), "optim/w/exp_avg": torch.ones(1)}) == ""
    assert _model_mismatch(saved, {"model/w": torch.ones(4, 4)}) == "parameter 'w' is (3, 4) there and (4, 4) here"
    assert _model_mismatch(saved, {"model/v": torch.ones(1)}) == "the checkpoint has no parameter 'v'"
    meta = folder / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(ExecutorError, match=r"ckpt: its \.metadata cannot be read \(UnpicklingError: .*\); the "
                                            r"checkpoint is damaged or was not written by runner\.save\(\)$"):
        saved_metadata(str(folder))
    from torch.distributed.checkpoint.api import CheckpointException
    inner = ValueError("size mismatch for w")
    assert _rank_failure(CheckpointException("ranks", {1: (inner, None), 0: (KeyError("k"), None)})).args == ("k",)
    assert _rank_failure(inner) is inner


def test_a_checkpoint_is_swapped_in_whole(tmp_path):
    """Runner.save writes FOLDER.saving and renames it over FOLDER (DCP alone overwrote the old files in place)."""
    from executor.checkpoint import swap_in
    folder, staging = tmp_path / "ckpt", tmp_path / "ckpt.saving"
    folder.mkdir()
    (folder / "old.distcp").write_text("old")
    staging.mkdir()
    (staging / "new.distcp").write_text("new")
    swap_in(str(staging), str(folder))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and [p.name for p in folder.iterdir()] == \
        ["new.distcp"]
    staging.mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExecutorError, match="file: exists and is not a folder"):
        swap_in(str(staging), str(tmp_path / "file"))
