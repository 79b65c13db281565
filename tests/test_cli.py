"""The command-line modules: a user's mistake is one line on stderr and exit status 1, found before
anything is loaded or compiled; `--help` exits 0 with the command's flags, required ones marked
and no machine paths; renamed flags name their new names; `--print_config` and `list-configs`
say what a config sets. The pieces are tested in-process; the programs (subprocesses, each
importing JAX) are in the slow tier."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from dflash_jax import (
    bundled,
    cli,
    commands,
    evaluate,
    export,
    install_llama_cpp,
    install_vllm,
    list_configs,
    plan,
    prepare,
    regenerate,
    train,
)
from dflash_jax.errors import ConfigError, UserError
from dflash_jax.training.config.config_text import describe_config
from dflash_jax.training.config.presets import check_variants_accepted, load_config_file
from dflash_jax.training.config.schema import FIELDS_DOCUMENTED, field_paths
from support.stderr import user_lines

REPO = Path(__file__).resolve().parents[1]
COMMAND_MODULES = {
    "train": train,
    "evaluate": evaluate,
    "plan": plan,
    "prepare": prepare,
    "regenerate": regenerate,
    "export": export,
    "install-llama-cpp": install_llama_cpp,
    "install-vllm": install_vllm,
    "list-configs": list_configs,
}


def defined_flags(name: str) -> flags.FlagValues:
    """The flags command `name` defines, in a FlagValues of their own."""
    fv = flags.FlagValues()
    COMMAND_MODULES[name].define_flags(fv)
    return fv


def test_the_command_runs_these_modules():
    assert {name: module for name, (module, _) in commands.COMMANDS.items()} == {
        name: module.__name__ for name, module in COMMAND_MODULES.items()
    }
    assert all(callable(module.run) for module in COMMAND_MODULES.values())


def test_help_marks_required_flags_and_shows_no_machine_paths():
    fv = flags.FlagValues()
    ours = dict(flag_values=fv, module_name="dflash_jax.a_command")
    flags.DEFINE_string("drafter", None, "A drafter.", **ours)
    flags.DEFINE_integer("limit", 0, "At most this many.", lower_bound=0, **ours)
    flags.DEFINE_string("output", str(bundled.ROOT / "runs" / "x"), "Where.", **ours)
    flags.DEFINE_string("library_flag", "", "A library's.", flag_values=fv, module_name="grain.config")
    flags.mark_flag_as_required("drafter", flag_values=fv)
    text = cli.help_text(fv, "  The command.\n\n  More.\n")
    assert text.startswith("The command.\n\nMore.\n\nflags:\n")
    assert "library_flag" not in text and "--library_flag" in cli.help_text(fv, "", full=True)
    assert "  --drafter: A drafter.\n    (required)\n" in text
    assert "  --limit: At most this many.\n    (default: '0')\n    (a non-negative integer)" in text
    assert "(default: 'runs/x')" in text and str(bundled.ROOT) not in text


@pytest.mark.parametrize("name", sorted(COMMAND_MODULES))
def test_every_command_help_is_complete(name):
    """Each command's flags: documented, the required ones marked, its renamed flags' new names
    among them (and the old ones not), no path of this machine."""
    fv = defined_flags(name)
    module = COMMAND_MODULES[name]
    text = cli.help_text(fv, module.__doc__)
    assert all(flag.help for flag in fv.flags_by_module_dict().get(module.__name__, [])), name
    assert str(bundled.ROOT) not in text
    for old, new in getattr(module, "RENAMED_FLAGS", {}).items():
        assert new in fv and old not in fv, (old, new)
        with pytest.raises(UserError, match=f"^--{old} is now --{new}$"):
            cli.check_renamed_flags([f"--{old}=1"], module.RENAMED_FLAGS)
    required = {
        "plan": ["config"],
        "prepare": ["config"],
        "evaluate": ["drafter"],
        "export": ["workdir"],
        "regenerate": ["input", "output"],
    }
    blocks = {block.split(":")[0].strip(): block for block in re.split(r"\n(?=  --)", text)[1:]}
    marked = {flag.removeprefix("--") for flag, block in blocks.items() if block.endswith("\n    (required)")}
    assert marked == set(required.get(name, [])), text
    if "config" in fv:
        assert " ".join(FIELDS_DOCUMENTED.split()) in " ".join(text.split())
        assert "--[no]print_config" in text


def test_export_refuses_gguf_flags_without_the_gguf_format():
    fv = defined_flags("export")
    fv(["export", "--workdir=w", "--draft_vocab=2048", "--target=t.gguf"])
    with pytest.raises(
        UserError, match=r"^--target and --draft_vocab apply to --format=gguf only \(the llama.cpp file\)$"
    ):
        export.check_gguf_flags(fv)
    fv(["export", "--workdir=w", "--draft_vocab=2048", "--target=t.gguf", "--format=gguf"])
    export.check_gguf_flags(fv)


def test_dtype_defaults_to_float32_on_a_cpu():
    assert defined_flags("evaluate")["dtype"].default is None
    assert defined_flags("regenerate")["dtype"].default is None
    assert cli.default_dtype() == "float32"  # the tests run on a CPU


def test_variants_given_to_a_config_without_variants_are_one_line():
    default = str(REPO / "configs" / "default.py")
    with pytest.raises(ConfigError) as e:
        check_variants_accepted(default, "8b", shown_as="configs/default.py")
    assert str(e.value) == (
        "--config=configs/default.py:8b: configs/default.py has no variants; use --config=configs/default.py"
    )
    check_variants_accepted(default, "", shown_as="configs/default.py")
    check_variants_accepted(str(REPO / "configs" / "qwen3.py"), "8b", shown_as="configs/qwen3.py")


def test_overrides_without_the_config_file_they_change_are_one_line():
    """`prepare` and `plan` take no config file of their own: their overrides alone were
    absl's "Unknown command line flag"; `train` has the default run's file."""
    argv = ["prepare", "--config.data.train=t.jsonl", "--config.data.seq_len=512"]
    with pytest.raises(ConfigError) as e:
        cli._checked_config_arguments(argv, has_default=False)
    assert str(e.value) == (
        "--config.data.train overrides a field of the config file, and no --config=FILE is given "
        "(`dflash-jax list-configs` lists the bundled ones)"
    )
    assert cli._checked_config_arguments(argv, has_default=True) == argv
    with_file = ["prepare", "--config", "configs/default.py", *argv[1:]]
    assert cli._checked_config_arguments(with_file, has_default=False) == with_file


def test_print_config_shows_every_field_with_its_comment():
    text = describe_config(load_config_file(str(REPO / "configs" / "qwen3.py"), "4b,b10"))
    assigned = re.findall(r"^([\w.]+) = ", text, re.M)
    assert assigned == field_paths()  # every field, once, in the schema's order
    assert "drafter.block_size = 10    (default: 16)" in text  # what the config changes
    assert "train.num_epochs = 6\n" in text  # what it keeps
    # The comments are the dataclasses' own, above their fields.
    assert "# Tokens per block: the anchor and the positions drafted after it.\ndrafter.block_size" in text
    assert "## data\n# JSONL / Parquet file" in text


def test_list_configs_names_every_file_its_variants_and_what_each_sets():
    text = list_configs.listing()
    files = sorted(p.name for p in (REPO / "configs").glob("*.py"))
    assert [Path(line.split(":")[0]).name for line in text.split("\n\n")] == [
        "default.py",
        *[f for f in files if f != "default.py"],
    ]
    assert str(bundled.ROOT) not in text
    assert "configs/default.py: Tiny CPU run" in text and "  variants: none" in text
    assert "train.optimizer='muon'" in text  # what configs/default.py sets
    qwen3 = text[text.index("configs/qwen3.py") :].split("\n\n")[0]
    assert "variants (default 8b)" in qwen3
    assert re.search(r"^    8b +\(as the default\)$", qwen3, re.M)
    assert re.search(r"^    b10 +drafter.block_size=10$", qwen3, re.M)
    assert re.search(r"^    32b +mesh.tensor=4, target.plan_config='configs/targets/Qwen3-32B.json'", qwen3, re.M)


def test_every_configs_variants_are_listed():
    """list-configs reads a config's variants from its module-level VARIANTS: a config file whose
    get_config takes variants must declare them there, or they go unlisted."""
    assert "not listed" not in list_configs.listing()


def test_the_readme_table_of_config_files_is_list_configs_markdown():
    readme = (REPO / "README.md").read_text()
    table = list_configs.markdown_table()
    assert table in readme, (
        f"regenerate the README's table of config files: dflash-jax list-configs --markdown\n{table}"
    )


# The programs. ---------------------------------------------------------------------------------


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


DISPATCH = "from dflash_jax.commands import main; main()"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line",
    [
        # a usage error of regenerate (absl printed a page of usage)
        (
            ["-m", "dflash_jax.regenerate", "--input=README.md", "--output=README.md"],
            "error: --output=README.md must differ from --input: the output is appended to",
        ),
        # a mistyped config field, in a command other than train
        (
            ["-m", "dflash_jax.prepare", "--config=configs/default.py", "--config.train.learnin_rate=3e-4"],
            "config error: no field train.learnin_rate; did you mean train.learning_rate?",
        ),
        # an override without the config file it changes (absl: "Unknown command line flag")
        (
            ["-m", "dflash_jax.prepare", "--config.data.seq_len=512"],
            "config error: --config.data.seq_len overrides a field of the config file, and no "
            "--config=FILE is given (`dflash-jax list-configs` lists the bundled ones)",
        ),
        # variants for a config file that has none (ml_collections: a TypeError's traceback)
        (
            ["train.py", "--config=configs/default.py:8b"],
            "config error: --config=configs/default.py:8b: configs/default.py has no variants; "
            "use --config=configs/default.py",
        ),
        # a renamed flag (absl suggested the closest name, --prompts)
        (["-m", "dflash_jax.evaluate", "--num_prompts=3"], "error: --num_prompts is now --limit"),
        # the dispatcher: a required flag, and a stray argument
        (["-c", DISPATCH, "export"], "error: --workdir is required"),
        (
            ["-c", DISPATCH, "export", "--workdir=runs/a", "runs/b"],
            "error: unexpected arguments ['runs/b']: every input is a flag, --name=value",
        ),
    ],
    ids=["regenerate", "prepare", "no-config-file", "variants", "renamed", "required", "positional"],
)
def test_user_errors_are_one_line(args, line):
    result = run(*args)
    assert (result.returncode, result.stdout, user_lines(result.stderr)) == (1, "", [line])


@pytest.mark.slow
def test_every_command_helps_and_runs_bundled_configs_from_any_directory(tmp_path):
    """`dflash-jax COMMAND --help` exits 0 for every command; from outside the repository
    `--config=configs/qwen3.py:4b` is the bundled file, and `--print_config` prints it."""
    for name in commands.COMMANDS:
        result = run("-c", DISPATCH, name, "--help", cwd=tmp_path)
        assert result.returncode == 0, (name, result.stderr[-2000:])
        assert "flags:" in result.stdout and str(bundled.ROOT) not in result.stdout, name
    result = run("-c", DISPATCH, "plan", "--config=configs/qwen3.py:4b", "--print_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "target.plan_config = " in result.stdout and "Qwen3-4B.json" in result.stdout
    result = run("-c", DISPATCH, "list-configs", cwd=tmp_path)
    assert (result.returncode, result.stdout.strip()) == (0, list_configs.listing())
