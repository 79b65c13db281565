"""Three-row copies of the standard benchmarks, in the formats their datasets publish on the hub
(file path inside the dataset repository, columns and their types), written by hand."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

GSM8K = {
    "question": [
        "Tom has 3 apples and buys 2 more. How many apples does he have?",
        "A train travels 60 km in 1 hour. How far does it travel in 3 hours?",
        "Sara reads 5 pages a day. How many pages does she read in a week?",
    ],
    "answer": ["3 + 2 = 5\n#### 5", "60 * 3 = 180\n#### 180", "5 * 7 = 35\n#### 35"],
}
MATH500 = [
    {"problem": "What is $2+2$?", "solution": "$4$", "answer": "4", "subject": "Algebra", "level": 1, "unique_id": "a"},
    {
        "problem": "Solve $x^2=9$.",
        "solution": "$x=\\pm 3$",
        "answer": "3",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "b",
    },
    {"problem": "Compute $3!$.", "solution": "$6$", "answer": "6", "subject": "Counting", "level": 1, "unique_id": "c"},
]
HUMANEVAL = {
    "task_id": ["HumanEval/0", "HumanEval/1", "HumanEval/2"],
    "prompt": [
        'def add(a, b):\n    """Return a + b."""\n',
        'def neg(x):\n    """Return -x."""\n',
        'def first(xs):\n    """Return the first item."""\n',
    ],
    "canonical_solution": ["    return a + b\n", "    return -x\n", "    return xs[0]\n"],
    "test": ["assert add(1, 2) == 3", "assert neg(1) == -1", "assert first([4]) == 4"],
    "entry_point": ["add", "neg", "first"],
}
MBPP_SANITIZED = {
    "source_file": ["a.py", "b.py", "c.py"],
    "task_id": pa.array([2, 3, 4], pa.int32()),
    "prompt": [
        "Write a function to find the shared elements of two lists.",
        "Write a python function to identify non-prime numbers.",
        "Write a function to find the n largest integers of a list.",
    ],
    "code": ["def f(a, b): ...", "def g(n): ...", "def h(xs, n): ..."],
    "test_imports": pa.array([[], [], ["import heapq"]], pa.list_(pa.string())),
    "test_list": pa.array([["assert f([1], [1]) == {1}"], ["assert g(4)"], ["assert h([3, 1], 1) == [3]"]]),
}
MBPP_FULL = {
    "task_id": pa.array([11, 12, 13], pa.int32()),
    "text": [
        "Write a python function to remove the first and last occurrence of a character.",
        "Write a function to sort a matrix by the sum of its rows.",
        "Write a function to count the most common words in a dictionary.",
    ],
    "code": ["def a(): ...", "def b(): ...", "def c(): ..."],
    "test_list": pa.array([["assert a()"], ["assert b()"], ["assert c()"]]),
    "test_setup_code": ["", "", ""],
    "challenge_test_list": pa.array([[], [], []], pa.list_(pa.string())),
}
MT_BENCH = {
    "prompt": pa.array(
        [
            ["Write a short poem about the sea at night, with the moon and a small boat.", "Shorter."],
            ["Explain recursion to a child who can count, using a story about boxes inside boxes.", "Why?"],
            ["List three uses of a paperclip other than holding paper, and say why.", "Which is best?"],
        ]
    ),
    "prompt_id": pa.array([1, 2, 3], pa.int64()),
    "category": ["writing", "stem", "reasoning"],
    "reference": pa.array([[], [], []], pa.list_(pa.string())),
}
# lmsys FastChat's mt_bench question.jsonl: the same questions under `turns`.
MT_BENCH_LMSYS = [
    {"question_id": 81, "category": "writing", "turns": MT_BENCH["prompt"][0].as_py()},
    {"question_id": 82, "category": "stem", "turns": MT_BENCH["prompt"][1].as_py()},
    {"question_id": 83, "category": "reasoning", "turns": MT_BENCH["prompt"][2].as_py()},
]

# name -> (dataset id, path inside the repository, contents)
PUBLISHED = {
    "gsm8k": ("openai/gsm8k", "main/test-00000-of-00001.parquet", GSM8K),
    "math500": ("HuggingFaceH4/MATH-500", "test.jsonl", MATH500),
    "humaneval": ("openai/openai_humaneval", "openai_humaneval/test-00000-of-00001.parquet", HUMANEVAL),
    "mbpp": ("google-research-datasets/mbpp", "sanitized/test-00000-of-00001.parquet", MBPP_SANITIZED),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", "data/train-00000-of-00001-67c6c9fef07685a3.parquet", MT_BENCH),
}


def write_published(contents, path: Path) -> Path:
    """Parquet for column dicts, JSON Lines for row lists, as the datasets publish them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(contents, dict):
        pq.write_table(pa.table(contents), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in contents))
    return path


def published_bytes(name: str) -> dict[str, bytes]:
    """{path in the repository: file contents} of a benchmark's published test split."""
    _, path, contents = PUBLISHED[name]
    with tempfile.TemporaryDirectory() as tmp:
        return {path: write_published(contents, Path(tmp) / Path(path).name).read_bytes()}
