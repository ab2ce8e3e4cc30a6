"""One holder at a time on this machine: an exclusive lock on a file (``filelock``).

``filelock.FileLock`` holds an OS lock (``flock`` on POSIX), which the kernel drops with the
process however it exits, so a killed holder never leaves a stale lock behind.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from filelock import FileLock, Timeout


@contextlib.contextmanager
def exclusive(path: str | Path, waiting: str | None = None):
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block; if another
    process holds it, print ``waiting`` to stderr once and block until it is free."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if waiting:
            print(waiting, file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
