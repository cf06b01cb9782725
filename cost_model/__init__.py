"""cost_model: the single place that knows what anything costs — compute, communication, memory — and the step
simulator that adds them up for a plan.

Reads `OpGraph` and `Plan` (planner) and `Cluster` (hardware_profiles) and nothing else of the planner. The search
receives a cost model object and asks it; it never re-derives a cost.
"""
from cost_model.prediction import Prediction, TraceEvent

__all__ = ["Prediction", "TraceEvent"]
