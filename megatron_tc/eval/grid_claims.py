"""Several grid processes over one out dir (the GPU script's lanes, one per GPU): every cell is run
by exactly one of them, and a lane that would wait for another's shared outputs does other work.

A process runs a cell only while it holds an exclusive `fcntl` lock on `<cell>/.grid_lock`. The
kernel drops the lock when the process exits, however it exits (a `timeout` kill included), so a
lock never goes stale and needs no cleanup. POSIX only, like the launcher.
"""
from __future__ import annotations

import errno
import fcntl
import os

CELL_LOCK = ".grid_lock"


class CellClaim:
    """`with CellClaim(run_dir) as held:` -> held is True when this process now runs the cell,
    False when another process holds it. The lock is released on leaving the block."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, CELL_LOCK)
        self.fd: int | None = None

    def __enter__(self) -> bool:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        self.fd = fd
        return True

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
