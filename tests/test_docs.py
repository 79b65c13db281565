"""Every figure the documents cite is the ledger's (docs/performance.md "The ledger").

A ledger row holds a figure's value, its command and the commit it was measured on; its first
cell is `<a id="ID"></a>`. A citation is a Markdown link to `performance.md#ID` whose text quotes
the row: each number of the text must be one of the row's value. The manuals (README.md,
docs/design.md and the notebook's text cells) state no measurement outside such a link. A row
whose figure links to its record (a section of docs/performance.md or docs/experiments.md, the
full output) has its figures in that record, rounded or not. And every link to a document's
anchor lands on a heading or an `<a id>` there.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LEDGER = "docs/performance.md"
NOTEBOOK = "colab/quickstart.ipynb"
# The manuals: every measurement they state is a citation.
MANUALS = ("README.md", "docs/design.md", NOTEBOOK)
# A GitHub address of a file of this repository, as the notebook links them (it runs in Colab).
GITHUB_FILE = re.compile(r"^https://github\.com/dflash-jax/dflash_jax/blob/[^/]+/")
# A number as the documents write them: 1,546 / 0.324 / 3.58e-07, not inside a name (float32,
# v5p, 8b); a speed-up's `x` may follow it.
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?(?=x\b|[^\w]|$)")
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
# What a measurement looks like in prose: a time, a speed, a share, a plan's GiB, a speed-up, τ.
MEASUREMENT = re.compile(
    r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?\s?(?:ms|s|min|minutes|hours?|h|GiB|TFLOP|(?:tokens|tok|steps|rows)/s|%)(?![\w/])"
    r"|(?<![\w.])\d+\.\d+\s?[x×](?!\w)"
    r"|(?:τ|\btau)\s*(?:=|≈|≥|of|is)?\s*\d+\.\d+"
)
ROW_ID = re.compile(r'^<a id="([a-z0-9-]+)"></a>')
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


@dataclass(frozen=True)
class Row:
    id: str
    value: str
    command: str
    measured_on: str
    record: str | None  # "docs/FILE.md#anchor": the section holding the full output


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text)


def as_float(number: str) -> float:
    return float(number.replace(",", ""))


def decimals(number: str) -> int:
    mantissa = number.replace(",", "").split("e")[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


def rounds_to(found: str, quoted: str) -> bool:
    """Whether `found` is `quoted`, or rounds to it at `quoted`'s decimals."""
    if "e" in quoted or "e" in found:
        return as_float(found) == as_float(quoted)
    return round(as_float(found), decimals(quoted)) == as_float(quoted)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def notebook_text(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def documents(root: Path) -> dict[str, str]:
    """README, docs/*.md and the notebook's text cells, by repository path."""
    docs = {"README.md": (root / "README.md").read_text(encoding="utf-8")}
    for path in sorted((root / "docs").glob("*.md")):
        docs[f"docs/{path.name}"] = path.read_text(encoding="utf-8")
    docs[NOTEBOOK] = notebook_text(root / NOTEBOOK)
    return docs


def target_path(doc: str, target: str) -> tuple[str, str] | None:
    """A link's (repository path, anchor), for a link to an anchor of a Markdown file here."""
    from_root = bool(GITHUB_FILE.match(target))
    target = GITHUB_FILE.sub("", target)
    if "#" not in target or "://" in target:
        return None
    path, anchor = target.split("#", 1)
    if not path:
        return doc, anchor
    if not path.endswith(".md"):
        return None
    parts = [] if from_root else list(Path(doc).parent.parts)
    for part in Path(path).parts:
        parts = parts[:-1] if part == ".." else [*parts, part]
    return "/".join(parts), anchor


def citations(doc: str, text: str) -> list[tuple[str, str]]:
    """(link text, row id) of every link to a ledger row."""
    found = []
    for label, target in LINK.findall(text):
        where = target_path(doc, target)
        if where and where[0] == LEDGER:
            found.append((label, where[1]))
    return found


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def ledger(text: str) -> dict[str, Row]:
    """The rows of the ledger table, by id."""
    section = text.split("\n## The ledger\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| <a id="):
            continue
        first, figure, value, command, measured_on = cells(line)
        row_id = ROW_ID.match(first).group(1)
        if row_id in rows:
            raise ValueError(f"{LEDGER}: two ledger rows with id {row_id}")
        record = None
        for _, target in LINK.findall(figure):
            where = target_path(LEDGER, target)
            if where:
                record = "#".join(where)
        rows[row_id] = Row(row_id, value, command, measured_on, record)
    return rows


def headings(text: str) -> list[tuple[int, str, int]]:
    """(level, anchor, offset) of each Markdown heading, outside indented code."""
    return [(len(m.group(1)), slug(m.group(2)), m.start()) for m in re.finditer(r"(?m)^(#{1,6}) (.+)$", text)]


def anchors(text: str) -> set[str]:
    return {a for _, a, _ in headings(text)} | set(re.findall(r'<a id="([^"]+)"', text))


def section(text: str, anchor: str) -> str | None:
    """The text under the heading `anchor`, up to the next heading of its level or above."""
    found = headings(text)
    for i, (level, name, start) in enumerate(found):
        if name == anchor:
            end = next((s for lvl, _, s in found[i + 1 :] if lvl <= level), len(text))
            return text[start:end]
    return None


def without_citations(doc: str, text: str, rows: dict[str, Row]) -> str:
    """The text with its citations and inline code taken out, other links reduced to their text."""

    def keep(match: re.Match) -> str:
        where = target_path(doc, match.group(2))
        return " " if where and where[0] == LEDGER and where[1] in rows else match.group(1)

    return LINK.sub(keep, re.sub(r"`[^`\n]*`", " ", text))


def problems(root: Path) -> list[str]:
    """Every disagreement between the documents under `root` and its ledger, one line each."""
    docs = documents(root)
    rows = ledger(docs[LEDGER])
    found = []
    for row in rows.values():
        if not row.command or not COMMIT.search(row.measured_on):
            found.append(f"ledger row {row.id}: no command, or no commit it was measured on")
        if row.record:
            path, anchor = row.record.split("#", 1)
            record = section(docs.get(path, ""), anchor)
            if record is None:
                found.append(f"ledger row {row.id}: its record {row.record} is no section")
                continue
            held = numbers(record)
            for number in numbers(row.value):
                if not any(rounds_to(h, number) for h in held):
                    found.append(f"ledger row {row.id}: {number} is not in its record {row.record}")
    for doc, text in docs.items():
        for label, row_id in citations(doc, text):
            if row_id not in rows:
                if row_id not in anchors(docs[LEDGER]):
                    found.append(f"{doc}: [{label}] links to {LEDGER}#{row_id}, which is no ledger row")
                continue
            value = [as_float(n) for n in numbers(rows[row_id].value)]
            for number in numbers(label):
                if as_float(number) not in value:
                    found.append(f"{doc}: [{label}] cites {number}, which ledger row {row_id} does not hold")
        for label, target in LINK.findall(text):
            where = target_path(doc, target)
            if where and where[0] in docs and where[1] not in anchors(docs[where[0]]):
                found.append(f"{doc}: [{label}] links to {'#'.join(where)}, an anchor that is not there")
        if doc in MANUALS:
            for line in without_citations(doc, text, rows).splitlines():
                for match in MEASUREMENT.finditer(line):
                    found.append(f"{doc}: {match.group(0)!r} ({line.strip()[:80]}...) is no link to a ledger row")
    return found


def test_the_documents_cite_the_ledger_as_it_is():
    assert problems(REPO) == []


def test_the_ledger_rows_name_commits_of_this_history():
    git = shutil.which("git")
    if not git or not (REPO / ".git").exists():
        pytest.skip("no git checkout here: the rows' commits cannot be looked up")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone: older commits are not here")
    rows = ledger((REPO / LEDGER).read_text(encoding="utf-8"))
    unknown = [
        f"{row.id}: {commit}"
        for row in rows.values()
        for commit in COMMIT.findall(row.measured_on)
        # An ancestor of HEAD, not merely an object here: a local clone also carries study branches' commits,
        # which a clean clone of main lacks.
        if subprocess.run(
            [git, "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO, capture_output=True
        ).returncode
    ]
    assert not unknown, f"ledger rows name commits that are not in HEAD's history: {unknown}"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The documents in a directory of their own, to change."""
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    (tmp_path / "colab").mkdir()
    shutil.copy(REPO / NOTEBOOK, tmp_path / NOTEBOOK)
    return tmp_path


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def add_notebook_text(path: Path, text: str) -> None:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    notebook["cells"].append({"cell_type": "markdown", "metadata": {}, "source": [text]})
    path.write_text(json.dumps(notebook), encoding="utf-8")


@pytest.mark.parametrize(
    ("where", "text", "expected"),
    [
        # The README's old figures for the device check, rounded from an earlier measurement.
        (
            "README.md",
            "\nXLA:GPU predicts [0.31 s fused / 0.52 s XLA](docs/performance.md#device-check-prediction).\n",
            "cites 0.31, which ledger row device-check-prediction does not hold",
        ),
        ("docs/design.md", "\nThe default run reaches [τ 2.41](performance.md#default-tau).\n", "cites 2.41"),
        ("docs/design.md", "\nSee [the row](performance.md#no-such-row).\n", "which is no ledger row"),
        ("README.md", "\nA DFlash2 step takes 0.44 s on a quiet CPU.\n", "'0.44 s'"),
        ("README.md", "\nThe default run reaches τ 2.31 here.\n", "'τ 2.31'"),
        ("README.md", "\nRead [the plan](docs/performance.md#no-such-heading).\n", "an anchor that is not there"),
        (NOTEBOOK, "On a CPU τ = 1.95 after 300 steps, about 5 minutes.", "'τ = 1.95'"),
    ],
)
def test_a_figure_that_is_not_the_ledgers_fails(copy, where, text, expected):
    assert problems(copy) == []
    if where == NOTEBOOK:
        add_notebook_text(copy / where, text)
    else:
        append(copy / where, text)
    assert any(expected in p for p in problems(copy)), problems(copy)


def test_a_ledger_figure_its_record_does_not_hold_fails(copy):
    path = copy / LEDGER
    text = path.read_text(encoding="utf-8")
    row = next(r for r in ledger(text).values() if r.record)
    first = numbers(row.value)[0]
    path.write_text(text.replace(row.value, row.value.replace(first, "987.654", 1), 1), encoding="utf-8")
    assert f"ledger row {row.id}: 987.654 is not in its record {row.record}" in problems(copy)
