"""Build the bundled demo corpus from the CPython standard library.

Every documented function (or method) of the stdlib becomes one conversation:

    user:      Implement `name(args)` from module `pkg.mod`:  <docstring>
    assistant: the function's own source, dedented, in a ```python block

The stdlib is PSF-licensed, so the corpus is redistributable; the PSF licence
text is copied beside it. Train and held-out sets are split by *source file*
(a seeded hash of its path), so held-out prompts come from unseen modules.

The output is a pure function of (stdlib sources, seed, limits): files are
walked in sorted order, selection uses a seeded RNG, and JSON is written with
a fixed key order. The committed corpus was built with:

    python assets/build/build_corpus.py --out assets/data --seed 0

A small corpus for tests (a few packages only):

    python assets/build/build_corpus.py --out /tmp/corpus --only json email \
        --max-functions 50
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import random
import shutil
import sysconfig

# Test suites, the IDE, the 2to3 tool (with Python 2 fixtures), installed
# third-party packages and generated data files are not library code.
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "pydoc_data",
    "turtledemo",
}
# Strings the tokenizer treats as special tokens must never occur in the data.
SPECIAL_STRINGS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|MASK|>")
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: pathlib.Path, only: tuple[str, ...] = ()) -> list[str]:
    """Relative paths of the library's .py files, sorted."""
    paths = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(d in SKIP_DIRS or d.startswith("config-") for d in rel.parts[:-1]):
            continue
        if only and rel.parts[0].removesuffix(".py") not in only:
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def module_name(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _is_trivial(body: list[ast.stmt]) -> bool:
    """True for bodies with nothing to implement (pass, ..., raise NotImplementedError)."""
    if not body:
        return True
    if len(body) > 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    sig = f"{node.name}({ast.unparse(node.args)})"
    if node.returns is not None:
        sig += f" -> {ast.unparse(node.returns)}"
    return ("async " if isinstance(node, ast.AsyncFunctionDef) else "") + sig


def _dedented_source(lines: list[str], node) -> str | None:
    """The function's lines (decorators included) with its indentation removed.

    Strips exactly the def's indentation; returns None when a line (e.g. inside
    a multi-line string) is less indented, since dedenting would change it.
    """
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    indent = " " * node.col_offset
    out = []
    for line in lines[first - 1 : node.end_lineno]:
        if not line.strip():
            out.append("")
        elif line.startswith(indent):
            out.append(line[len(indent) :].rstrip())
        else:
            return None
    return "\n".join(out)


def extract(root: pathlib.Path, rel: str, max_lines: int, max_chars: int) -> list[dict]:
    """Conversations for the documented module-level functions and methods of one file."""
    text = (root / rel).read_text(encoding="utf-8")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    module = module_name(rel)
    found = [(n, None) for n in tree.body if isinstance(n, FUNCS)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        found += [(n, cls.name) for n in cls.body if isinstance(n, FUNCS)]

    out = []
    for node, cls in found:
        doc = ast.get_docstring(node)
        if not doc or _is_trivial(node.body[1:]):
            continue
        if node.end_lineno - node.lineno + 1 > max_lines:
            continue
        src = _dedented_source(lines, node)
        if src is None:
            continue
        if cls is None:
            prompt = f"Implement `{_signature(node)}` from module `{module}`:"
        else:
            prompt = f"Implement the method `{cls}.{_signature(node)}` from module `{module}`:"
        user = f"{prompt}\n\n{doc}"
        assistant = f"```python\n{src}\n```"
        if len(user) + len(assistant) > max_chars:  # keeps conversations under ~512 tokens
            continue
        if any(s in user + assistant for s in SPECIAL_STRINGS):
            continue
        qual = node.name if cls is None else f"{cls}.{node.name}"
        out.append(
            {
                "id": f"{rel}:{node.lineno}:{qual}",
                "source": rel,
                "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
            }
        )
    return out


def is_heldout(rel: str, seed: int, heldout_frac: float) -> bool:
    """Seeded hash of the source path: a whole file goes to one side of the split."""
    h = hashlib.sha256(f"{seed}:{rel}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < heldout_frac


def build_corpus(
    root: pathlib.Path,
    seed: int = 0,
    max_functions: int = 0,
    max_lines: int = 60,
    max_chars: int = 1700,
    heldout_frac: float = 0.06,
    num_prompts: int = 32,
    only: tuple[str, ...] = (),
) -> dict[str, list[dict]]:
    """Returns {"train", "heldout", "heldout_prompts"}: lists of records."""
    records, seen = [], set()
    for rel in source_files(root, tuple(only)):
        for rec in extract(root, rel, max_lines, max_chars):
            body = rec["messages"][1]["content"]
            if body in seen:  # identical code in two places would leak across the split
                continue
            seen.add(body)
            records.append(rec)

    rng = random.Random(seed)
    if max_functions and len(records) > max_functions:
        records = rng.sample(records, max_functions)
    records.sort(key=_file_order)

    train = [r for r in records if not is_heldout(r["source"], seed, heldout_frac)]
    heldout = [r for r in records if is_heldout(r["source"], seed, heldout_frac)]
    picked = rng.sample(heldout, min(num_prompts, len(heldout)))
    prompts = [
        {"id": r["id"], "source": r["source"], "messages": r["messages"][:1]} for r in sorted(picked, key=_file_order)
    ]
    return {"train": train, "heldout": heldout, "heldout_prompts": prompts}


def _file_order(rec: dict) -> tuple[str, int]:
    rel, line, _ = rec["id"].split(":", 2)
    return rel, int(line)


def write_jsonl(path: pathlib.Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_corpus(out: pathlib.Path, corpus: dict[str, list[dict]], root: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "stdlib_train.jsonl", corpus["train"])
    write_jsonl(out / "stdlib_heldout.jsonl", corpus["heldout"])
    write_jsonl(out / "heldout_prompts.jsonl", corpus["heldout_prompts"])
    licence = root / "LICENSE.txt"  # CPython installs its licence beside the stdlib
    if licence.exists():
        shutil.copyfile(licence, out / "LICENSE-PSF.txt")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="assets/data", type=pathlib.Path)
    p.add_argument(
        "--stdlib", default=None, type=pathlib.Path, help="stdlib directory (default: the running interpreter's)"
    )
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--max-functions", default=0, type=int, help="0 = all")
    p.add_argument("--max-lines", default=60, type=int)
    p.add_argument("--max-chars", default=1700, type=int, help="cap on user + assistant characters")
    p.add_argument("--heldout-frac", default=0.06, type=float)
    p.add_argument("--num-prompts", default=32, type=int)
    p.add_argument("--only", nargs="*", default=(), help="restrict to these top-level modules/packages")
    a = p.parse_args(argv)
    root = a.stdlib or stdlib_dir()
    corpus = build_corpus(
        root, a.seed, a.max_functions, a.max_lines, a.max_chars, a.heldout_frac, a.num_prompts, tuple(a.only)
    )
    write_corpus(a.out, corpus, root)
    for k, v in corpus.items():
        print(f"{k}: {len(v)} records, {len({r['source'] for r in v})} source files")


if __name__ == "__main__":
    main()
