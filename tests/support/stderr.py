"""A command's stderr as the user reads it, without the lines the CUDA plugin of the `gpu-compile`
extra logs from C++ whenever jax is imported on a machine without a GPU (no Python logger or
environment variable silences them; JAX_PLATFORMS=cpu does not either). Every other line stays.
And the server log an engine failure's line names."""

from __future__ import annotations

import re
from pathlib import Path

PLUGIN_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.)$"
)


def user_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if not PLUGIN_NOISE.match(line)]


def kept_log(message: str) -> Path | None:
    """The server log an engine failure's line says it kept (`EngineServer._failure`), if any."""
    _, found, rest = message.rpartition(" (its whole log: ")
    return Path(rest.removesuffix(")")) if found else None


def remove_kept_log(message: str, holding: str) -> None:
    """Checks that the log an engine failure's line names was kept and holds `holding`, then
    removes it, so that a test leaves no log behind."""
    log = kept_log(message)
    assert log is not None and holding in log.read_text(errors="replace"), message
    log.unlink()
