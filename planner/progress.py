"""The search's progress bar: shown on a terminal once a search has run ~2 s, silent otherwise.

A short search finishes before the bar would appear, so its output is just the report; a long one shows how many
candidate groups are done out of how many, the best predicted step so far, and the elapsed time. The bar is
transient (erased when the search ends) and goes to stderr, so stdout stays the report (or `--json`).
"""
from __future__ import annotations

import math
import sys
import threading
from typing import IO, Any

DELAY_S = 2.0
"""Seconds a search runs before the bar appears (a bar that flashes for a moment is noise)."""


def _best_text(best_s: float) -> str:
    if not math.isfinite(best_s):
        return "best: -"
    return f"best: {best_s * 1e3:.2f} ms/step" if best_s < 10 else f"best: {best_s:.2f} s/step"


class SearchProgress:
    """Context manager; call it as `on_progress(done, total, best_s)` from the search loop.

    With `show` false (stderr piped or redirected) it does nothing. Otherwise a rich bar starts `delay_s` after
    entering, from a timer thread, so a search stuck in one long step (a large placement ILP) still shows it."""

    def __init__(self, show: bool | None = None, *, delay_s: float = DELAY_S, file: IO[str] | None = None,
                 console: Any = None):
        self.file = file or sys.stderr
        self.show = self.file.isatty() if show is None else show
        self.delay_s = delay_s
        self._console = console
        self._bar: Any = None
        self._task: Any = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._state = (0, None, math.inf)  # done, total, best step so far
        self._closed = False

    def __enter__(self) -> "SearchProgress":
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            console = self._console or Console(file=self.file)
            self._bar = Progress(TextColumn("searching"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("groups"), TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=console, transient=True)
            self._task = self._bar.add_task(_best_text(math.inf), total=None)
            if self.delay_s <= 0:
                self._start()
            else:
                self._timer = threading.Timer(self.delay_s, self._start)
                self._timer.daemon = True
                self._timer.start()
        return self

    def _start(self) -> None:
        with self._lock:
            if self._closed or self._bar is None:
                return
            done, total, best = self._state
            self._bar.update(self._task, completed=done, total=total, description=_best_text(best))
            self._bar.start()
            self.started = True

    started = False
    """Whether the bar was shown (the search outlived the delay on a terminal)."""

    def __call__(self, done: int, total: int, best_s: float) -> None:
        """Record progress: `done` of `total` candidate groups, best predicted step `best_s` (inf: none yet)."""
        if self._bar is None:
            return
        with self._lock:
            self._state = (done, total, best_s)
            self._bar.update(self._task, completed=done, total=total, description=_best_text(best_s))

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self.started:
            self._bar.stop()
