"""What every command-line module shares: absl start-up, one-line user errors, exit statuses.

Exit statuses, the same for every command:
  0   success (a training run that finished, or had finished before)
  1   an error; a user error (bad config, file or data) is one line on stderr, no traceback
  75  training stopped on request (SIGTERM / SIGINT) after saving a checkpoint: rerun the same
      command to resume (EX_TEMPFAIL, which batch schedulers read as "try again")
  130 interrupted by Ctrl-C outside training, nothing saved
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable

from absl import app

from dflash_jax.errors import UserError

# A full disk, a quota, a read-only filesystem: reported in one line, like a user error.
STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

EXIT_ERROR = 1
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130


def run(main: Callable[[list[str]], int | None]) -> None:
    """`absl.app.run(main)`, with user errors as one line and the exit statuses above."""

    def guarded(argv):
        # JAX, Orbax and grain log every backend probe, save and read at INFO; keep ours.
        for name in ("absl", "jax"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            return main(argv)
        except UserError as e:
            print(f"{e.label}: {e}", file=sys.stderr)
        except OSError as e:
            if e.errno not in STORAGE_ERRORS:
                raise
            print(f"error: {e}", file=sys.stderr)  # the machine's storage, not a bug
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        return EXIT_ERROR

    app.run(guarded)
