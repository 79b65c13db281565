"""Where the bundled config files and assets (tiny target, demo data) are.

A wheel carries `configs/` and `assets/` inside the package (pyproject.toml maps them to
`dflash_jax/configs` and `dflash_jax/assets`); a source checkout keeps them at the repository's
top, beside the package. Everything that reads them asks here, so both layouts work from any
directory.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
ROOT = _PACKAGE if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent
CONFIGS = ROOT / "configs"
ASSETS = ROOT / "assets"
DEFAULT_CONFIG = CONFIGS / "default.py"


def config_file(path: str) -> str:
    """`path` when it is a file; else the bundled config of that name (`configs/qwen3.py` or
    `qwen3.py` from any directory); else `path` unchanged, for the caller to report."""
    if os.path.isfile(path):
        return path
    bundled = CONFIGS / Path(path).name
    in_configs = Path(path).parent in (Path("."), Path("configs"))
    return str(bundled) if in_configs and bundled.is_file() else path


def shown(path: str | os.PathLike) -> str:
    """A bundled path as it reads in the repository (`configs/qwen3.py`, `assets/tiny-qwen3`),
    for help and listings that must not show this machine's absolute paths; others unchanged."""
    if not os.path.isabs(path):
        return str(path)
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)
