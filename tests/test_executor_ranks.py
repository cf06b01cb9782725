"""Rank program for tests/test_executor.py (not a test module itself): run under torchrun, it trains a small GPT
under many plans in ONE launch and writes, from rank 0, how far each run's losses and final parameters are from a
single-process run. Usage: torchrun --nproc-per-node N tests/test_executor_ranks.py SPECS.json OUT.json CKPT_DIR
"""
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

CFG = dict(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
GLOBAL_BATCH = 8
STEPS = 3
SAVED_LR = 0.025


def build():
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def batches(pad: bool = False):
    """`pad`: sample i of each batch has its last (5 i + step) % 17 targets padded (-100, which the default loss
    leaves out; a whole sample of them in the second step), so micro-batches and replicas count different numbers
    of targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        t = torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, CFG["block_size"] + 1), generator=g)
        x, y = t[:, :-1], t[:, 1:].clone()
        if pad:
            for i in range(GLOBAL_BATCH):
                n = (5 * i + step) % 17
                y[i, CFG["block_size"] - n:] = -100
        out.append((x, y))
    return out


def optimizer(params):
    # SGD with momentum: linear in the gradients, so fp32 reduction-order noise stays at 1e-7 (Adam's
    # normalisation would amplify it for near-zero gradients); the momentum buffer exercises optimizer-state
    # checkpointing.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss_fn(out, tgt):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def reference(clip: float = 0.0, skip: str = "", pad: bool = False):
    """One process's losses, final parameters and (with `clip`: torch's own clip_grad_norm_) gradient norms; `skip`:
    parameters whose name holds it are left out of the optimizer (their gradients accumulate, as torch's do);
    `pad`: padded batches under the default loss (the mean over the whole batch's counted targets)."""
    from planner.model_file import default_loss
    fn = default_loss if pad else loss_fn
    model = build()
    opt = optimizer([p for n, p in model.named_parameters() if not (skip and skip in n)])
    losses, norms, evals = [], [], []
    data = batches(pad)
    for x, y in data:
        loss = fn(model(x), y)
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        model.eval()
        with torch.no_grad():  # the loss on the first batch after each step, in eval mode (`Runner.evaluate`)
            evals.append(fn(model(data[0][0]), data[0][1]).item())
        model.train()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}, norms, evals


def make_plan(spec):
    from planner.plan import Mesh, OpPlacement, Plan
    dp, tp, pp, nmb = spec.get("dp", 1), spec.get("tp", 1), spec.get("pp", 1), spec.get("nmb", 1)
    layout = spec.get("layout", {})
    ops = {k: OpPlacement(**{f: tuple(v) if isinstance(v, list) else v for f, v in o.items()})
           for k, o in layout.get("ops", {}).items()}
    return Plan(mesh=Mesh(dp=dp, tp=tp, pp=pp), zero_stage=spec.get("zero", 0),
                sequence_parallel=spec.get("sp", False), schedule=spec.get("schedule", "1f1b"),
                virtual_stages=spec.get("vs", 1), recompute=spec.get("rc", "none"),
                recompute_blocks=tuple(spec.get("rcb", ())),
                global_batch_size=GLOBAL_BATCH, microbatch_size=GLOBAL_BATCH // (dp * nmb), num_microbatches=nmb,
                precision=spec.get("precision", "fp32"), max_grad_norm=spec.get("clip", 0.0), ops=ops,
                parameters=layout.get("parameters", {}))


def param_error(runner, ref):
    from torch.distributed.tensor import DTensor

    from executor.checkpoint import _modules
    err = 0.0
    for mod in _modules(runner):
        for name, p in mod.named_parameters(remove_duplicate=False):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            err = max(err, (full.detach() - ref[name]).abs().max().item())
    return err


def user_script(spec, ref_losses):
    """What a training script of one's own does with a Runner (spec "user"): an optimizer factory reading the model's
    own parameters (refused), one taking names, a loss returning a tuple (refused), a step that raises part-way (no
    gradient left behind: the next steps train the reference's losses), a frozen parameter through the
    memory-tracked steps, and ranks seeded apart (their random state is rank 0's after apply_plan)."""
    import torch.distributed as dist

    from executor import apply_plan
    from executor.errors import ExecutorError
    plan = make_plan(spec)
    data = batches()
    micro_batch = data[0][0][:plan.microbatch_size]
    out = {}
    model = build()
    try:
        apply_plan(model, plan, optimizer=lambda params: optimizer(model.parameters()), loss_fn=loss_fn,
                   example_inputs=micro_batch)
        out["foreign_refused"] = ""
    except ExecutorError as e:
        out["foreign_refused"] = str(e)
    seen = {}

    def named(params, names):
        seen["names"] = sorted(names)
        seen["aligned"] = all(isinstance(p, torch.nn.Parameter) for p in params) and len(params) == len(names)
        return optimizer(params)
    frozen = build()
    frozen.ln_f.weight.requires_grad_(False)
    runner = apply_plan(frozen, plan, optimizer=lambda params: optimizer([p for p in params if p.requires_grad]),
                        loss_fn=loss_fn, example_inputs=micro_batch)
    out["frozen_steps"] = len([runner.step(x, y) for x, y in data])  # the 2nd and 3rd under MemTracker
    short = apply_plan(build(), plan, optimizer=optimizer, loss_fn=loss_fn, example_inputs=micro_batch[:, :8])
    try:
        short.step(*data[0])
        out["short_refused"] = ""
    except ExecutorError as e:
        out["short_refused"] = str(e)
    apart = apply_plan(build(), plan, optimizer=optimizer, loss_fn=loss_fn, example_inputs=micro_batch)
    x, y = data[dist.get_rank() % len(data)]  # each rank its own batch (a DistributedSampler over every rank)
    try:
        apart.step(x, y)
        out["apart_refused"] = ""
    except ExecutorError as e:
        out["apart_refused"] = str(e)
    torch.manual_seed(100 + dist.get_rank())  # seeded apart
    runner = apply_plan(build(), plan, optimizer=named, loss_fn=loss_fn, example_inputs=micro_batch)
    state = torch.get_rng_state().double().sum().reshape(1)
    states = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(states, state)
    out["rng_same"] = len({s.item() for s in states}) == 1
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, seen["names"])
    out["names"] = sorted({n for names in every for n in names})
    out["model_names"] = sorted(n for n, _ in build().named_parameters())
    out["aligned"] = seen["aligned"]
    real = runner.loss_fn
    if plan.mesh.pp > 1:  # a loss that raises on the last stage leaves the first waiting: no step after it
        losses = [runner.step(x, y) for x, y in data]
        out["loss_err"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        return out
    runner.loss_fn = lambda o, t: (real(o, t), {"acc": 0.0})
    try:
        runner.step(*data[0])
        out["tuple_refused"] = ""
    except ExecutorError as e:
        out["tuple_refused"] = str(e)
    runner.loss_fn = real
    calls = [0]

    def fails_on_the_second(mod, args):  # the second micro-batch's forward raises after the first's backward
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("a bad batch")
    hook = runner.parts[0].register_forward_pre_hook(fails_on_the_second)
    try:
        runner.step(*data[0])
    except RuntimeError:
        pass
    hook.remove()
    out["grads_left"] = sum(p.grad is not None for part in runner.parts for p in part.parameters())
    losses = [runner.step(x, y) for x, y in data]  # the 2nd and 3rd steps run under MemTracker
    out["loss_err"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return out


def _share(runner, spec, x, y):
    """The global batch, or with spec "share" this dp replica's share of it (what a sharded data loader gives)."""
    if not spec.get("share"):
        return x, y
    dp = runner.plan.mesh.dp
    share, i = GLOBAL_BATCH // dp, runner.mesh["dp"].get_local_rank()
    return x[i * share:(i + 1) * share], y[i * share:(i + 1) * share]


def run_spec(spec, ref_losses, ref_params, ckpt, ref_evals=()):
    from torch.distributed.tensor import DTensor

    from executor import apply_plan
    if spec.get("user"):
        return user_script(spec, ref_losses)
    plan = make_plan(spec)
    data = batches(spec.get("pad", False))
    micro_batch = data[0][0][:plan.microbatch_size]  # tp exports the model with it
    skip = spec.get("skip", "")
    factory = (lambda params, names: optimizer([p for p, n in zip(params, names) if skip not in n])) if skip \
        else optimizer
    runner = apply_plan(build(), plan, optimizer=factory, loss_fn=None if spec.get("pad") else loss_fn,
                        example_inputs=micro_batch)  # padded: the default loss
    # a scheduler of the script's own, saved beside the model (Runner.save's extra); its factor 1 leaves the
    # reference's learning rate
    scheduler = torch.optim.lr_scheduler.LambdaLR(runner.optimizer, lambda step: 1.0)
    lr_loaded, wrong_key = None, ""
    if spec.get("load"):
        from executor.errors import ExecutorError
        try:
            runner.load(ckpt, extra={"sched": scheduler})  # a key the checkpoint does not have
        except ExecutorError as e:
            wrong_key = str(e)
        runner.load(ckpt, extra={"scheduler": scheduler})
        start = runner.step_count
        lr_loaded = runner.optimizer.param_groups[0]["lr"]  # the saving run's (SAVED_LR), not the factory's
        for g in runner.optimizer.param_groups:
            g["lr"] = 0.1  # the reference's, for the steps after
    else:
        start = 0
    scheduler_loaded = scheduler.last_epoch
    losses, gathers = [], []
    interpreted = _count_interpreter_runs()
    sent = [0]  # elements of the activations this rank's stages send in the last step

    def counting_sends(get):
        def ops(chunk):
            got = get(chunk)
            sent[0] += sum(op.tensor.numel() for op in got)
            return got
        return ops
    for st in getattr(runner, "stages", []):
        st.get_fwd_send_ops = counting_sends(st.get_fwd_send_ops)
    from executor import parallel
    plain_call, calls = parallel.recompute_call, [0]

    def counted(*args, **kwargs):  # SDPA calls re-run in backward (recompute: attention), counted at run time
        calls[0] += 1
        return plain_call(*args, **kwargs)
    parallel.recompute_call = counted
    evals, eval_modes = [], []
    watch = runner.parts[0].register_forward_pre_hook(lambda mod, args: eval_modes.append(mod.training))
    try:
        for x, y in data[start:spec.get("stop", STEPS)]:
            sent[0] = 0
            with _count_all_gathers() as n, interpreted:
                losses.append(runner.step(*_share(runner, spec, x, y)))
            scheduler.step()
            gathers.append(n[0])
            if ref_evals:  # between steps: the steps after it must still train the reference's losses
                eval_modes.clear()
                evals.append(runner.evaluate(*_share(runner, spec, *data[0])))
                evaluated_in = list(eval_modes)
    finally:
        parallel.recompute_call = plain_call
        watch.remove()
    out = {"loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses[start:])),
           "n_losses": len(losses), "start": start, "all_gathers_last_step": gathers[-1],
           "grad_norm": runner.grad_norm}
    if evals:
        out["eval_err"] = max(abs(a - b) for a, b in zip(evals, ref_evals[start:]))
        out["evaluated_in_train_mode"] = any(evaluated_in)
        out["train_mode_after"] = all(m.training for part in runner.parts for m in part.modules())
    # the dtype FSDP2 computes with (MixedPrecisionPolicy.param_dtype) where it wraps a part, and the dtypes kept
    from torch.distributed.fsdp import FSDPModule
    out["compute_dtypes"] = sorted({str(part._get_fsdp_state()._mp_policy.param_dtype) if isinstance(part, FSDPModule)
                                    else "unwrapped" for part in runner.parts})
    out["kept_dtypes"] = sorted({str(p.dtype) for part in runner.parts for p in part.parameters()})
    out["recomputed_sdpa_calls_per_step"] = calls[0] / len(losses)
    if not spec.get("stop"):
        out["param_err"] = param_error(runner, ref_params)
    if spec.get("save"):
        for g in runner.optimizer.param_groups:
            g["lr"] = SAVED_LR  # as a scheduler would have moved it
        runner.save(ckpt, extra={"scheduler": scheduler})
    out.update(scheduler_loaded=scheduler_loaded, lr_loaded=lr_loaded, wrong_key=wrong_key)
    mem = runner.memory_bytes()
    out["activations"] = mem["activations"]
    # parameter bytes live at the tracked peak against the rank's own (local shards): FSDP2's unsharded copies
    out["param_bytes_at_peak"] = mem["parameters"]
    out["local_param_bytes"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                                   for part in runner.parts for p in part.parameters())
    out["saved"] = mem["saved_activations"]
    out["report_ok"] = "step time" in runner.report(warmup=1)
    mods = dict(m for part in runner.parts for m in part.named_modules())
    norm = next((m for n, m in mods.items() if n.endswith("ln_1")), None)
    out["norm_is_dtensor"] = norm is not None and isinstance(norm.weight, DTensor)
    import torch.distributed as dist
    # unflattened modules of the subtrees that run on plain tensors run their generated code, not fx's Interpreter
    from executor import tp as tp_mod
    local = tp_mod.local_modules(plan, runner.parts[0]) if plan.mesh.tp > 1 and plan.mesh.pp == 1 else []
    local_mods = [m for path, m in runner.parts[0].named_modules()
                  if any(path == p or path.startswith(p + ".") for p in local)]
    out["local_modules"] = len(local_mods)
    out["local_interpreted"] = sum(bool(getattr(m, "_run_with_interpreter", False)) for m in local_mods)
    out["interpreter_runs"] = interpreted.runs
    # receive buffers still held between steps, and receive slots (executor.pipeline.RecvOnDemandStage)
    slots = [i for st in getattr(runner, "stages", []) for table in (st.args_recv_info, st.grad_recv_info)
             for infos in table.values() for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]
    held = torch.tensor([float(sum(i.buffer.numel() for i in slots)), float(len(slots))])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    out["recv_held"], out["recv_slots"] = held.tolist()
    # activation elements a stage sent per micro-batch, and the whole boundary tensor's (micro-batch x seq x C)
    most = torch.tensor([float(sent[0])])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    out["sent_per_microbatch"] = most.item() / plan.num_microbatches
    out["boundary_elems"] = plan.microbatch_size * CFG["block_size"] * CFG["n_embd"]
    flag = torch.tensor([float(runner.vocab_parallel_loss and not runner.gather_logits)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the loss runs on the last pipeline stage's ranks only
    out["vocab_parallel_loss"] = bool(flag.item())
    # the blocks activation checkpointing wrapped (executor.parallel.apply_ac), over every rank
    import functools

    from torch.utils.checkpoint import checkpoint
    wrapped = sorted(n for n, m in mods.items()
                     if isinstance(m.__dict__.get("forward"), functools.partial) and m.forward.func is checkpoint)
    selective = [n for n in wrapped if mods[n].forward.keywords.get("context_fn") is not None]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (wrapped, selective))
    out["checkpointed"] = sorted({n for names, _ in everyone for n in names})
    out["selective_checkpointed"] = sorted({n for _, names in everyone for n in names})
    return out


class _count_interpreter_runs:
    """Counts torch.fx.Interpreter runs (unflattened modules' default, the placed ops' former runner) while
    entered, over every entry."""

    def __init__(self):
        self.runs = 0

    def __enter__(self):
        import torch.fx
        self.original = torch.fx.Interpreter.run
        counter = self

        def run(interp, *args, **kwargs):
            counter.runs += 1
            return counter.original(interp, *args, **kwargs)
        torch.fx.Interpreter.run = run
        return self

    def __exit__(self, *exc):
        import torch.fx
        torch.fx.Interpreter.run = self.original


class _count_all_gathers:
    """Counts FSDP2's parameter all-gathers (`dist.all_gather_single`) on this rank inside the block."""

    def __enter__(self):
        import torch.distributed as dist
        self.orig, self.n = dist.all_gather_single, [0]

        def counting(*args, **kwargs):
            self.n[0] += 1
            return self.orig(*args, **kwargs)
        dist.all_gather_single = counting
        return self.n

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_gather_single = self.orig


def main():
    import torch.distributed as dist
    torch.set_num_threads(1)
    specs, out_path, ckpt = json.loads(open(sys.argv[1]).read()), sys.argv[2], sys.argv[3]
    refs = {key: reference(*key) for key in sorted({(s.get("clip", 0.0), s.get("skip", ""), s.get("pad", False))
                                                    for s in specs})}
    results = {"reference": {str(clip): {"losses": r[0], "norms": r[2]} for (clip, skip, pad), r in refs.items()
                             if not skip and not pad}}
    for spec in specs:
        ref_losses, ref_params, norms, ref_evals = refs[(spec.get("clip", 0.0), spec.get("skip", ""),
                                                         spec.get("pad", False))]
        results.setdefault("reference_norms", {})[spec["name"]] = norms
        t0 = time.perf_counter()
        try:
            results[spec["name"]] = run_spec(spec, ref_losses, ref_params, ckpt,
                                             () if spec.get("stop") else ref_evals)
            results[spec["name"]]["seconds"] = round(time.perf_counter() - t0, 2)  # where a launch's time goes
        except Exception as e:
            traceback.print_exc()
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}"}
            break
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
