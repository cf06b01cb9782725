"""The predicted step of a written plan as a Chrome trace, for `plan measure --trace` to lay beside the measured one.

The executor never imports the cost model; the `plan` CLI hands this function to `plan measure` instead.
"""
from __future__ import annotations

from typing import Any

from planner.errors import PlanError
from planner.plan import Plan


def predicted_timeline(plan: Plan, model_path: str, cluster_spec: str | None = None) -> tuple[dict[str, Any], str]:
    """(Chrome trace of the cost model's timeline for `plan`, a note or ""). The cluster is `cluster_spec` (a
    preset or YAML file) or the preset the plan names; a calibrated plan's timeline is scaled like its prediction."""
    from cost_model.model import CostModel
    from cost_model.timeline import chrome_trace
    from hardware_profiles.load import load_cluster
    from hardware_profiles.schema import ProfileError
    from planner.model_file import load_model_file
    from planner.trace import trace_model

    want = plan.cluster.get("name")
    spec = cluster_spec or want
    if not spec:
        raise PlanError("--trace: the plan names no cluster; pass --cluster PRESET|YAML (the profile it was made for)")
    try:
        cluster = load_cluster(spec, nodes=plan.cluster.get("nodes"))
    except ProfileError as e:
        raise PlanError(f"--trace needs the cluster profile the plan was made for ({e}); pass --cluster "
                        "PROFILE.yaml") from None
    if want and cluster.name != want:
        raise PlanError(f"--cluster {spec} is cluster {cluster.name!r}, the plan was made for {want!r}")
    pred = CostModel(cluster).predict(trace_model(load_model_file(model_path)), plan, timeline=True)
    written = plan.predicted.get("step_time_s")
    note = ""
    if written and any(str(a).startswith("calibrated:") for a in plan.predicted.get("assumptions", ())):
        pred = pred.calibrated(written / pred.step_time_s, "plan.json")
    elif written and abs(pred.step_time_s / written - 1) > 0.01:
        # A measured profile keeps its device's name (`plan profile` on CPU writes `cpu-local`, the preset's name),
        # so without --cluster the preset may stand in for the file the plan was made from.
        source = (f"--cluster {cluster_spec}" if cluster_spec else
                  f"the preset {want!r}; if the plan was made from a profile file, pass --cluster FILE")
        note = (f"the cost model predicts {pred.step_time_s * 1e3:.2f} ms for this plan on {source} (plan.json "
                f"says {written * 1e3:.2f} ms); the predicted trace shows {pred.step_time_s * 1e3:.2f} ms")
    return chrome_trace(pred), note
