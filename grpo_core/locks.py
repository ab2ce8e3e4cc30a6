"""One holder at a time on this machine: an exclusive ``flock`` on a file.

The lock is released when the holder exits, however it exits (the kernel drops ``flock`` locks
with the process), so a killed holder never leaves a stale lock behind.
"""
from __future__ import annotations

import contextlib
import fcntl
import sys
from pathlib import Path


@contextlib.contextmanager
def exclusive(path: str | Path, waiting: str | None = None):
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block; if another
    process holds it, print ``waiting`` to stderr once and block until it is free."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
