"""The package's layers only point down (docs/design.md §9):

    errors, bundled, simulated_devices <- models <- data <- decoding <- training <- command-line modules

inside a package too, its modules and subpackages stand in levels (`LEVELS`) and import only their
own level or below (lazy imports included); no module imports, through others, itself (no import
circles, inside a package included), and the package imports no test framework or reference
implementation (torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.package_imports import PACKAGE, imports, module_name

LAYERS = {
    "errors": 0,
    "bundled": 0,
    "simulated_devices": 0,
    "field_checks": 0,
    "startup": 0,
    "models": 1,
    "data": 2,
    "decoding": 3,
    "training": 4,
}
COMMAND_LINE = 5  # dflash_jax/<name>.py: cli, commands, train, prepare, evaluate, regenerate, export, plan, ...
FORBIDDEN = {"torch", "pytest", "support"}


def layer_of(module: str) -> int:
    """'dflash_jax.training.loop' -> 4; a top-level module other than errors is a command line."""
    parts = module.split(".")
    return LAYERS.get(parts[1], COMMAND_LINE) if len(parts) > 1 else COMMAND_LINE


# Inside a package: its modules and subpackages by level, lowest first. A module may import its
# own level's (without circles: test_no_import_circles) and the levels below; every module and
# subpackage of the package stands in its table.
LEVELS: dict[str, tuple[tuple[str, ...], ...]] = {
    "dflash_jax.models": (
        ("architecture", "registry", "sharding", "weight_maps"),  # configs, axis names, the weight-map engine
        ("hf_config", "kernels", "quantized"),  # config.json fields, Pallas kernels, quantized formats
        ("layers",),  # the mechanisms, each with its partition rules and multiply-adds
        ("family", "kind"),  # what a target family and a drafter kind declare
        ("families", "kinds"),  # one module each
        ("parameters", "transformer", "drafter_format", "drafter_config", "drafter"),  # the models
        ("formats",),  # checkpoints in and out
    ),
    "dflash_jax.models.layers": (
        ("attention", "basic", "cache", "chunking", "layer_stack"),
        ("block_attention", "mixers", "moe"),
        ("latent_attention", "linear_attention"),  # target mixers on mixers' inputs
    ),
    "dflash_jax.training": (
        ("mesh", "workdir", "warm_start"),
        ("optim",),
        ("head_terms", "objective"),
        ("kinds", "loss"),  # each drafter kind's loss terms, and the loss they make up
        ("config",),
        ("step",),
        ("checkpoint", "drafters", "monitoring", "acceptance_eval", "summary"),
        ("planning",),
        ("loop",),
    ),
    "dflash_jax.decoding": (
        ("draft_vocab", "http_client", "outputs", "prompt_sets", "report", "sampling"),
        ("drafting", "generate"),
        ("kinds",),  # each drafter kind's drafting walk
        ("speculative",),
        ("acceptance", "backends", "engines", "regeneration"),
        ("measurement",),
    ),
}


def level_violations(package: str, levels: tuple[tuple[str, ...], ...], graph: dict[str, set[str]]) -> list[str]:
    """What breaks `package`'s levels in an import graph of module names: a member (module or
    subpackage) that has no level or does not exist, a member importing a higher level's."""
    level = {member: n for n, members in enumerate(levels) for member in members}

    def member(module: str) -> str | None:
        return module[len(package) + 1 :].split(".")[0] if module.startswith(f"{package}.") else None

    members = {member(m) for m in graph} - {None}
    found = [f"{package}.{m} has no level in LEVELS" for m in sorted(members - set(level))]
    found += [f"{package}.{m} is in LEVELS but no module" for m in sorted(set(level) - members)]
    for module, imported in sorted(graph.items()):
        own = member(module)
        for target in sorted(imported):
            other = member(target)
            if own in level and other in level and level[other] > level[own]:
                found.append(f"{module} (level {level[own]} of {package}) imports {target} (level {level[other]})")
    return found


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules a file imports (`from a.b import c` imports a.b.c when that is a module)."""
    return set(imports(path)) & modules


MODULES = sorted(PACKAGE.rglob("*.py"))


def violations(name: str, path: Path) -> list[str]:
    """What in the module `name` (its source at `path`) breaks the layering rules."""
    own = layer_of(name)
    found = []
    for module in imports(path):
        if module.split(".")[0] in FORBIDDEN:
            found.append(f"{name} imports {module}")
        if module.startswith("dflash_jax.") and module.count(".") >= 1:
            target = layer_of(module)
            if target > own:
                found.append(f"{name} (layer {own}) imports {module} (layer {target}), a higher layer")
            elif own < COMMAND_LINE and target == COMMAND_LINE:
                found.append(f"{name} imports the command-line module {module}")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another, through others or directly (the strongly
    connected components of more than one module, or a module importing itself), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1 or node in graph.get(node, ()):
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def import_graph() -> dict[str, set[str]]:
    names = {module_name(p): p for p in MODULES}
    return {name: imported_modules(path, set(names)) for name, path in names.items()}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_point_down(path):
    assert violations(module_name(path), path) == []


@pytest.mark.parametrize("package", list(LEVELS))
def test_modules_import_only_their_level_or_below(package):
    assert level_violations(package, LEVELS[package], import_graph()) == []


def test_no_import_circles():
    """Imports inside functions and under TYPE_CHECKING count: they are circles all the same."""
    assert circles(import_graph()) == []


def test_the_check_can_fail(tmp_path):
    """A models module importing training, a command line and torch (inside a function too)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from dflash_jax.training.loop import train\ndef f():\n    import torch\n    from dflash_jax import evaluate\n"
    )
    found = violations("dflash_jax.models.bad", bad)
    assert any("imports torch" in v for v in found), found
    assert any("dflash_jax.training.loop (layer 4), a higher layer" in v for v in found), found
    assert any("imports dflash_jax.evaluate (layer 5)" in v for v in found), found
    assert violations("dflash_jax.training.bad", tmp_path / "bad.py") != []  # torch is never allowed
    assert layer_of("dflash_jax.training.loop") > layer_of("dflash_jax.models.transformer")
    # config -> sections -> step -> config, and a module importing itself, inside one package.
    graph = {"t.config": {"t.sections"}, "t.sections": {"t.step", "t.mesh"}, "t.step": {"t.config"}, "t.x": {"t.x"}}
    assert circles(graph) == [["t.config", "t.sections", "t.step"], ["t.x"]]
    modules = {"dflash_jax.models", "dflash_jax.models.families", "dflash_jax.models.architecture"}
    (tmp_path / "f.py").write_text(
        "from dflash_jax.models import families\nfrom dflash_jax.models.architecture import X\n"
    )
    assert imported_modules(tmp_path / "f.py", modules) == modules
    # Inside a package: a layer importing the model inside a function, a module with no level, a
    # level naming no module; importing the package itself or the same member is no violation.
    (tmp_path / "g.py").write_text("def f():\n    from dflash_jax.models.transformer import Transformer\n")
    graph = {
        "dflash_jax.models.layers.moe": imported_modules(tmp_path / "g.py", {"dflash_jax.models.transformer"}),
        "dflash_jax.models.transformer": {"dflash_jax.models", "dflash_jax.models.layers.moe"},
        "dflash_jax.models.layers.basic": {"dflash_jax.models.layers.moe"},
        "dflash_jax.models.extra": set(),
    }
    levels = (("layers",), ("transformer", "drafter"))
    assert level_violations("dflash_jax.models", levels, graph) == [
        "dflash_jax.models.extra has no level in LEVELS",
        "dflash_jax.models.drafter is in LEVELS but no module",
        "dflash_jax.models.layers.moe (level 0 of dflash_jax.models) imports dflash_jax.models.transformer (level 1)",
    ]
