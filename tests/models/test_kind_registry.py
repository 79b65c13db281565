"""The drafter kind registry: a kind is one module in each layer it touches (models/kinds/ for its
architecture and export, training/kinds/ for its loss terms, decoding/kinds/ for its drafting
walk), every kind has all three, their names, fields and config.json architectures do not
collide, and no code outside those modules and the registry names a kind. What each kind
computes is tests/models/test_drafter_kinds.py's, tests/training/test_kind_objectives.py's and
tests/decoding/test_drafting.py's."""

from __future__ import annotations

import ast
import dataclasses
import re
import tokenize
from pathlib import Path

import pytest

from dflash_jax.decoding import kinds as walks
from dflash_jax.errors import ModelError
from dflash_jax.models import kinds
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.training import kinds as losses
from support.decoding_models import MASK_ID, make_target
from support.package_imports import PACKAGE

# The packages whose modules are one kind each.
KIND_PACKAGES = {Path(package.__file__).parent: package for package in (kinds, losses, walks)}
# The most package files a kind's name may appear in: its three modules, the registry, one more.
MOST_FILES = 5


def _modules(package) -> list[str]:
    return sorted(p.stem for p in Path(package.__file__).parent.glob("*.py") if p.stem != "__init__")


def test_every_kind_is_a_module_in_each_layer_and_nothing_else_is():
    assert sorted(kinds.KINDS) == _modules(kinds)  # a kind's name is its module's
    assert sorted(losses.TERMS) == _modules(losses) == sorted(kinds.KINDS)
    assert sorted(walks.WALKS) == _modules(walks) == sorted(kinds.KINDS)
    assert all(callable(f) for f in (*losses.TERMS.values(), *walks.WALKS.values()))
    assert kinds.DEFAULT in kinds.KINDS
    with pytest.raises(ModelError, match="^kind='medusa' is not one of dflash, dflash2, dspark, domino, xpress$"):
        kinds.get("medusa")


def test_names_fields_and_architectures_do_not_collide():
    architectures = [a for k in kinds.KINDS.values() for a in k.architectures]
    assert len(architectures) == len(set(architectures)) == len(kinds.ARCHITECTURES)
    fields = [f.name for k in kinds.KINDS.values() for f in dataclasses.fields(k.fields)]
    assert len(fields) == len(set(fields))  # a field is one kind's
    # Every kind's fields are the drafter config's, with the kind's defaults (what a type checker sees).
    assert sorted(f.name for f in dataclasses.fields(kinds.KindFields)) == sorted(fields)
    for kind in kinds.KINDS.values():
        assert issubclass(DrafterConfig, kind.fields) or not dataclasses.fields(kind.fields)
        for f in dataclasses.fields(kind.fields):
            assert getattr(DrafterConfig(), f.name) == f.default


def test_a_kind_says_which_engines_serve_its_exports():
    said = {name: kind.served_by() for name, kind in kinds.KINDS.items()}
    assert said["dflash"] == "served by vLLM's 'dflash' method and llama.cpp's draft-dflash (export --format=gguf)"
    assert said["dflash2"].startswith("served by vLLM's 'dflash' method (GPU builds) and llama.cpp's draft-dflash")
    assert said["dspark"].startswith("served by vLLM's 'dspark' method (GPU builds) and llama.cpp's draft-dspark")
    assert said["domino"] == "vLLM has no Domino drafter; `dflash-jax evaluate` decodes it"
    assert said["xpress"].startswith("vLLM serves XPress only in its open PR #54448")


@pytest.mark.parametrize("name", sorted(kinds.KINDS))
def test_a_kind_round_trips_its_config_json(name):
    kind = kinds.KINDS[name]
    assert kind.first_draft_slot in (0, 1)
    cfg = DrafterConfig.for_target(make_target(seed=1).cfg, num_layers=1, mask_token_id=MASK_ID, kind=name)
    assert cfg.num_scored == cfg.block_size - kind.first_draft_slot
    assert cfg.num_drafts == cfg.num_scored - (0 if kind.drafts_last_slot else 1)
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
    assert cfg.to_hf()["architectures"] == [kind.architecture]


def _in_kind_module(path: Path) -> bool:
    return path.parent in KIND_PACKAGES and path.stem != "__init__"


@pytest.mark.parametrize("name", sorted(set(kinds.KINDS) - {kinds.DEFAULT}))
def test_a_kind_is_named_in_a_handful_of_package_files(name):
    """The project is called dflash, so the default kind's name is everywhere; the others' may
    appear in their own modules and the registry."""
    word = re.compile(re.escape(name), re.IGNORECASE)
    files = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if word.search(p.read_text()))
    assert len(files) <= MOST_FILES, files


def test_no_code_outside_the_kind_modules_names_a_kind():
    """A new kind is its modules: no string literal elsewhere in the package is a kind's name
    (comments and docstrings may speak of them)."""
    others = set(kinds.KINDS) - {kinds.DEFAULT}  # the default is also the loss's name ('dflash')
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _in_kind_module(path):
            continue
        with tokenize.open(path) as f:
            for token in tokenize.generate_tokens(f.readline):
                if token.type == tokenize.STRING and _value(token.string) in others:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{token.start[0]}")
    assert found == []


def _value(literal: str):
    try:
        return ast.literal_eval(literal)
    except ValueError:  # an f-string
        return None
