"""The large GPT examples trace on the meta device and have the parameter count of Narayanan et al.'s closed form
P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) (Narayanan et al. SC21, eq. 2)."""
import os

import pytest

from planner.model_file import load_model_file
from planner.trace import trace_model

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def closed_form_params(l: int, h: int, V: int, s: int) -> float:
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


@pytest.mark.parametrize("name,l,h,V,s", [("gpt2_xl", 48, 1600, 50257, 1024)])
def test_large_gpt_parameter_count_matches_closed_form(name, l, h, V, s):
    graph = trace_model(load_model_file(os.path.join(EXAMPLES, f"{name}.py")), progress=False)
    # + 2h: the final LayerNorm's weight and bias, which eq. 2 leaves out
    assert graph.num_parameters == round(closed_form_params(l, h, V, s)) + 2 * h
    assert graph.block_types == {"h.*": tuple(f"h.{i}" for i in range(l))}
