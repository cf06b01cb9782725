"""The report's --top table and --explain, on a search over the fake cost model."""
import re

from planner.report import format_result, format_top
from planner.search import search
from test_search_fakes import FakeCostModel, fake_cluster, tiny_gpt


def test_top_table_and_explain():
    cluster = fake_cluster(nodes=1)
    res = search(tiny_gpt(4), cluster, FakeCostModel(cluster=cluster, default_time=1e-3), batch_size=16, top_k=3,
                 forced={"pp": 1})
    assert 1 <= len(res.candidates) <= 3 and res.best.predicted["step_time_s"] == res.best_prediction.step_time_s
    rows = format_top(res.candidates)  # a rich table, as plain text: header, rule, one row per candidate
    assert rows[0].split()[:3] == ["#", "mesh", "dpxtpxpp"] and len(rows) == len(res.candidates) + 2
    assert set(rows[1].strip()) == {"─"}
    cells = [re.split(r"\s{2,}", r.strip()) for r in rows[2:]]
    assert [c[0] for c in cells] == [str(i) for i in range(1, len(res.candidates) + 1)]
    assert cells[0][1] == f"{res.best.mesh.dp}x{res.best.mesh.tp}x1" and cells[0][2] == str(res.best.zero_stage)
    for c, (plan, pred) in zip(cells, res.candidates):
        assert len(c) == 11 and c[7] == f"{pred.step_time_s * 1e3:.2f} ms" and c[9] == f"{pred.mfu:.1%}"
    text = format_result(res, explain=True)
    assert "top " in text and "why this plan: the runner-up" in text and "memory per device: runner-up" in text
    assert "search: " in text


def _prediction(per_rank_gib):
    from cost_model.prediction import Prediction
    per_rank = tuple(int(g * 2**30) for g in per_rank_gib)
    return Prediction(step_time_s=1.0, breakdown={"compute_s": 1.0}, peak_memory_bytes=max(per_rank),
                      memory_per_device_bytes=per_rank, memory_breakdown={}, tflops_per_device=1.0, mfu=0.1,
                      fits=True)


def test_memory_line_names_a_peak_rank_beyond_those_listed():
    from planner.report import format_prediction
    # a 16-stage interleaved pipeline whose later ranks recompute fewer blocks and peak there (Llama-405B-shaped)
    deep = format_prediction(_prediction([46.5] + [24.7] * 9 + [70.7, 69.0, 67.2, 65.4, 63.7, 61.1]))
    line = next(l for l in deep if l.startswith("memory per device"))
    assert line.startswith("memory per device: 70.70 GiB peak (fits); per pipeline rank: 46.50 GiB, 24.70 GiB")
    assert line.endswith(" ... (peak: rank 10 of 16)")
    shallow = format_prediction(_prediction([3.0, 5.0, 4.0]))
    assert next(l for l in shallow if l.startswith("memory per device")).endswith("3.00 GiB, 5.00 GiB, 4.00 GiB")
