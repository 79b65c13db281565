"""One training run per workdir: a second run in the same directory would interleave its
checkpoints and metrics with the first one's."""

from __future__ import annotations

import contextlib
import fcntl
import os

import jax

LOCK_FILE = ".train.lock"


class WorkdirBusyError(RuntimeError):
    pass


@contextlib.contextmanager
def workdir_lock(workdir: str | None):
    """Holds an exclusive lock on `<workdir>/.train.lock` (process 0 only) while the run lasts.

    The OS releases the lock when the process dies, so a crashed run never blocks the next one.
    """
    if not workdir or jax.process_index() != 0:
        yield
        return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise WorkdirBusyError(
                f"another training run (pid {holder}) is using {workdir}; wait for it, stop it, "
                "or pass a different --config.workdir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
