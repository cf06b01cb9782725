"""Errors the planner raises for bad user input; the CLI prints them as one line and exits with status 2."""


class ModelError(ValueError):
    """The model file cannot be loaded, built or traced (the message names the problem and the fix)."""


class PlanError(ValueError):
    """A plan (file, `--force` keys or search request) is invalid or cannot be satisfied."""
