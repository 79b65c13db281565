"""Code-completion prompts from the stdlib conversations: the function's header to complete.

    python assets/build/completion_prompts.py --input assets/data/stdlib_train.jsonl \
        --output /tmp/stdlib_completion.jsonl --first 795 --last 1700

`stdlib_train.jsonl` asks for a function by its signature and docstring in prose; users also
paste code and ask for the rest of it, and the answer then repeats what they pasted. This turns
each conversation of input lines first..last (1-based) into that second kind:

    user:      Complete the following Python function:  ```python <decorators, def, docstring>```
    assistant: the function's own source, as in the input

so that a drafter trained on the target's answers to them (`python -m dflash_jax.regenerate`)
also learns to follow code that its context already holds. Ids gain the suffix `:complete`.
"""

from __future__ import annotations

import argparse
import ast
import json

PROMPT = "Complete the following Python function:\n```python\n{header}\n```"
FENCE, FENCE_END = "```python\n", "\n```"


def header(source: str) -> str | None:
    """The lines of `source` (one dedented function) up to the end of its docstring; None when
    it does not parse or has no docstring."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(func) is None:
        return None
    return "\n".join(source.splitlines()[: func.body[0].end_lineno])


def completion_record(record: dict) -> dict | None:
    answer = record["messages"][1]["content"]
    if not (answer.startswith(FENCE) and answer.endswith(FENCE_END)):
        return None
    head = header(answer[len(FENCE) : -len(FENCE_END)])
    if head is None:
        return None
    user = {"role": "user", "content": PROMPT.format(header=head)}
    return {"id": record["id"] + ":complete", "source": record["source"], "messages": [user, record["messages"][1]]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--first", type=int, default=1, help="first input line (1-based)")
    parser.add_argument("--last", type=int, default=0, help="last input line (0: the end)")
    args = parser.parse_args(argv)
    written = skipped = 0
    with open(args.input, encoding="utf-8") as src, open(args.output, "w", encoding="utf-8") as out:
        for number, line in enumerate(src, 1):
            if number < args.first or (args.last and number > args.last):
                continue
            record = completion_record(json.loads(line))
            if record is None:
                skipped += 1
                continue
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    print(f"wrote {written} prompts to {args.output} ({skipped} without a docstring to cut at)")


if __name__ == "__main__":
    main()
