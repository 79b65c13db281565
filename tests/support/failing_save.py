"""`python failing_save.py <train.py flags>`: train.py with the checkpoint save of one step failing
as on a full disk (ENOSPC), the fault injected where Orbax writes a checkpoint item.

The step is read from $FAIL_SAVE_AT_STEP. Used by tests/training/test_loop.py.
"""

import errno
import os
import runpy
import sys
from pathlib import Path

import orbax.checkpoint as ocp

FAIL_STEP = os.environ["FAIL_SAVE_AT_STEP"]
TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
_write_item = ocp.handlers.JsonCheckpointHandler.async_save


async def _write_item_or_fail(self, directory, *args, **kwargs):
    if Path(str(directory)).parent.name.startswith(f"{FAIL_STEP}.orbax-checkpoint-tmp"):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return await _write_item(self, directory, *args, **kwargs)


ocp.handlers.JsonCheckpointHandler.async_save = _write_item_or_fail
sys.argv = [str(TRAIN_PY), *sys.argv[1:]]
runpy.run_path(str(TRAIN_PY), run_name="__main__")
