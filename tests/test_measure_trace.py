"""`plan measure --trace DIR` and `--plot FILE.png`: the measured step beside the predicted one, on the same tracks.

Most checks run without launching anything (a synthetic profiler trace, the predicted trace of a forced pp=2 plan);
one `plan measure` of a dp=2 small GPT on 2 CPU ranks (gloo) checks the files end to end.
"""
import json
import os
import subprocess
import sys

import pytest

from executor import trace
from shared import SMALL_GPT
from test_cli_plan_predict import validate_chrome_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"
MODEL = SMALL_GPT


def _tracks(doc):
    """{process id: {track name: [event names]}} of a Chrome trace."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            out.setdefault(e["pid"], {}).setdefault(names[(e["pid"], e["tid"])], []).append(e["name"])
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("trace") / "small_gpt.py"
    p.write_text(MODEL.format(examples=os.path.join(ROOT, "examples")))
    return p


def _plan(model, force, name):
    from planner.cli import main as plan_main
    out = model.parent / f"{name}.json"
    assert plan_main([str(model), "--cluster", "cpu-local", "--batch-size", "8", "--precision", "fp32",
                      "--force", force, "-o", str(out)]) == 0
    return out


def test_track_names_are_one_list():
    from cost_model.timeline import TRACKS
    assert trace.TRACKS == TRACKS == ("compute", "tp comm", "dp comm", "pp comm", "bubble", "optimizer")


def test_predicted_pipeline_trace_has_bubble_pp_and_optimizer_tracks(model):
    from planner.plan import Plan
    from planner.predicted_timeline import predicted_timeline
    plan = Plan.load(_plan(model, "pp=2,dp=1,tp=1,mbs=2,schedule=1f1b", "pp"))
    doc, note = predicted_timeline(plan, str(model))
    validate_chrome_trace(doc)
    assert note == ""
    tracks = _tracks(doc)
    assert set(tracks) == {0, 1}
    for pid in (0, 1):
        assert {"compute", "pp comm", "bubble", "optimizer"} <= set(tracks[pid]) <= set(trace.TRACKS)
        assert sorted(tracks[pid]["compute"]) == sorted(f"{k} mb{i}" for k in "FB" for i in range(4))
    assert tracks[1]["bubble"]  # the last stage waits for the first forward
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert max(e["ts"] + e["dur"] for e in spans) <= plan.predicted["step_time_s"] * 1e6 * (1 + 1e-9)


def test_predicted_zero3_trace_has_dp_comm(model):
    from planner.plan import Plan
    from planner.predicted_timeline import predicted_timeline
    doc, _ = predicted_timeline(Plan.load(_plan(model, "dp=2,tp=1,pp=1,zero=3,mbs=2", "z3")), str(model))
    tracks = _tracks(doc)[0]
    assert set(tracks) == {"compute", "dp comm", "optimizer"}
    assert sorted(tracks["dp comm"])[0] == "all-gather params B mb0"


def test_predicted_trace_from_a_profile_file_named_like_the_preset(model, tmp_path):
    """A measured CPU profile is named `cpu-local`, like the preset: without --cluster the preset stands in, and the
    note says so and names the fix, rather than suggesting the cost model changed."""
    import yaml
    from planner.cli import main as plan_main
    from planner.plan import Plan
    from planner.predicted_timeline import predicted_timeline
    prof = yaml.safe_load(open(os.path.join(ROOT, "hardware_profiles", "presets", "cpu-local.yaml")))
    prof["device"]["peak_flops"] = {k: v / 4 for k, v in prof["device"]["peak_flops"].items()}
    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump(prof))
    out = tmp_path / "slow.json"
    assert plan_main([str(model), "--cluster", str(mine), "--batch-size", "8", "--precision", "fp32",
                      "--force", "dp=2,tp=1,pp=1,mbs=4", "-o", str(out)]) == 0
    plan = Plan.load(out)
    _, note = predicted_timeline(plan, str(model))
    assert "the preset 'cpu-local'" in note and "pass --cluster FILE" in note
    assert predicted_timeline(plan, str(model), str(mine))[1] == ""


def _raw():
    """A torch.profiler-shaped trace: marker spans, two steps, passes, gloo work on worker threads."""
    def x(name, ts, dur, tid=1, cat="user_annotation"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 9, "tid": tid, "cat": cat}
    return {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 9, "tid": 1, "args": {"name": "python"}},
        x("shardwise group dp comm", 0, 100), x("gloo:all_reduce", 10, 5, tid=7), x("gloo:all_reduce", 12, 5, tid=8),
        x("shardwise step 2", 500, 400), x("F mb0", 510, 50), x("gloo:all_reduce", 520, 5, tid=7),
        x("shardwise step 3", 1000, 500), x("aten::mm", 1010, 30, cat="cpu_op"),
        x("F mb0", 1010, 100), x("gloo:all_gather", 1050, 20, tid=5), x("gloo:send", 1115, 20),
        x("B mb0", 1200, 150), x("gloo:all_reduce", 1300, 50, tid=8), x("Optimizer.step#AdamW.step", 1400, 70),
        x("Optimizer.zero_grad#AdamW.zero_grad", 1470, 10),
    ]}


def test_measured_trace_keeps_one_step_on_the_predicted_tracks():
    doc = trace.measured_trace(_raw(), 3, 1, pipelined=True, fallback="tp comm", label=" (pp 1)")
    validate_chrome_trace(doc)
    tracks = _tracks(doc)[3]
    assert tracks == {"compute": ["F mb0", "B mb0"], "tp comm": ["gloo:all_gather"], "pp comm": ["gloo:send"],
                      "dp comm": ["gloo:all_reduce"],
                      "optimizer": ["Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"],
                      "bubble": ["bubble", "bubble"]}
    spans = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert spans["F mb0"]["ts"] == 10 and spans["Optimizer.step#AdamW.step"]["ts"] == 400  # from the step's start
    assert doc["otherData"]["step_time_s"] == pytest.approx(500e-6)
    assert doc["otherData"]["unattributed_collectives"] == 1  # the all-gather on an unmarked thread
    assert any(e["args"]["name"] == "measured rank 3 (pp 1)" for e in doc["traceEvents"] if e["ph"] == "M")
    c = trace.categories(doc)
    assert c["compute_s"] == pytest.approx((100 + 150 - 20) * 1e-6)  # the tp collective inside F is not compute
    assert c["optimizer_s"] == pytest.approx(80e-6) and c["bubble_s"] == pytest.approx((10 + 90) * 1e-6)
    assert c["step_time_s"] == pytest.approx(480e-6)
    assert c["exposed_comm_s"] == pytest.approx(480e-6 - c["compute_s"] - c["optimizer_s"] - c["bubble_s"])


def test_align_puts_ranks_on_one_time_axis():
    raw = _raw()
    later = dict(raw, traceEvents=[dict(e, ts=e["ts"] + 300) if e["ph"] == "X" else e for e in raw["traceEvents"]])
    docs = [trace.measured_trace(dict(r, baseTimeNanoseconds=5), rank, 1, pipelined=False)
            for rank, r in ((0, raw), (1, later))]
    a, b = trace.align(docs)
    first = {d["otherData"]["rank"]: min(e["ts"] for e in d["traceEvents"] if e["ph"] == "X") for d in (a, b)}
    assert first == {0: 10, 1: 310} and b["otherData"]["step_offset_s"] == pytest.approx(300e-6)
    docs[1]["otherData"]["clock"] = 6  # another host's clock: left as it is
    assert trace.align(docs)[1]["traceEvents"] == docs[1]["traceEvents"]


@pytest.fixture(scope="module")
def measured(model):
    plan = _plan(model, "dp=2,tp=1,pp=1,zero=0,mbs=2", "dp")
    folder = model.parent / "trace"
    out, png = model.parent / "measured.json", model.parent / "bars.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "measure", str(plan), str(model), "--steps", "3",
                           "--warmup", "1", "--trace", str(folder), "--plot", str(png), "-o", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"dir": folder, "out": json.loads(out.read_text()), "png": png, "stdout": proc.stdout}


def test_measure_trace_writes_matching_predicted_and_measured_traces(measured):
    folder = measured["dir"]
    docs = {name: json.loads((folder / name).read_text())
            for name in ("predicted.json", "measured_rank0.json", "measured_rank1.json", "compare.json")}
    for doc in docs.values():
        validate_chrome_trace(doc)
    predicted = trace.track_names(docs["predicted.json"])
    assert predicted == {"compute", "dp comm", "optimizer"}
    for r in (0, 1):
        tracks = _tracks(docs[f"measured_rank{r}.json"])[r]
        assert set(tracks) == predicted
        assert sorted(tracks["compute"]) == ["B mb0", "B mb1", "F mb0", "F mb1"]
        assert all(n.startswith("gloo:") for n in tracks["dp comm"])
        assert docs[f"measured_rank{r}.json"]["otherData"]["unattributed_collectives"] == 0
    both = _tracks(docs["compare.json"])
    assert set(both) == {0, trace.MEASURED_PID, trace.MEASURED_PID + 1}
    assert (folder / "profiler_rank0.json").exists()
    assert (folder / "compare.png").read_bytes()[:8] == PNG


def test_measure_plot_and_categories(measured):
    assert measured["png"].read_bytes()[:8] == PNG
    t = measured["out"]["trace"]
    m, p = t["measured_categories"], t["predicted_categories"]
    assert m["compute_s"] > 0 and m["optimizer_s"] > 0 and m["bubble_s"] == 0
    assert sum(m[k] for k in ("compute_s", "exposed_comm_s", "optimizer_s")) == pytest.approx(m["step_time_s"])
    assert p["compute_s"] > 0 and "compare.json" in t["files"]
    assert any("torch.profiler" in n for n in measured["out"]["measured"]["notes"])
    assert "note: --trace" in measured["stdout"]


def test_plot_without_matplotlib_is_a_hint_and_exit_2(model, tmp_path, monkeypatch, capsys):
    from planner.cli import main as plan_main
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    png = tmp_path / "x.png"
    rc = plan_main(["measure", str(tmp_path / "no-plan.json"), str(model), "--plot", str(png)])
    err = capsys.readouterr().err
    assert rc == 2 and not png.exists()
    assert err.count("\n") == 1 and "pip install 'shardwise[plot]'" in err
    assert err.startswith("plan: error: --plot needs matplotlib"), err  # as plan's own --plot says it


def test_bad_trace_arguments_are_one_line_exit_2(model, tmp_path, capsys):
    from planner.cli import main as plan_main
    from planner.plan import Plan
    plan = _plan(model, "dp=2,tp=1,pp=1,zero=0,mbs=2", "dp_bad")
    a_file = tmp_path / "f"
    a_file.write_text("")
    other = tmp_path / "other.json"
    Plan.from_dict(dict(Plan.load(plan).to_dict(), cluster={"name": "my-lab", "nodes": 1,
                                                            "devices_per_node": 2})).save(other)
    for args, words in [((plan, "--trace", a_file), "is a file"),
                        ((plan, "--trace", tmp_path / "t", "--steps", "2", "--warmup", "2"), "more than"),
                        ((other, "--trace", tmp_path / "t"), "--cluster"),
                        ((plan, "--trace", tmp_path / "t", "--calibrate", tmp_path / "c.json"), "profiler")]:
        rc = plan_main(["measure", str(args[0]), str(model), *map(str, args[1:])])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "t").exists()  # nothing created before the checks pass


def test_plot_without_trace_draws_the_measured_total_only(tmp_path):
    from executor.plots import measure_bars
    result = {"plan": {"mesh": {"dp": 2, "tp": 1, "pp": 1}, "zero_stage": 0},
              "predicted": {"step_time_s": 0.01, "breakdown": {"compute_s": 0.006, "exposed_comm_s": 0.002,
                                                               "bubble_s": 0.0, "optimizer_s": 0.002}},
              "measured": {"step_time_s": 0.012}}
    measure_bars([result, dict(result, trace={"measured_categories": dict(result["predicted"]["breakdown"])})],
                 tmp_path / "bars.png")
    assert (tmp_path / "bars.png").read_bytes()[:8] == PNG
