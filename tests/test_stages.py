"""The pipeline-stage DP against a slow reference on random arrays, hand-computable cuts, and the pipeline lower
bounds the search prunes with against the simulator."""
import itertools

import numpy as np
import pytest

from planner.search.stages import (cut_stages, cut_stages_reference, inflight_microbatches, min_pipeline_bound,
                                   pipeline_bound)


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 11))
    s = int(rng.integers(1, n + 1))
    t, p, a = rng.uniform(0.1, 3, n), rng.uniform(0, 5, n), rng.uniform(0, 2, n)
    inflight = rng.integers(1, 4, size=s)
    limit = [np.inf, rng.uniform(3, 15)][seed % 2]
    got = cut_stages(t, p, a, s, limit, inflight)
    ref = cut_stages_reference(t, p, a, s, limit, inflight)
    assert (got is None) == (ref is None)
    if got is not None:
        assert got.bottleneck == pytest.approx(ref.bottleneck)
        assert max(got.stage_memory) <= limit
        assert got.bounds[0][0] == 0 and got.bounds[-1][1] == n
        assert all(b[0] == c[1] and b[1] > b[0] for b, c in zip(got.bounds[1:], got.bounds))


def test_hand_cut():
    # times 1,1,1,1,4 in two stages: [1,1,1,1] | [4] -> bottleneck 4
    cut = cut_stages([1, 1, 1, 1, 4], [0] * 5, [0] * 5, 2)
    assert cut.bounds == ((0, 4), (4, 5)) and cut.bottleneck == 4
    # memory: each layer 10 bytes, limit 25 -> at most 2 layers a stage; 5 layers cannot go in 2 stages
    assert cut_stages([1] * 5, [10] * 5, [0] * 5, 2, mem_limit=25) is None
    cut = cut_stages([1] * 5, [10] * 5, [0] * 5, 3, mem_limit=25)
    assert cut.bottleneck == 2 and max(cut.stage_memory) <= 25
    # in-flight activations weigh on early stages: first stage holds 3 micro-batches of 5-byte activations
    cut = cut_stages([1] * 4, [0] * 4, [5] * 4, 2, mem_limit=16, inflight=[3, 1])
    assert cut.bounds == ((0, 1), (1, 4))
    assert cut_stages([1], [0], [0], 2) is None


def test_even_tie_break():
    cut = cut_stages([1, 1, 1, 1], [0] * 4, [0] * 4, 2)
    assert cut.bounds == ((0, 2), (2, 4))


def test_inflight():
    assert list(inflight_microbatches("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert list(inflight_microbatches("1f1b", 4, 2)) == [2, 2, 2, 1]
    assert list(inflight_microbatches("gpipe", 2, 8)) == [8, 8]
    assert list(inflight_microbatches("interleaved", 2, 8, 2)) == [2, 1, 2, 1]


def _simulated_step(schedule, fwd, bwd, m):
    from cost_model.simulator import simulate
    return float(simulate(schedule, fwd, bwd, m, 0.0).rank_end().max())


@pytest.mark.parametrize("seed", range(30))
def test_pipeline_bound_never_exceeds_the_simulated_pipeline(seed):
    # the search prunes with this bound: it must hold for every schedule the simulator runs
    rng = np.random.default_rng(seed)
    pp = int(rng.integers(1, 6))
    schedule, v = [("gpipe", 1), ("1f1b", 1), ("interleaved", int(rng.integers(2, 4)))][seed % 3]
    if pp == 1:
        schedule, v = "1f1b", 1
    m = pp * int(rng.integers(1, 5)) if schedule == "interleaved" else int(rng.integers(1, 12))
    fwd, bwd = rng.uniform(0.1, 3, (pp, v)), rng.uniform(0.1, 6, (pp, v))
    stage_times = [fwd[k % pp, k // pp] + bwd[k % pp, k // pp] for k in range(pp * v)]
    bound = pipeline_bound(stage_times, pp, m)
    assert bound <= _simulated_step(schedule, fwd, bwd, m) * (1 + 1e-12)
    if pp == 1:
        assert bound == pytest.approx(m * stage_times[0])


def test_pipeline_bound_with_the_bottleneck_first():
    # stage 0 takes 10 s (5 + 5), stage 1 1 s, 4 micro-batches of 1F1B: stage 1's work hides behind stage 0's,
    # the step is 4 x 10 = 40 s. The earlier bound sum_k T_k + (m - 1) max_k T_k = 41 s claimed more than that.
    fwd, bwd = np.array([[5.0], [0.5]]), np.array([[5.0], [0.5]])
    assert _simulated_step("1f1b", fwd, bwd, 4) == pytest.approx(40.0)
    assert pipeline_bound([10.0, 1.0], 2, 4) == pytest.approx(40.0)
    assert pipeline_bound([1.0, 10.0], 2, 4) == pytest.approx(41.0)  # bottleneck last: 1 + 4 x 10
    assert _simulated_step("1f1b", fwd[::-1], bwd[::-1], 4) == pytest.approx(41.0)


@pytest.mark.parametrize("seed", range(20))
def test_min_pipeline_bound_is_the_minimum_over_cuts(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 9))
    pp, m = int(rng.integers(1, n + 1)), int(rng.integers(1, 9))
    t = rng.uniform(0.1, 3, n)
    brute = min(pipeline_bound([t[i:j].sum() for i, j in zip((0,) + cuts, cuts + (n,))], pp, m)
                for cuts in itertools.combinations(range(1, n), pp - 1))
    assert min_pipeline_bound(t, pp, m) == pytest.approx(brute)
    assert min_pipeline_bound(t, n + 1, m) == np.inf


def test_every_stage_holds_parameters():
    # an MLP's layers: Linear, ReLU, Linear, ReLU, Linear; four stages would leave a ReLU alone in one (an optimizer
    # over no parameters, which torch refuses): the cut keeps a Linear in each, and five stages do not fit
    param = [10, 0, 10, 0, 10]
    cut = cut_stages([1, 1, 1, 1, 1], param, [0] * 5, 3)
    assert all(sum(param[i:j]) > 0 for i, j in cut.bounds)
    assert cut_stages([1] * 5, param, [0] * 5, 4) is None
    assert cut_stages_reference([1] * 5, param, [0] * 5, 4) is None
    assert cut.bounds == cut_stages_reference([1, 1, 1, 1, 1], param, [0] * 5, 3).bounds


def test_stages_start_only_where_allowed():
    """`cuttable`: no stage starts at a forbidden layer, and the DP's answer is the reference's over the cuts
    allowed."""
    t, p, a = [1.0, 1.0, 1.0, 1.0, 1.0], [1.0] * 5, [0.0] * 5
    assert cut_stages(t, p, a, 2).bottleneck == 3.0
    allowed = (True, False, False, False, True, True)
    assert cut_stages(t, p, a, 2, cuttable=allowed).bounds == ((0, 4), (4, 5))
    assert cut_stages(t, p, a, 3, cuttable=allowed) is None  # one place left to start a stage
    allowed = (True, True, False, True, True, True)
    assert cut_stages(t, p, a, 3, cuttable=allowed).bounds == ((0, 1), (1, 3), (3, 5))


REUSED_DROPOUT = '''
import torch, torch.nn as nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.emb = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        return self.head(self.drop(self.mid(self.drop(self.emb(x)))))

def build_model():
    return M()

def sample_batch(b):
    x = torch.randint(0, 32, (b, 8))
    return x, x
'''


def test_a_module_called_twice_stays_in_one_stage(tmp_path):
    """One dropout applied after the embedding and again before the head: no stage boundary falls between its
    two calls (the stages would both list it, a plan the executor refuses), in the search and in the default."""
    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.defaults import even_stages
    from planner.model_file import load_model_file
    from planner.search import search
    from planner.trace import trace_model
    path = tmp_path / "reused.py"
    path.write_text(REUSED_DROPOUT)
    mf = load_model_file(str(path))
    graph = trace_model(mf, batch_size=2, progress=False)
    mods = [graph.layer_modules(l) for l in graph.layers()]
    calls = [k for k, m in enumerate(mods) if m == ["drop"]]
    assert len(calls) == 2
    assert not any(graph.cut_points[calls[0] + 1:calls[1] + 1]) and graph.cut_points[calls[0]]
    for stages in (even_stages(graph, 2),):
        assert sum("drop" in s.modules for s in stages) == 1, stages
    cluster = load_cluster("cpu-local")
    result = search(graph, cluster, CostModel(cluster), batch_size=4, precision="fp32",
                    forced={"pp": 2, "mbs": 2}, top_k=3, model_path=mf.path)
    for plan, _ in result.candidates:
        assert sum("drop" in s.modules for s in plan.stages) == 1, plan.stages
    # a pp the cut points cannot give is refused naming the module, not after a search that built nothing (before:
    # "no candidate plan could be built ... relax --force")
    most = 1 + sum(graph.cut_points[1:len(mods)])
    assert most == len(mods) - (calls[1] - calls[0]) < 8
    from planner.errors import PlanError
    node = load_cluster("dgx-h100")  # 8 devices: pp=8 divides them
    with pytest.raises(PlanError, match=rf"^--force pp=8: of the model's {len(mods)} layers .* only {most} can "
                                        rf"start a stage, .*\(drop is called in layers {calls[0]} and {calls[1]}\), so "
                                        rf"at most pp={most} \(or give each place a module of its own"):
        search(graph, node, CostModel(node), batch_size=8, precision="fp32", forced={"pp": 8}, model_path=mf.path)
