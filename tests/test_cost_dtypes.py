"""Each tensor's dtype under the executor's autocast (cost_model.dtypes) and what it costs: an fp32 residual stream
from fp32 embeddings, a hand-written RMSNorm in fp32, a cast before each linear reading fp32, and FSDP2's bf16
parameters."""
import os

import pytest

from cost_model.compute import op_work
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


def test_gradients_of_a_tensor_read_several_times_are_summed_in_backward(llama):
    """Autograd adds the gradients of a tensor several ops read: the RMSNorm's output read by wq, wk and wv gets
    two adds, the block's input (read by the norm's pow and mul and by the residual add) two, a chunked tensor's
    pieces none (its backward joins them); each add reads two gradients and writes one."""
    from cost_model.layers import LayerCoster, extra_reads
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
