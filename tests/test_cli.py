"""The command-line modules as programs: a user's mistake is one line on stderr and exit status 1,
found before anything is loaded or compiled; the commands that read a training config say where
its fields are documented. (Each command's own errors are tested in-process with the command;
subprocesses are few here, as each imports JAX.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflash_jax.training.run_config import FIELDS_DOCUMENTED

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize(
    "args, line",
    [
        # a usage error of regenerate (absl printed a page of usage)
        (
            ["-m", "dflash_jax.regenerate", "--input=README.md", "--output=README.md"],
            "error: --output=README.md must differ from --input: the output is appended to",
        ),
        # a mistyped config field, in a command other than train.py
        (
            ["-m", "dflash_jax.prepare", "--config=configs/default.py", "--config.train.learnin_rate=3e-4"],
            "config error: no field train.learnin_rate; did you mean train.learning_rate?",
        ),
    ],
    ids=["regenerate", "prepare"],
)
def test_user_errors_are_one_line(args, line):
    result = run(*args)
    assert (result.returncode, result.stderr.strip().splitlines()) == (1, [line]), result.stderr[-2000:]


# What every command does with its flags (cli.run), in a program that imports nothing heavier.
COMMAND = """
from absl import flags
from dflash_jax import cli
flags.DEFINE_string("drafter", None, "")
flags.mark_flag_as_required("drafter")
cli.run(lambda argv: print("ran"))
"""


@pytest.mark.parametrize(
    "args, line",
    [
        ([], "error: --drafter is required"),
        (["--drafter=runs/a", "runs/b"], "error: unexpected arguments ['runs/b']: every input is a flag, --name=value"),
    ],
    ids=["required", "positional"],
)
def test_every_command_reports_flag_mistakes_in_one_line(args, line):
    result = run("-c", COMMAND, *args)
    assert (result.returncode, result.stdout, result.stderr.strip().splitlines()) == (1, "", [line])


def test_plan_help_says_where_every_config_field_is_documented():
    result = run("-m", "dflash_jax.plan", "--helpshort")
    assert " ".join(FIELDS_DOCUMENTED.split()) in " ".join(result.stdout.split()), result.stdout[-2000:]
