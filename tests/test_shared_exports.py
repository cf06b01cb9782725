"""One torch.export per model structure within `executor.pipeline.shared_exports` (the dry run's pipeline ranks):
a later model of the same structure gets that export over its own tensors, never the first model's."""
import os

import pytest
import torch
import torch.nn as nn

from executor.graph_ops import unflatten
from executor.pipeline import _export, shared_exports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(nn.Module):
    def __init__(self, seed: int, width: int = 8, lifted: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(width, width)
        self.register_buffer("scale", torch.rand(width))  # persistent: in the export's state_dict
        self.register_buffer("shift", torch.rand(width), persistent=False)  # in the export's constants
        self.lifted = lifted

    def forward(self, x):
        y = self.lin(x) * self.scale + self.shift
        return y + torch.tensor(1.0) if self.lifted else y  # torch.tensor in forward: a lifted constant


@pytest.fixture
def exports(monkeypatch):
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def test_a_model_like_one_exported_reuses_the_export_over_its_own_tensors(exports):
    x = torch.randn(2, 8)
    first, second = Net(0), Net(1)
    with shared_exports():
        roots = [unflatten(_export(m, (x,), {})) for m in (first, second)]
    assert exports == [first]  # the second model was not exported
    for root, model in zip(roots, (first, second)):
        assert torch.equal(root.lin.weight, model.lin.weight) and torch.equal(root.scale, model.scale)
        assert torch.equal(root.shift, model.shift)
        assert torch.allclose(root(x), model(x))
    assert not torch.equal(roots[1].lin.weight, first.lin.weight)


def test_another_structure_or_input_shape_or_a_lifted_constant_is_exported_afresh(exports):
    x = torch.randn(2, 8)
    with shared_exports():
        _export(Net(0), (x,), {})
        _export(Net(0, width=16), (torch.randn(2, 16),), {})  # other parameter shapes
        _export(Net(0), (torch.randn(3, 8),), {})  # other input shape
        lifted = [Net(0, lifted=True), Net(1, lifted=True)]
        roots = [unflatten(_export(m, (x,), {})) for m in lifted]
    assert len(exports) == 5  # the second lifted-constant model holds a constant of the first one's: exported
    assert torch.allclose(roots[1](x), lifted[1](x))


def test_outside_shared_exports_every_model_is_exported(exports):
    x = torch.randn(2, 8)
    _export(Net(0), (x,), {})
    _export(Net(1), (x,), {})
    assert len(exports) == 2


def test_a_pipelined_dry_run_exports_the_model_once(exports):
    """Llama at tp2 x pp2 with interleaving: every pipeline stage checked, one export."""
    from cost_model.model import CostModel
    from executor.dry_run import dry_run
    from hardware_profiles.load import load_cluster
    from planner.model_file import load_model_file
    from planner.search import search
    from planner.trace import trace_model
    cluster = load_cluster("cpu-local", nodes=2)
    mf = load_model_file(os.path.join(ROOT, "examples", "llama.py"))
    graph = trace_model(mf, progress=False)
    plan = search(graph, cluster, CostModel(cluster), batch_size=8, precision="fp32", top_k=1, model_path=mf.path,
                  forced={"tp": 2, "pp": 2, "schedule": "interleaved", "vp": 2}).best
    exports.clear()  # tracing exported the model too
    stages = []
    assert dry_run(plan, mf, on_stage=lambda s, n: stages.append((s, n))) == []
    assert stages == [(0, 4), (1, 4), (2, 4), (3, 4)] and len(exports) == 1
