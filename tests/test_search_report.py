"""The report's --top table and --explain, on a search over the fake cost model."""
from planner.report import format_result, format_top
from planner.search import search
from test_search_fakes import FakeCostModel, fake_cluster, tiny_gpt


def test_top_table_and_explain():
    cluster = fake_cluster(nodes=1)
    res = search(tiny_gpt(4), cluster, FakeCostModel(cluster=cluster, default_time=1e-3), batch_size=16, top_k=3,
                 forced={"pp": 1})
    assert 1 <= len(res.candidates) <= 3 and res.best.predicted["step_time_s"] == res.best_prediction.step_time_s
    rows = format_top(res.candidates)
    assert rows[0].split()[:3] == ["#", "mesh", "dpxtpxpp"] and len(rows) == len(res.candidates) + 1
    assert rows[1].split()[1] == f"{res.best.mesh.dp}x{res.best.mesh.tp}x1"
    text = format_result(res, explain=True)
    assert "top " in text and "why this plan: the runner-up" in text and "memory per device: runner-up" in text
    assert "search: " in text
