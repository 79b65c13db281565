"""The drafter kind registry (models/kinds/): every module is one kind, their names, fields and
config.json architectures do not collide, every part a kind names exists, and no code outside
the kinds' own modules names a kind. What each kind computes is tests/models/test_drafter_kinds.py's,
tests/training/test_kind_objectives.py's and tests/decoding/test_drafting.py's."""

from __future__ import annotations

import ast
import tokenize
from pathlib import Path

import pytest

from dflash_jax.errors import ModelError
from dflash_jax.models import kinds
from dflash_jax.models.drafter_config import DEFAULTS, DrafterConfig
from support.decoding_models import MASK_ID, make_target
from support.package_imports import PACKAGE

KIND_MODULES = Path(kinds.__file__).parent


def test_every_module_is_a_kind_and_nothing_collides():
    modules = sorted(p.stem for p in KIND_MODULES.glob("*.py") if p.stem != "__init__")
    assert sorted(kinds.KINDS) == modules  # a kind's name is its module's
    assert kinds.DEFAULT in kinds.KINDS
    architectures = [a for k in kinds.KINDS.values() for a in k.architectures]
    assert len(architectures) == len(set(architectures)) == len(kinds.ARCHITECTURES)
    fields = [f for k in kinds.KINDS.values() for f in (*k.fields, *k.release_fields)]
    assert len(fields) == len(set(fields))  # a field is one kind's
    # Every kind's fields are the drafter config's, with the kind's defaults.
    assert {f: getattr(DEFAULTS, f) for f in fields} == {**kinds.SIZE_FIELDS, **kinds.RELEASE_FIELDS}
    with pytest.raises(ModelError, match="^kind='medusa' is not one of dflash, dflash2, domino, dspark$"):
        kinds.get("medusa")


@pytest.mark.parametrize("name", sorted(kinds.KINDS))
def test_every_part_a_kind_names_exists(name):
    kind = kinds.KINDS[name]
    assert callable(kind.part("loss_terms")) and callable(kind.part("walk"))
    assert kind.first_draft_slot in (0, 1)
    cfg = DrafterConfig.for_target(make_target(seed=1).cfg, num_layers=1, mask_token_id=MASK_ID, kind=name)
    assert cfg.num_drafts == cfg.block_size - kind.first_draft_slot
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
    assert cfg.to_hf()["architectures"] == [kind.architecture]


def test_no_code_outside_the_kind_modules_names_a_kind():
    """A new kind is its module: no string literal elsewhere in the package is a kind's name
    (comments and docstrings may speak of them)."""
    others = set(kinds.KINDS) - {kinds.DEFAULT}  # the default is also the loss's name ('dflash')
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == KIND_MODULES:
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
