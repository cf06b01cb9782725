"""Rendering rich tables to text: every table shardwise prints goes through `render`, so reports read the same
on a terminal and in a pipe or a file (plain characters, no colour codes)."""
from __future__ import annotations

import io
from typing import Any


def render(table: Any, width: int = 160) -> str:
    """The table as plain text (no ANSI codes), at most `width` characters wide, without a trailing newline."""
    from rich.console import Console
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines())
