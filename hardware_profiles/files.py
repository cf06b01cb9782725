"""Writing an output file, shared by every command that writes one (`plan -o`, `plan profile -o`, ...): the checks
before any work and the atomic write. They live here, at the bottom of the import order (this package imports
nothing of ours), so that the planner, the executor and the profiler refuse and write paths the same way."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import Iterator


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
    try:  # where access() says yes and no file can be made (/proc, /sys, a read-only mount): make one to see
        fd, probe = tempfile.mkstemp(prefix=".tmp-", dir=above)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"no file can be made in {above} ({e.strerror or e})"
    return None


def unwritable_output(path: str | os.PathLike) -> str | None:
    """`unwritable` for an output path as given: also refuses one ending in a path separator (`-o newdir/`), which
    names a folder, while realpath drops the separator and the write made a file named newdir."""
    path = os.fspath(path)
    if path.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        return f"it ends in {path[-1]!r}, which names a folder, not a file"
    return unwritable(os.path.realpath(path))  # a symlink is written through, to its target


def output_mode(target: str | os.PathLike) -> int:
    """The mode an output written to `target` gets: that of the file it replaces, else what open() would give."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yield a temp file name in the folder of `path`'s real file (a symlink's target, so the link survives), which
    is made if missing (every command's outputs alike: `-o results/plan.json` makes results/); when the block ends
    without error it gets `output_mode` and is renamed over that file, else it is removed. OSError (making the
    folder or the temp file, renaming) propagates."""
    target = os.path.realpath(os.fspath(path))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=os.path.dirname(target))
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, output_mode(target))  # mkstemp makes the file private (0600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
