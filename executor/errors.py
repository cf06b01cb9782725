"""Errors the executor raises for bad input (a plan that does not match the model or the launch)."""


class ExecutorError(ValueError):
    """A plan cannot be applied here; the message names the problem and the fix."""
