"""planner: trace a model into an operator graph, search parallel strategies, and write the plan.

Data flows one way: model -> `OpGraph` (graph.py, trace.py) -> strategies -> cost (cost_model/) -> search -> `Plan`
(plan.py) -> executor/.
"""
