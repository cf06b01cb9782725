"""Each tensor's dtype under the executor's autocast (cost_model.dtypes) and what it costs: an fp32 residual stream
from fp32 embeddings, a hand-written RMSNorm in fp32, a cast before each linear reading fp32, and FSDP2's bf16
parameters."""
import os

import pytest

from cost_model.work import op_work
from cost_model.dtypes import autocast_dtypes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llama():
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    return trace_model(load_model_file(os.path.join(ROOT, "examples", "llama.py")), batch_size=2, progress=False)


def _first(graph, target):
    return next(op for op in graph.ops if op.target == target)


def test_fp32_parameters_give_an_fp32_stream_and_a_cast_per_linear(llama):
    d = autocast_dtypes(llama, "bf16", "fp32")
    emb = _first(llama, "aten.embedding.default")
    assert d[emb.name].output == "fp32"  # autocast leaves embedding alone: the table's dtype
    pow_ = _first(llama, "aten.pow.Tensor_Scalar")
    mean = _first(llama, "aten.mean.dim")
    assert d[pow_.name].output == d[mean.name].output == "fp32"
    wq = llama.module_op("layers.0.attention.wq")
    assert d[wq.name].output == "bf16" and len(d[wq.name].casts) == 1  # the norm's fp32 output, cast per linear
    sdpa = _first(llama, "aten.scaled_dot_product_attention.default")
    assert d[sdpa.name].output == "bf16"
    # the residual add: the fp32 stream plus the bf16 attention output is fp32 (type promotion)
    add = next(op for op in llama.ops if op.kind == "elementwise" and op.target.startswith("aten.add")
               and op.module_path == "layers.0" and emb.name in op.inputs)
    assert d[add.name].output == "fp32"
    w = op_work(wq, None, 1, 1.0, "bf16", dtypes=d[wq.name])
    n = next(m for m in wq.input_meta if len(m.shape) == 3).numel
    assert w.cast_bytes == (n * 6,)  # read 4 bytes, write 2
    plain = op_work(wq, None, 1, 1.0, "bf16")
    assert plain.cast_bytes == () and w.fwd_bytes == plain.fwd_bytes


def test_fsdp2_bf16_parameters_keep_the_stream_bf16_and_norms_cast_up(llama):
    d = autocast_dtypes(llama, "bf16", "bf16")
    emb = _first(llama, "aten.embedding.default")
    pow_ = _first(llama, "aten.pow.Tensor_Scalar")
    assert d[emb.name].output == "bf16"
    assert d[pow_.name].output == "fp32" and len(d[pow_.name].casts) == 1  # pow runs in fp32: a cast up
    w = op_work(pow_, None, 1, 1.0, "bf16", dtypes=d[pow_.name])
    n = pow_.output_meta[0].numel
    assert w.cast_bytes == (n * 6,) and w.fwd_bytes == pytest.approx(n * 8)  # fp32 in and out


def test_fp32_plans_have_no_autocast(llama):
    assert autocast_dtypes(llama, "fp32", "fp32") == {}


def test_an_fp32_stream_costs_more_time_and_memory_than_the_bf16_one(llama):
    """The same Llama step on one GPU: plain autocast (fp32 parameters, fp32 stream, casts) is slower and keeps
    more activation memory than pricing every activation at bf16 would."""
    from cost_model.layers import LayerCoster
    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.defaults import default_plan
    cl = load_cluster("dgx-h100")
    plan = default_plan(llama, cl, 8, "bf16", {"dp": 8, "tp": 1, "pp": 1, "zero": 0, "mbs": 1}, "llama.py")
    cm = CostModel(cl)
    block = next(layer for layer in llama.layers() if layer.block_type)
    real = LayerCoster(cm, llama, plan, cm.tp_group(1))
    flat = LayerCoster(cm, llama, plan, cm.tp_group(1))
    flat.dtypes = {}
    a, b = real.cost(block), flat.cost(block)
    assert a.fwd_compute > b.fwd_compute and a.bwd_compute > b.bwd_compute
    assert a.act_bytes > b.act_bytes


def test_each_linear_keeps_its_own_cast_of_a_shared_fp32_input(llama):
    """wq, wk and wv read the RMSNorm's fp32 output; autocast caches casts of parameters only, so each casts it and
    saves its own bf16 copy for backward: three copies at tp=1 where the trace lists the tensor once (at wq); at tp=2
    the executor casts once before the redistribution, for all three (executor.tp), so one copy."""
    from cost_model.layers import LayerCoster
    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from dataclasses import replace
    from planner.defaults import default_plan
    wq, wk, wv = (llama.module_op(f"layers.0.attention.{w}") for w in ("wq", "wk", "wv"))
    assert wq.saved and not wk.saved and not wv.saved and wk.saved_elsewhere == wv.saved_elsewhere == (0,)
    hidden = replace(llama, ops=tuple(replace(op, saved_elsewhere=()) for op in llama.ops))  # what was priced before
    cl = load_cluster("dgx-h100")
    cm = CostModel(cl)
    copy = wk.input_meta[0].numel / llama.batch_size * 2  # one bf16 copy for a micro-batch of 1
    extra = {}
    for tp in (1, 2):
        plan = default_plan(llama, cl, 8, "bf16", {"dp": 8 // tp, "tp": tp, "pp": 1, "zero": 0, "mbs": 1}, "llama.py")
        act = [LayerCoster(cm, g, plan, cm.tp_group(tp)).cost(next(x for x in g.layers() if x.block_type)).act_bytes
               for g in (llama, hidden)]
        extra[tp] = (act[0] - act[1]) / copy
    # tp=1: wk and wv's copies of the attention norm's output, w3's of the FFN norm's (w1 saved it first)
    assert extra == {1: pytest.approx(3), 2: 0}


def test_layers_count_the_weight_copies_autocast_makes(llama):
    """bf16 with fp32 parameters: each linear's weight is cast to a 16-bit copy (not the embedding's: autocast leaves
    embedding alone, nor the norms' weights, multiplied in fp32); FSDP2's bf16 parameters need none; a block under
    full recomputation is marked checkpointed (it keeps no copy for backward)."""
    from cost_model.layers import LayerCoster
    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.defaults import default_plan
    cl = load_cluster("dgx-h100")
    cm = CostModel(cl)
    layers = llama.layers()
    block = next(layer for layer in layers if layer.block_type)
    linear = sum(p.numel for i in block.ops for p in llama.ops[i].params if llama.ops[i].kind == "linear")
    for zero, recompute, want in ((0, "none", 2 * linear), (1, "none", 0.0), (0, "full", 2 * linear)):
        plan = default_plan(llama, cl, 8, "bf16", {"dp": 8, "tp": 1, "pp": 1, "zero": zero, "mbs": 1,
                                                   "recompute": recompute}, "llama.py")
        coster = LayerCoster(cm, llama, plan, cm.tp_group(1))
        c = coster.cost(block)
        assert c.cast_weight_bytes == want and c.checkpointed == (recompute == "full")
        assert coster.cost(layers[0]).cast_weight_bytes == 0  # the token embedding


def test_gradients_of_a_tensor_read_several_times_are_summed_in_backward(llama):
    """Autograd adds the gradients of a tensor several ops read: the RMSNorm's output read by wq, wk and wv gets
    two adds, the block's input (read by the norm's pow and mul and by the residual add) two, a chunked tensor's
    pieces none (its backward joins them); each add reads two gradients and writes one."""
    from cost_model.backward import extra_reads
    from cost_model.layers import LayerCoster
    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.defaults import default_plan
    extra = extra_reads(llama)
    norm_out = llama.module_op("layers.0.attention.wq").inputs[0]
    assert extra[norm_out] == 2
    assert extra[llama.module_op("tok_embeddings").name] == 2
    assert not any(llama.op(n).target.startswith(("aten.chunk", "aten.split")) for n in extra)
    cl = load_cluster("dgx-h100")
    plan = default_plan(llama, cl, 8, "bf16", {"dp": 8, "tp": 1, "pp": 1, "zero": 0, "mbs": 1}, "llama.py")
    cm = CostModel(cl)
    coster = LayerCoster(cm, llama, plan, cm.tp_group(1))
    op = llama.op(norm_out)
    kernel, host = coster._gradient_sums(op, None)
    size = op.output_meta[0].numel / llama.batch_size * 4  # fp32 under autocast with fp32 parameters
    assert kernel == pytest.approx(2 * max(cm.compute.memory_time(3 * size), cl.device.kernel_floor))
    assert host == pytest.approx(2 * cl.device.op_overhead.backward)


def _block_ops(graph, target, block="layers.0"):
    return [op for op in graph.ops if op.target == target and op.block == block]


def test_elementwise_backward_counts_each_input_gradient(llama):
    """Backward bytes of elementwise ops per input that needs a gradient (PyTorch's derivative formulas): a
    residual add of two fp32 tensors passes the gradient on (no kernel), one of a bf16 branch converts it; the
    RMSNorm's x * rsqrt(...) multiplies for both operands and sums the broadcast one down; RoPE's q * cos has one
    gradient (the table needs none); pow runs three kernels."""
    from cost_model.compute import ComputeModel
    from cost_model.backward import input_grads
    from hardware_profiles.load import load_cluster
    d = autocast_dtypes(llama, "bf16", "fp32")
    grads = input_grads(llama)
    cm = ComputeModel(load_cluster("dgx-h100").device)
    emb = _first(llama, "aten.embedding.default")

    def work(op):
        return op_work(op, None, 1, 1.0, "bf16", dtypes=d[op.name], grads=grads[op.name])

    residual = next(op for op in _block_ops(llama, "aten.add.Tensor") if emb.name in op.inputs)
    n = residual.output_meta[0].numel
    assert grads[residual.name] == (True, True)
    assert work(residual).bwd_bytes == n * (4 + 2)  # the bf16 branch's gradient converted down; the stream's passed
    assert work(residual).fwd_bytes == n * (4 + 2 + 4)
    rope_add = [op for op in _block_ops(llama, "aten.add.Tensor") if len(op.input_meta[0].shape) == 4][0]
    assert work(rope_add).bwd_bytes == 0  # fp32 + fp32: both gradients passed on
    k, b = cm.op_parts("elementwise", work(rope_add), "bf16")[:2]
    assert b == 0 and k > 0  # no backward kernel, not even the launch floor

    norm_mul = next(op for op in _block_ops(llama, "aten.mul.Tensor") if op.input_meta[1].shape[-1] == 1)
    x, r = norm_mul.input_meta
    assert grads[norm_mul.name] == (True, True)
    # x: grad * r (read n and the rows, write n); r: grad * x (read 2n, write n), then a sum down to the rows
    assert work(norm_mul).bwd_bytes == 4 * ((n + r.numel + n) + (n + n + n) + (n + r.numel))
    rope_mul = next(op for op in _block_ops(llama, "aten.mul.Tensor") if len(op.input_meta[0].shape) == 4)
    q, cos = rope_mul.input_meta
    assert grads[rope_mul.name] == (True, False)  # cos is sliced from a buffer
    # q is bf16 (a linear's output) times an fp32 table: the product in fp32, then converted to q's bf16
    assert work(rope_mul).bwd_bytes == (4 * q.numel + 4 * cos.numel + 4 * q.numel) + q.numel * (4 + 2)
    pow_ = _block_ops(llama, "aten.pow.Tensor_Scalar")[0]
    assert work(pow_).bwd_bytes == 7 * pow_.output_meta[0].numel * 4
    # without the graph's gradient flow, every floating input made by a graph op counts
    assert op_work(rope_mul, None, 1, 1.0, "bf16", dtypes=d[rope_mul.name]).bwd_bytes > work(rope_mul).bwd_bytes


def test_widening_casts_run_at_the_measured_conversion_rate(llama):
    """Autocast's cast before a linear narrows fp32 to bf16 in forward and widens the gradient in backward; a
    widening conversion costs at least the profile's `widen` seconds per element (dgx-h100: the H100's unrolled
    copy kernel), a narrowing one the copy rate."""
    from cost_model.compute import ComputeModel
    from hardware_profiles.load import load_cluster
    dev = load_cluster("dgx-h100").device
    cm = ComputeModel(dev)
    d = autocast_dtypes(llama, "bf16", "fp32")
    wq = llama.module_op("layers.0.attention.wq")
    w = op_work(wq, None, 1, 512.0, "bf16", dtypes=d[wq.name])
    assert w.cast_widens == (False,)
    (c,) = w.cast_bytes
    assert cm.cast_time(c, True) == pytest.approx(c / 6 * dev.kernel_costs["widen"][0])
    assert cm.cast_time(c, True) > cm.cast_time(c, False) == pytest.approx(cm.memory_time(c))
    f, b, _, _ = cm.op_parts("linear", w, "bf16")
    plain_f, plain_b, _, _ = cm.op_parts("linear", op_work(wq, None, 1, 512.0, "bf16"), "bf16")
    assert f - plain_f == pytest.approx(cm.cast_time(c, False))
    assert b - plain_b == pytest.approx(cm.cast_time(c, True))
    up = autocast_dtypes(llama, "bf16", "bf16")  # FSDP2's bf16 parameters: the norm's pow casts its input up
    pow_ = _first(llama, "aten.pow.Tensor_Scalar")
    assert op_work(pow_, None, 1, 1.0, "bf16", dtypes=up[pow_.name]).cast_widens == (True,)


def test_cpu_autocast_keeps_norms_and_pow_in_the_input_dtype(llama):
    """torch.autocast("cpu") has no norm, softmax or pow on its fp32 list (losses and prod only): with bf16
    parameters (FSDP2 on CPU ranks) a hand-written RMSNorm runs in bf16 there, where CUDA's autocast runs it in
    fp32; the loss is fp32 on both."""
    import torch
    from cost_model.model import op_precision
    gpu, cpu = autocast_dtypes(llama, "bf16", "bf16"), autocast_dtypes(llama, "bf16", "bf16", cpu=True)
    pow_ = _first(llama, "aten.pow.Tensor_Scalar")
    loss = next(op for op in llama.ops if op.kind == "loss")
    assert gpu[pow_.name].output == "fp32" and cpu[pow_.name].output == "bf16"
    assert gpu[loss.name].output == cpu[loss.name].output == "fp32"
    assert op_precision("norm", "bf16", cpu=True) == "bf16" and op_precision("loss", "bf16", cpu=True) == "fp32"
    x = torch.randn(4, 8, dtype=torch.bfloat16)  # what the lists stand for, on this torch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert x.pow(2).dtype == torch.nn.functional.layer_norm(x, (8,)).dtype == torch.bfloat16
        assert torch.nn.functional.cross_entropy(x, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
