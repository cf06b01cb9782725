"""Checks for an output file, shared by every command that writes one (`plan -o`, `plan profile -o`, ...). They live
here, at the bottom of the import order (this package imports nothing of ours), so that the planner, the executor
and the profiler all refuse the same paths."""

from __future__ import annotations

import os
import stat


def unwritable(path: str) -> str | None:
    """Why `path` (a real path: resolve symlinks first) cannot be written as a file, or None: a directory, a device
    or a pipe (which the temp-file rename would replace), a folder under a file, no permission."""
    if os.path.isdir(path):
        return "it is a directory"
    if os.path.exists(path) and not os.path.isfile(path):
        return "it is not a regular file (a device or a pipe, which the rename would replace)"
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return f"{above} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "no permission to write there"
    return None


def output_mode(target: str | os.PathLike) -> int:
    """The mode an output written to `target` gets: that of the file it replaces, else what open() would give."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
