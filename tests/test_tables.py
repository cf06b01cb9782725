"""Tables are rich tables rendered as plain text: no colour codes, one row per line, columns split by runs of
spaces, so piped output stays parseable."""
import re

from executor.measure import format_report
from planner.plan import Mesh, Plan


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_measure_report_is_a_plain_rich_table():
    plan = Plan(mesh=Mesh(dp=2), global_batch_size=8, microbatch_size=4, num_microbatches=1,
                predicted={"step_time_s": 0.04, "peak_memory_bytes": 3 * 2**20})
    measured = {"step_time_s": 0.05, "peak_memory_bytes": 3.3 * 2**20, "step_time_spread_s": 0.002,
                "memory_bytes": {"parameters": 2**20, "gradients": 2**20, "activations": 2**19},
                "notes": ["tp layout derived"]}
    text = format_report(plan, measured)
    assert "\x1b[" not in text
    lines = text.splitlines()
    assert _cells(lines[0]) == ["predicted", "measured", "error"] and set(lines[1]) == {"─"}
    rows = {c[0]: c[1:] for c in map(_cells, lines[2:-1])}
    assert rows["step time"] == ["40.00 ms", "50.00 ms", "+25.0 %"]
    assert rows["peak memory / rank"] == ["3.00 MiB", "3.30 MiB", "+10.0 %"]
    # per memory category: predicted (none in this plan), measured, error
    assert rows["parameters"] == ["-", "1.00 MiB", "-"] and rows["activations"] == ["-", "0.50 MiB", "-"]
    assert rows["step time spread"] == ["2.00 ms"]
    assert lines[-1] == "note: tp layout derived"


def test_a_report_of_warm_up_and_memory_steps_only_says_so():
    """runner.report() after 1 or 3 steps gave the warm-up (or memory-tracked) steps' median as the step time with
    no word (Timings.kept falls back to every step)."""
    from types import SimpleNamespace

    from executor.measure import Timings, measurement
    t = Timings()
    for _ in range(3):
        t.add(0.1, 0.08, 0.02)
    t.tracked = [1, 2]
    runner = SimpleNamespace(timings=t, notes=[], memory_bytes=lambda: {"peak": None})
    notes = measurement(runner, warmup=1)["notes"]
    assert len(notes) == 1 and "all 3 step(s) so far are warm-up (1) or memory-tracked steps (2)" in notes[0] \
        and "run at least 4 steps" in notes[0]
    t.add(0.1, 0.08, 0.02)
    assert measurement(runner, warmup=1)["notes"] == []
