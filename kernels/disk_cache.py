"""agentflash's on-disk cache ($AGENTFLASH_CACHE_DIR, else ~/.cache/agentflash): where it lives,
and how an entry (a CPU kernel library, a compiled program) is made safely.

An entry is made while its builder holds a lock that the operating system keeps (`filelock`:
flock on POSIX), so the lock goes away with the process however it ends (Ctrl-C, an OOM kill,
SIGKILL, a CI timeout) and the next process takes it at once. An entry counts only once it is
whole: its builder writes it under a temporary name and renames it, or writes a marker last, so
a build killed midway leaves nothing that is ever loaded, and the next builder clears what it
left. A process that waits on another's build says, after a few seconds, what it waits for and
where.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import filelock

log = logging.getLogger(__name__)

WAIT_NOTICE_S = 3.0
"""How long a process waits on another's lock before it says so."""


def root() -> Path:
    """The cache's directory: $AGENTFLASH_CACHE_DIR, else the user cache directory."""
    path = os.environ.get("AGENTFLASH_CACHE_DIR")
    if path is None:
        path = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                            "agentflash")
    return Path(path)


@contextmanager
def locked(path: Path, what: str) -> Iterator[None]:
    """Hold the lock file `path` (made with its folder if missing) for the block. `what` names
    what its holder makes, for the message a waiter prints."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=WAIT_NOTICE_S)
    except filelock.Timeout:
        log.warning("waiting for another process that is %s (lock %s)", what, path)
        start = time.monotonic()
        lock.acquire()
        log.warning("waited %.0f s for %s", time.monotonic() - start, path)
    try:
        yield
    finally:
        lock.release()
