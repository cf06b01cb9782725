"""`plan --plot`, `plan --json` and the search's progress bar: every predicted candidate is recorded, the picture
is written (or one line says how to install matplotlib, before any search), the JSON report is the only thing on
stdout and matches the plan written with -o, and the progress bar shows only on a terminal after its delay."""
from __future__ import annotations

import io
import json
import math
import os
import sys
import time

import pytest

from planner.cli import main
from planner.search_plot import pareto_front
from planner.progress import SearchProgress
from planner.search import search
from test_search_fakes import FakeCostModel, fake_cluster, tiny_gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py")
PLAN_ARGS = [GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16"]


def _fake_search(**kw):
    cluster = fake_cluster(nodes=1, memory_bytes=80000)  # ZeRO-1 and less at mbs 1 do not fit this tiny device
    return search(tiny_gpt(4), cluster, FakeCostModel(cluster=cluster, default_time=1e-3), batch_size=16, **kw)


def test_every_predicted_candidate_is_recorded_fitting_or_not():
    res = _fake_search(top_k=3)
    ev = res.evaluated
    assert any(e.fits for e in ev) and any(not e.fits for e in ev)
    assert all(e.fits == (e.peak_memory_bytes <= 80000) for e in ev)
    assert len(ev) <= res.stats["predictions"]
    from planner.search.outer import candidate_label
    points = {(e.label, e.step_time_s, e.peak_memory_bytes) for e in ev}
    for plan, pred in res.candidates:  # the top k are among the recorded points, under the same label
        assert (candidate_label(plan), pred.step_time_s, pred.peak_memory_bytes) in points
    assert min(e.step_time_s for e in ev if e.fits) == res.best_prediction.step_time_s


def test_candidate_label():
    from planner.plan import Mesh, Plan
    from planner.search.outer import candidate_label
    p = Plan(mesh=Mesh(dp=64, tp=4, pp=4), zero_stage=1, schedule="interleaved", virtual_stages=4,
             global_batch_size=1536, microbatch_size=1, num_microbatches=24, sequence_parallel=True,
             recompute="selective")
    assert candidate_label(p) == "64x4x4 Z1 1x24 sel int4 sp"
    assert candidate_label(Plan(mesh=Mesh(dp=8), global_batch_size=16, microbatch_size=2, num_microbatches=1)) == \
        "8x1x1 Z0 2x1"


def test_pareto_front():
    pts = [(10, 5.0), (20, 3.0), (15, 6.0), (30, 3.0), (30, 2.0), (5, 9.0), (40, 2.5)]
    assert pareto_front(pts) == [(5, 9.0), (10, 5.0), (20, 3.0), (30, 2.0)]
    assert pareto_front([]) == []


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "search.png"
    out.write_bytes(b"old")
    assert main(PLAN_ARGS + ["--plot", str(out)]) == 0
    text = capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"wrote {out} (" in text and " candidates)" in text
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


@pytest.mark.parametrize("forced", [{}, {"dp": 8, "zero": 3, "mbs": 1, "recompute": "none"}])
def test_plot_of_a_search_with_misfits_or_a_single_candidate(tmp_path, forced):
    pytest.importorskip("matplotlib")
    from planner.search_plot import plot_search
    res = _fake_search(top_k=3, forced=forced)
    assert len(res.candidates) == (1 if forced else 3)
    for name in ("a.png", "b.svg"):
        plot_search(res, 80000, tmp_path / name, top_k=3, title="tiny")
        assert (tmp_path / name).stat().st_size > 5_000


def test_plot_without_matplotlib_is_one_line_before_the_search(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError

    def no_trace(*a, **k):
        raise AssertionError("traced before checking --plot")
    monkeypatch.setattr("planner.trace.trace_model", no_trace)
    out = tmp_path / "search.png"
    assert main(PLAN_ARGS + ["--plot", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'shardwise[plot]'" in err
    assert not out.exists()


def test_plot_needs_an_image_name(tmp_path, capsys):
    assert main(PLAN_ARGS + ["--plot", str(tmp_path / "search.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".png" in err


def test_json_report_is_stdout_alone_and_matches_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(PLAN_ARGS + ["--json", "--top", "3", "--explain", "-o", str(out)]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    written = json.loads(out.read_text())
    assert doc["plan"] == written
    pred = doc["prediction"]
    assert pred == written["predicted"]
    assert set(pred["breakdown"]) >= {"compute_s", "exposed_comm_s", "bubble_s", "optimizer_s"}
    assert pred["peak_memory_bytes"] > 0 and pred["memory_breakdown"]
    cands = doc["candidates"]
    assert 1 <= len(cands) <= 3 and [c["rank"] for c in cands] == list(range(1, len(cands) + 1))
    assert cands[0]["step_time_s"] == pred["step_time_s"] and cands[0]["mesh"] == written["mesh"]
    assert all(a["step_time_s"] <= b["step_time_s"] for a, b in zip(cands, cands[1:]))
    s = doc["search"]
    assert s["groups_evaluated"] >= 1 and s["predictions"] >= len(cands) and s["seconds"] >= 0
    assert doc["assumptions"] == pred["assumptions"] and isinstance(doc["notes"], list)
    assert doc["explain"][0].startswith("why this plan")
    assert f"wrote {out}" in cap.err


def test_a_model_file_that_prints_leaves_json_and_exports_on_stdout_alone(tmp_path, capsys):
    # its print went to stdout before the JSON report, or before a DeepSpeed config written to stdout
    chatty = tmp_path / "chatty.py"
    chatty.write_text(open(os.path.join(ROOT, "examples", "mlp.py")).read() + '\nprint("hello from the model file")\n')
    out = tmp_path / "p.json"
    assert main([str(chatty), "--cluster", "cpu-local", "--batch-size", "16", "--force", "pp=1", "--json", "-o",
                 str(out)]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["plan"] == json.loads(out.read_text()) and "hello from the model file" in cap.err
    assert main(["export", str(out), "--to", "deepspeed", "--model", str(chatty)]) == 0
    cap = capsys.readouterr()
    assert "hello" not in cap.out and json.loads(cap.out) and "hello from the model file" in cap.err


def test_json_and_summary_conflict(capsys):
    assert main(PLAN_ARGS + ["--json", "--summary"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def _terminal():
    from rich.console import Console
    buf = io.StringIO()
    return buf, Console(file=buf, force_terminal=True, width=100)


def test_progress_silent_when_not_a_terminal(capsys):
    _fake_search(progress=sys.stderr.isatty())
    assert capsys.readouterr().err == ""
    buf = io.StringIO()
    with SearchProgress(file=buf, delay_s=0) as bar:  # a StringIO is no terminal: nothing, even at once
        bar(1, 4, 0.5)
    assert bar.started is False and buf.getvalue() == ""


def test_progress_shows_groups_and_best_after_the_delay():
    buf, console = _terminal()
    with SearchProgress(show=True, delay_s=0, console=console) as bar:
        bar(0, 40, math.inf)
        bar(3, 40, 0.01234)
        console.file.flush()
        bar._bar.refresh()
        shown = buf.getvalue()
    assert bar.started and "3/40" in shown and "groups" in shown and "best: 12.34 ms/step" in shown


def test_progress_not_shown_for_a_short_search():
    buf, console = _terminal()
    with SearchProgress(show=True, delay_s=5.0, console=console) as bar:
        bar(1, 2, 0.5)
        time.sleep(0.05)
    assert not bar.started and buf.getvalue() == ""


def test_explain_compares_with_the_runner_up_whatever_top_shows(capsys):
    # --top 1 kept one candidate, and --explain then said the forced keys left a single one (none were forced)
    assert main(PLAN_ARGS + ["--top", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "why this plan: the runner-up" in out and "candidates:" not in out
    assert main(PLAN_ARGS + ["--top", "1", "--explain", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["candidates"]) == 1 and doc["explain"][0].startswith("why this plan: the runner-up")
