"""The plan format round-trips through JSON and rejects inconsistent or unknown fields."""

import pytest

from planner.errors import PlanError
from planner.plan import Mesh, OpPlacement, Plan, StageSpec


def _plan(**kw):
    base = dict(mesh=Mesh(dp=2, tp=2, pp=2), zero_stage=1, sequence_parallel=True, recompute="selective",
                schedule="interleaved", virtual_stages=2, global_batch_size=16, microbatch_size=2,
                num_microbatches=4, precision="bf16",
                stages=tuple(StageSpec(start_layer=i, end_layer=i + 1, rank=i % 2) for i in range(4)),
                ops={"linear": OpPlacement(strategy="colwise", module="h.0.mlp.c_fc", inputs=("R",),
                                           output="S(2)", params=("S(0)", "S(0)"))})
    base.update(kw)
    return Plan(**base)


def test_round_trip(tmp_path):
    p = _plan()
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.load(path) == p


def test_batch_arithmetic_is_checked():
    with pytest.raises(PlanError, match="global_batch_size"):
        _plan(global_batch_size=17)


def test_unknown_key_names_the_field():
    d = _plan().to_dict()
    d["mesh"]["cp"] = 2
    with pytest.raises(PlanError, match=r"^plan: mesh: unknown key 'cp' \(known: dp, pp, tp\)$"):
        Plan.from_dict(d)


def test_bad_json_is_one_clear_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(path)


def test_virtual_stages_need_interleaved():
    with pytest.raises(PlanError, match="interleaved"):
        _plan(schedule="1f1b")


def test_recompute_blocks_round_trip_and_checks(tmp_path):
    p = _plan(recompute="full", recompute_blocks=(2, 1, 1, 0))
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.load(path) == p
    # the first blocks of each stage, or every block without counts
    stages = [["h.0", "h.1"], ["h.2"], ["h.3", "h.4"], ["h.5"]]
    assert p.recomputed_blocks(stages) == {"h.0", "h.1", "h.2", "h.3"}
    assert _plan(recompute="full").recomputed_blocks(stages) == {f"h.{i}" for i in range(6)}
    assert _plan().recomputed_blocks(stages) == set()
    # under selective the counted blocks run full recomputation and the rest selective; without counts none is full
    hybrid = _plan(recompute="selective", recompute_blocks=(1, 0, 1, 1))
    assert Plan.from_dict(hybrid.to_dict()) == hybrid
    assert hybrid.recomputed_blocks(stages) == {"h.0", "h.3", "h.5"}
    assert _plan(recompute="selective").recomputed_blocks(stages) == set()
    for bad, match in (({"recompute": "none", "recompute_blocks": (1, 1, 1, 1)},
                        "needs recompute 'full' or 'selective'"),
                       ({"recompute": "attention", "recompute_blocks": (1, 1, 1, 1)}, "got 'attention'"),
                       ({"recompute": "full", "recompute_blocks": (1, 1)}, "gives 2 counts, one per pipeline stage "
                                                                          "needs 4")):
        with pytest.raises(PlanError, match=match):
            _plan(**bad)
    d = p.to_dict()
    d["recompute_blocks"] = [1, -1, 0, 0]
    with pytest.raises(PlanError, match=r"recompute_blocks\[1\]"):
        Plan.from_dict(d)
