"""bf16 training holds bf16 compute parameters wherever the executor wraps the model in FSDP2 (`fully_shard` for
ZeRO >= 1, `replicate` for ZeRO-0 with tp or pp), and the cost model prices the dtypes that follow."""
import torch
import torch.nn as nn

from executor import parallel
from planner.plan import Mesh, Plan


def _plan(dp, tp, pp, zero, precision="bf16"):
    return Plan(mesh=Mesh(dp=dp, tp=tp, pp=pp), zero_stage=zero, precision=precision, global_batch_size=8,
                microbatch_size=1, num_microbatches=8 // dp)


def test_which_plans_compute_with_bf16_parameters():
    assert _plan(2, 1, 1, 1).fsdp_mixed_precision  # fully_shard
    assert _plan(2, 2, 1, 0).fsdp_mixed_precision and _plan(2, 1, 2, 0).fsdp_mixed_precision  # replicate
    assert _plan(1, 2, 1, 0).fsdp_mixed_precision and _plan(1, 1, 2, 0).fsdp_mixed_precision  # one-rank replicate
    assert not _plan(2, 1, 1, 0).fsdp_mixed_precision  # DDP: autocast over fp32 weights
    assert not _plan(1, 1, 1, 0).fsdp_mixed_precision  # one device: nothing wraps the model
    assert not _plan(2, 1, 2, 0, precision="fp32").fsdp_mixed_precision
    assert not _plan(1, 2, 1, 0, precision="fp32").fsdp_mixed_precision


def test_replicate_computes_with_bf16_weights_and_keeps_fp32_ones(one_rank_mesh):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    parallel.apply_ddp(model, one_rank_mesh, pipelined=True, mp_dtype=torch.bfloat16)
    model(torch.randn(2, 8)).float().sum().backward()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_replicate_without_mixed_precision_is_unchanged(one_rank_mesh):
    model = nn.Sequential(nn.Linear(8, 8))
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    parallel.apply_ddp(model, one_rank_mesh, pipelined=True)
    model(torch.randn(2, 8)).sum().backward()
    assert seen == [torch.float32]
