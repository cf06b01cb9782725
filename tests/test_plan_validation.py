"""A plan file read by `plan check`, `plan export` and `plan measure` is refused at load, as one line naming the field
and the fix (exit status 2, no traceback), when it cannot be what the planner meant: stages missing, listed twice or
empty beside listed ones, a stage on a rank other than k % pp, a mesh its own cluster cannot hold, tp placements
at tp=1, a negative or non-finite prediction (or part of one), a key given twice, a number too long to read, bytes
that are not UTF-8, nesting too deep for a plan; `plan check` refuses a plan made for another
model before its dry run."""
import json
import os
import re

import pytest

from planner.errors import PlanError
from planner.plan import Mesh, Plan, StageSpec, model_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "examples", "mlp.py")
GPT = os.path.join(ROOT, "examples", "gpt.py")


def _fingerprint(path: str) -> dict:
    from planner.model_file import build, load_model_file
    model = build(load_model_file(path), "meta")
    return {"path": path, "parameters": sum(p.numel() for p in model.parameters()),
            "fingerprint": model_fingerprint((n, p.shape) for n, p in model.named_parameters())}


@pytest.fixture(scope="module")
def mlp_model() -> dict:
    return _fingerprint(MLP)


def _good(model: dict | None = None) -> dict:
    """A valid pp=2 plan of examples/mlp.py on cpu-local (1 node x 2), as plan.json holds it."""
    plan = Plan(mesh=Mesh(pp=2), schedule="gpipe", global_batch_size=8, microbatch_size=8, num_microbatches=1,
                precision="fp32", stages=(StageSpec(start_layer=0, end_layer=3, modules=("0", "1", "2"), rank=0),
                                          StageSpec(start_layer=3, end_layer=6, modules=("3", "4"), rank=1)),
                cluster={"name": "cpu-local", "nodes": 1, "devices_per_node": 2}, model=model or {},
                predicted={"step_time_s": 0.001, "peak_memory_bytes": 1713664,
                           "memory_per_device_bytes": [1713664, 56540]})
    return json.loads(json.dumps(plan.to_dict()))


def _stages(d, modules):
    d["stages"] = [dict(s, modules=m) for s, m in zip(d["stages"], modules)]


BROKEN = [
    (lambda d: d.pop("stages"), r"stages: pp=2 x virtual_stages=1 needs 2 stages, the plan has 0; "),
    (lambda d: d.update(stages=[]), r"stages: pp=2 x virtual_stages=1 needs 2 stages, the plan has 0; "),
    (lambda d: _stages(d, [["0", "1", "2"], ["2", "3", "4"]]),
     r"stages\[1\]\.modules: module '2' is listed in stage 0 and stage 1; list each module in one stage only"),
    (lambda d: _stages(d, [["0", "1"], ["2", "3", "1", "4"]]),
     r"stages\[1\]\.modules: module '1' is listed in stage 0 and stage 1; "),
    (lambda d: _stages(d, [[], ["3", "4"]]), r"stages\[0\]\.modules: stage 0 lists no modules but stage 1 does; "),
    (lambda d: _stages(d, [["0", "1", "2"], []]), r"stages\[1\]\.modules: stage 1 lists no modules but stage 0 does"),
    (lambda d: d["cluster"].update(devices_per_node=4),
     r"mesh: dp x tp x pp = 1 x 1 x 2 = 2 but the plan's cluster has 4 devices \(1 node x 4\); make the product 4"),
    (lambda d: d["cluster"].update(nodes=2),
     r"mesh: dp x tp x pp = 1 x 1 x 2 = 2 but the plan's cluster has 4 devices \(2 nodes x 2\)"),
    (lambda d: d.update(parameters={"0.weight": "S(0)"}),
     r'parameters\["0\.weight"\]: placed S\(0\) but mesh\.tp is 1 \(nothing to shard over\); drop `parameters`'),
    (lambda d: d["predicted"].update(step_time_s=-1), r"predicted\.step_time_s: expected a finite number >= 0, got -1"),
    (lambda d: d["predicted"].update(step_time_s="fast"), r'predicted\.step_time_s: .* got "fast"'),
    (lambda d: d["predicted"].update(peak_memory_bytes=float("inf")), r"predicted\.peak_memory_bytes: .* got Infinity"),
    (lambda d: d["predicted"].update(memory_per_device_bytes=[1, float("nan")]),
     r"predicted\.memory_per_device_bytes: expected a list of finite numbers >= 0, got \[1, NaN\]"),
    (lambda d: d["predicted"].update(deep=json.loads("[" * 40 + "]" * 40)), r"not a plan: nested too deeply"),
    # ignored by the executor (stage k runs on rank k % pp) while export refused it
    (lambda d: d["stages"][1].update(rank=7),
     r"stages\[1\]\.rank: 7, but stage k runs on pipeline rank k % pp = 1; drop rank or set it to 1$"),
    # plan measure crashed on these after its run
    (lambda d: d["predicted"].update(breakdown={"compute_s": "x"}),
     r'predicted\.breakdown\.compute_s: expected a finite number, got "x"; drop `predicted`'),
    (lambda d: d["predicted"].update(memory_breakdown={"parameters": 1, "activations": float("nan")}),
     r"predicted\.memory_breakdown\.activations: expected a finite number, got NaN"),
    (lambda d: d["predicted"].update(memory_breakdown=[1, 2]),
     r"predicted\.memory_breakdown: expected an object of numbers, got \[1, 2\]"),
    (lambda d: d["predicted"].update(tflops_per_device="x"), r'predicted\.tflops_per_device: .* got "x"'),
    # plan check passed these (the executor cuts by the modules; the ranges price the plan)
    (lambda d: d["stages"][1].update(start_layer=2),
     r"stages\[1\] covers layers \[2, 6\), but the stages must cut the layers in order from 0 without gaps or "
     r"overlaps \(it should start at 3"),
    (lambda d: d["stages"][1].update(start_layer=4), r"stages\[1\] covers layers \[4, 6\)"),
    (lambda d: d["stages"][0].update(start_layer=1), r"stages\[0\] covers layers \[1, 3\)"),
    (lambda d: d.update(max_grad_norm=-1), r"max_grad_norm: expected a number >= 0, got -1$"),
    (lambda d: d.update(max_grad_norm=float("nan")), r"max_grad_norm must be a finite number >= 0 \(0: no clipping\)"),
    # torch's Schedule1F1B raises at launch below pp micro-batches; `plan` offered such plans
    (lambda d: d.update(schedule="1f1b"),
     r"num_microbatches: schedule 1f1b needs at least pp=2 micro-batches per step, got 1; raise global_batch_size"),
    (lambda d: d.update(schedule="interleaved", virtual_stages=2, global_batch_size=24, microbatch_size=8,
                        num_microbatches=3, stages=[{"start_layer": a, "end_layer": b, "modules": [], "rank": k % 2}
                                                    for k, (a, b) in enumerate([(0, 2), (2, 3), (3, 5), (5, 6)])]),
     r"num_microbatches: schedule interleaved needs a micro-batch count that is a multiple of pp=2, got 3; "),
]


@pytest.mark.parametrize("edit,message", BROKEN, ids=[
    "no-stages", "stages-empty", "module-in-two-stages", "module-in-two-stages-2",
    "stage0-no-modules", "stage1-no-modules", "mesh-vs-devices", "mesh-vs-nodes", "param-sharded-at-tp1",
    "negative-step-time", "string-step-time", "infinite-memory", "nan-memory", "deep-prediction", "stage-rank",
    "string-breakdown", "nan-memory-breakdown", "list-memory-breakdown", "string-tflops", "stage-overlap",
    "stage-gap", "stage-from-1", "negative-clip", "nan-clip", "1f1b-too-few", "interleaved-not-multiple"])
def test_a_broken_plan_file_is_refused_at_load(tmp_path, edit, message):
    data = _good()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}: {message}") as e:
        Plan.load(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit", [
    lambda d: None,
    lambda d: _stages(d, [[], []]),  # no modules anywhere: the executor cuts the model by layer ranges
    # a container in each stage, as the planner writes for HF models (its own ops run in both)
    lambda d: _stages(d, [["t", "t.0", "t.1", "t.2"], ["t.3", "t", "t.4"]]),
    lambda d: d.update(cluster={}),  # no cluster: nothing to compare the mesh with
    lambda d: d.update(cluster={"name": "x", "nodes": 2.0, "devices_per_node": 1}),
    lambda d: d.update(mesh={"dp": 1, "tp": 1, "pp": 1}, stages=[], cluster={}),  # pp=1 needs no stages
    lambda d: d.update(parameters={"0.weight": "R"}),
    lambda d: d.update(predicted={}),
    lambda d: d["predicted"].update(step_time_s=0),
    lambda d: [s.pop("rank") for s in d["stages"]],  # stage k runs on rank k % pp
    lambda d: d["predicted"].update(breakdown=None, memory_breakdown={"headroom": -1.5}),
    lambda d: d.update(max_grad_norm=1),  # an integer norm (JSON has no float type of its own)
], ids=["good", "no-modules", "container-in-two-stages", "no-cluster", "float-nodes", "pp1-no-stages", "replicated",
        "no-prediction", "zero", "no-stage-ranks", "breakdowns", "int-clip"])
def test_a_good_plan_file_loads(tmp_path, edit):
    data = _good()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    plan = Plan.load(path)
    assert plan.mesh.pp == data["mesh"]["pp"]
    assert [s.rank for s in plan.stages] == [k % plan.mesh.pp for k in range(len(plan.stages))]


def test_a_key_given_twice_or_a_number_too_long_is_one_line(tmp_path):
    """json keeps the last of two keys silently; a 5000-digit integer raised ValueError (int's digit limit)."""
    path = tmp_path / "plan.json"
    text = json.dumps(_good())
    path.write_text(text.replace('"zero_stage": 0', '"zero_stage": 3, "zero_stage": 0'))
    with pytest.raises(PlanError, match=rf'^{re.escape(str(path))}: key "zero_stage" appears twice in one object '
                                        r"\(JSON readers keep the last silently\); keep one$"):
        Plan.load(path)
    path.write_text(text.replace('"zero_stage": 0', '"zero_stage": ' + "1" * 5000))
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}: not a plan: Exceeds the limit \(4300 digits\).*; "
                                        r"regenerate it with `plan \.\.\. -o`$"):
        Plan.load(path)


def test_plans_built_in_code_are_not_held_to_the_file_checks():
    """The executor derives stages a plan built in code leaves out; only a file must list them."""
    assert Plan(mesh=Mesh(pp=2), global_batch_size=2, microbatch_size=1, num_microbatches=2).stages == ()


def test_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}: not a UTF-8 text file \(byte 0xff at offset 0\); "):
        Plan.load(path)


def test_a_utf8_bom_is_no_error(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_good()).encode())
    assert Plan.load(path).mesh.pp == 2


@pytest.mark.parametrize("text", ["[" * 100000, '{"a":' * 500 + "1" + "}" * 500])
def test_deep_nesting_is_one_line(tmp_path, text):
    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}: not a plan: nested too deeply"):
        Plan.load(path)


@pytest.mark.parametrize("command", ["check", "export", "measure"])
@pytest.mark.parametrize("content,words", [(b"\xff\xfe\x00", "not a UTF-8 text file"),
                                           (b"[" * 100000, "nested too deeply"),
                                           (json.dumps(dict(_good(), stages=[])).encode(), "needs 2 stages")])
def test_each_command_says_one_line_and_exits_2(tmp_path, capsys, command, content, words):
    from planner.cli import main
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    args = [command, str(path), *(["--to", "deepspeed"] if command == "export" else [MLP])]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


def test_plan_check_refuses_a_plan_made_for_another_model(tmp_path, capsys, mlp_model):
    """Before: the dry run failed with `AttributeError: GPT has no attribute 0`."""
    from planner.cli import main
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(_good(mlp_model)))
    assert main(["check", str(path), GPT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plan was made for another model" in err and "re-plan" in err, err
    assert main(["check", str(path), MLP]) == 0, capsys.readouterr().err


def test_plan_check_refuses_stages_the_model_does_not_have(tmp_path, capsys, mlp_model):
    """Before: `ok` (a plan's module lists were read only when the executor cut a pipeline)."""
    from planner.cli import main
    path = tmp_path / "mlp.json"
    beyond = _good(mlp_model)
    beyond["stages"][1]["end_layer"] = 19
    alien = _good()  # no fingerprint: a pp=1 plan naming another model's modules
    alien.update(mesh={"dp": 2, "tp": 1, "pp": 1}, schedule="1f1b", microbatch_size=4,
                 stages=[{"start_layer": 0, "end_layer": 3, "modules": ["wte", "h", "lm_head"]}])
    for plan, words in ((beyond, "plan stages end at layer 19 but the model has at most "),
                        (alien, "stage 0 of the plan lists module 'wte', which this model does not have")):
        path.write_text(json.dumps(plan))
        assert main(["check", str(path), MLP]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


def test_plan_check_reports_a_model_file_error_as_plan_model_does(tmp_path, capsys, mlp_model):
    """Before: `plan check: dry run of ... apply_plan: ModelError: ...`, as if the plan were at fault."""
    from planner.cli import main
    bad = tmp_path / "bad.py"
    bad.write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(MLP)!r})\nfrom mlp import build_model\n"
                   "def sample_batch(batch_size):\n    raise ValueError('no data here')\n")
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(_good(mlp_model)))  # micro-batches of 8
    assert main([str(bad), "--cluster", "cpu-local", "--batch-size", "8", "--precision", "fp32"]) == 2
    planned = capsys.readouterr().err.strip()
    assert planned.startswith(f"plan: error: {bad}: sample_batch(1) raised ValueError: no data here"), planned
    assert main(["check", str(path), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == planned.replace("sample_batch(1)", "sample_batch(8)") and "dry run" not in err, err
