"""plan.json's JSON Schema (`plan schema`): generated from the Plan dataclasses, a valid JSON Schema, published in
docs/, satisfied by every plan `plan` writes; hand-broken plans fail on load with one line naming the field path,
and `plan measure` exits 2 on them."""
from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os

import pytest

from planner.cli import main
from planner.errors import PlanError
from planner.plan import Mesh, OpPlacement, Plan, StageSpec
from planner.plan_schema import check_plan_dict, plan_errors, plan_schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
FORCE = "dp=2,tp=2,pp=2,zero=1,mbs=2,recompute=selective,schedule=interleaved,vp=2,sp=1"


@pytest.fixture(scope="module")
def written_plans(tmp_path_factory):
    """plan.json files written by `plan`: a forced configuration with stages and placements, and two searches
    (`--no-check`: the dry run that `-o` runs first changes nothing written unless it refuses the plan)."""
    tmp = tmp_path_factory.mktemp("plans")
    runs = {"gpt_forced": ["gpt.py", "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", FORCE],
            "llama_search": ["llama.py", "--cluster", "dgx-a100-80gb", "--batch-size", "32"],
            "mlp_cpu": ["mlp.py", "--cluster", "cpu-local", "--batch-size", "8"]}
    out = {}
    for name, args in runs.items():
        path = tmp / f"{name}.json"
        assert main([os.path.join(EXAMPLES, args[0]), *args[1:], "--no-check", "-o", str(path)]) == 0
        out[name] = path
    return out


def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = plan_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_is_valid_json_schema():
    _validator()


@pytest.mark.parametrize("cls", [Plan, Mesh, StageSpec, OpPlacement])
def test_schema_matches_the_dataclasses_both_ways(cls):
    schema = plan_schema()
    obj = schema if cls is Plan else schema["$defs"][cls.__name__]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(obj["properties"]) == set(fields) and obj["additionalProperties"] is False
    for name, prop in obj["properties"].items():
        assert prop["description"], f"{cls.__name__}.{name} has no docstring"
    for name in obj["required"]:
        assert name in fields
    hand = {Plan: {"mesh", "global_batch_size", "microbatch_size", "num_microbatches"}, Mesh: {"dp", "tp", "pp"},
            StageSpec: {"start_layer", "end_layer"}, OpPlacement: {"strategy"}}
    assert set(obj["required"]) == hand[cls]


def test_published_schema_is_current(tmp_path, capsys):
    published = json.loads(open(os.path.join(ROOT, "docs", "plan.schema.json")).read())
    assert published == plan_schema(), "docs/plan.schema.json is stale: run `plan schema -o docs/plan.schema.json`"
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == published
    assert main(["schema", "-o", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == published


def test_every_written_plan_validates(written_plans):
    bundled = [p for p in glob.glob(os.path.join(EXAMPLES, "**", "*.json"), recursive=True)
               if "mesh" in json.loads(open(p).read())]  # plans shipped with the examples, if any
    for path in list(written_plans.values()) + bundled:
        data = json.loads(open(path).read())
        assert plan_errors(data) == [], path
        Plan.load(path)
        try:
            validator = _validator()
        except pytest.skip.Exception:
            continue
        assert not list(validator.iter_errors(data)), path


def _set(path, value):
    def edit(d):
        *head, last = path
        for k in head:
            d = d[k]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
    return edit


BROKEN = [
    (_set(["mesh", "tp"], "2"), 'mesh.tp: expected an integer >= 1, got "2"'),
    (_set(["mesh", "dp"], 0), "mesh.dp: expected an integer >= 1, got 0"),
    (_set(["mesh", "pp"], KeyError), "mesh: missing key 'pp'"),
    (_set(["mesh", "cp"], 2), "mesh: unknown key 'cp' (known: dp, pp, tp)"),
    (_set(["mesh"], [2, 2, 2]), "mesh: expected an object, got [2, 2, 2]"),
    (_set(["zero_stage"], 4), "zero_stage: expected one of 0, 1, 2, 3, got 4"),
    (_set(["recompute"], "some"), 'recompute: expected one of none, attention, selective, full, got "some"'),
    (_set(["sequence_parallel"], "yes"), 'sequence_parallel: expected true or false, got "yes"'),
    (_set(["microbatch_size"], 1.5), "microbatch_size: expected an integer >= 1, got 1.5"),
    (_set(["global_batch_size"], KeyError), "missing key 'global_batch_size'"),
    (_set(["schedul"], "1f1b"), "unknown key 'schedul' (known: "),
    (_set(["stages", 1, "end_layer"], -1), "stages[1].end_layer: expected an integer >= 1, got -1"),
    (_set(["stages", 0, "modules"], "h.0"), 'stages[0].modules: expected a list, got "h.0"'),
    (_set(["ops", "h.0.mlp.c_fc", "strategy"], "column"),
     'ops["h.0.mlp.c_fc"].strategy: expected one of replicate, colwise, rowwise'),
    (_set(["ops", "h.0.mlp.c_fc", "inputs", 0], "S0"),
     'ops["h.0.mlp.c_fc"].inputs[0]: expected a placement over the tp axis (R, P or S(dim)), got "S0"'),
    (_set(["cluster", "nodes"], "1"), 'cluster.nodes: expected an integer >= 1, got "1"'),
    (_set(["global_batch_size"], 17), "global_batch_size 17 != dp 2 x microbatch_size 2 x num_microbatches 4"),
]


def _good() -> dict:
    """A valid plan as plan.json holds it (lists, not tuples)."""
    return json.loads(json.dumps(_good_plan().to_dict()))


def _good_plan() -> Plan:
    return Plan(mesh=Mesh(dp=2, tp=2, pp=2), zero_stage=1, sequence_parallel=True, recompute="selective",
                schedule="interleaved", virtual_stages=2, global_batch_size=16, microbatch_size=2,
                num_microbatches=4, stages=tuple(StageSpec(start_layer=i, end_layer=i + 1, rank=i % 2,
                                                           modules=(f"h.{i}",)) for i in range(4)),
                ops={"h.0.mlp.c_fc": OpPlacement(strategy="colwise", module="h.0.mlp.c_fc", inputs=("R",),
                                                 output="S(2)", params=("S(0)", "S(0)"))},
                cluster={"name": "dgx-a100-80gb", "nodes": 1, "devices_per_node": 8})


@pytest.mark.parametrize("edit,message", BROKEN, ids=[m.split(":")[0] for _, m in BROKEN])
def test_hand_broken_plan_names_the_field(tmp_path, edit, message):
    data = _good()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as e:
        Plan.load(path)
    text = str(e.value)
    assert text.startswith(f"{path}: {message}") and "\n" not in text
    try:  # the schema says the same as our validator (the last case is a consistency check beyond any schema)
        validator = _validator()
    except pytest.skip.Exception:
        return
    assert bool(list(validator.iter_errors(data))) == ("!=" not in message)


def test_integral_floats_are_integers_as_in_json_schema():
    data = _good()
    data["mesh"]["tp"] = 2.0
    check_plan_dict(data)
    assert Plan.from_dict(data).mesh.tp == 2 and isinstance(Plan.from_dict(data).mesh.tp, int)
    assert Plan.from_dict(copy.deepcopy(_good())) == _good_plan()


def test_plan_measure_and_apply_plan_refuse_a_broken_plan(tmp_path, capsys):
    data = _good()
    data["mesh"]["tp"] = "2"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["measure", str(path), os.path.join(EXAMPLES, "gpt.py")]) == 2
    err = capsys.readouterr().err
    assert err == f'plan: error: {path}: mesh.tp: expected an integer >= 1, got "2"\n'
    import torch
    from executor import apply_plan
    with pytest.raises(PlanError, match=r"mesh\.tp: expected an integer >= 1"):
        apply_plan(torch.nn.Linear(2, 2), str(path))
