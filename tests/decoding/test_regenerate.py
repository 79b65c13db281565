"""`python -m dflash_jax.regenerate`: both back-ends, per-row failures, resumption, user errors."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from dflash_jax import regenerate
from dflash_jax.decoding.backends import HttpBackend, JaxBackend, Regenerated
from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.http_client import ChatCompletionsClient
from dflash_jax.decoding.prompt_sets import ChatTokenizer
from dflash_jax.decoding.regeneration import Regeneration
from dflash_jax.decoding.sampling import GREEDY
from dflash_jax.errors import UserError
from dflash_jax.models.formats.hf import load_target
from support.chat_data import chat, write_jsonl
from support.hub_cache import use_hub_cache
from support.preset_files import add_published_datasets

ROWS = [
    chat("one", "old answer"),
    chat("two", "old", "two again", "old again", system="be brief"),  # two turns to rewrite
    chat("three"),  # prompt only: a response is appended
    {"id": "x", "conversations": [{"from": "human", "value": "four"}, {"from": "gpt", "value": "old"}]},
    "{this is not json",
    {"text": "no conversation"},
    chat("FAIL always"),
    chat("FLAKY once"),  # the first request gets a 503, the retry succeeds
    {"messages": []},
    {"conversations": [{"role": "user", "content": "ten"}]},  # ShareGPT turns spelled the OpenAI way
]
GOOD_LINES = {1, 2, 3, 4, 8, 10}
BAD_LINES = {5, 6, 7, 9}


class FakeOpenAI(BaseHTTPRequestHandler):
    """Speaks the chat-completions API: answers `reply to <last message> #<assistant turns so far>`."""

    requests: list[dict] = []
    flaky_seen = False

    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        last = body["messages"][-1]["content"]
        if "FAIL" in last:  # as vLLM answers a prompt longer than the context: not retried
            return self._send(400, {"error": "maximum context length exceeded"})
        if "FLAKY" in last and not type(self).flaky_seen:
            type(self).flaky_seen = True
            return self._send(503, {"error": "busy"})
        turns = sum(m["role"] == "assistant" for m in body["messages"])
        message = {"role": "assistant", "content": f"reply to {last} #{turns}"}
        if body["chat_template_kwargs"]["enable_thinking"]:
            message["reasoning_content"] = "thinking..."
        self._send(
            200,
            {
                "id": "c",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            },
        )


@pytest.fixture
def server():
    FakeOpenAI.requests, FakeOpenAI.flaky_seen = [], False
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def run_cli(args: list[str]) -> None:
    flag_values = flags.FlagValues()
    regenerate.define_flags(flag_values)
    flag_values(["regenerate", *args])
    regenerate.main([], flag_values)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def http_backend(url, **kw):
    client = ChatCompletionsClient(url, timeout=10, retries=1, backoff=0.01)
    return HttpBackend([client], concurrency=3, max_tokens=64, temperature=0.0, **kw)


def test_http_backend_rewrites_every_assistant_turn_and_records_failures(server, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    output = tmp_path / "out.jsonl"
    run_cli(
        [
            f"--input={source}",
            f"--output={output}",
            "--backend=http",
            f"--server_url={server}",
            "--target=served/name",  # the http back-end's --target: the name the server serves it under
            "--concurrency=3",
            "--max_new_tokens=64",
        ]
    )
    rows = {r["regenerated"]["line"]: r for r in read_jsonl(output)}
    assert set(rows) == GOOD_LINES
    assert rows[1]["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "reply to one #0"},
    ]
    # The second turn is asked with the first turn already regenerated.
    assert [m["content"] for m in rows[2]["messages"]] == [
        "be brief",
        "two",
        "reply to two #0",
        "two again",
        "reply to two again #1",
    ]
    assert rows[3]["messages"][-1] == {"role": "assistant", "content": "reply to three #0"}
    assert rows[4]["id"] == "x" and "conversations" not in rows[4]
    assert rows[4]["messages"][0] == {"role": "user", "content": "four"}
    assert rows[2]["regenerated"]["finish_reasons"] == ["stop", "stop"]
    failures = {f["line"]: f["error"] for f in read_jsonl(tmp_path / "out.failures.jsonl")}
    assert set(failures) == BAD_LINES
    assert "not valid JSON" in failures[5] and "no `messages`" in failures[6] and "HTTP 400" in failures[7]
    assert failures[9].endswith("the message list is empty")
    assert rows[10]["messages"][0] == {"role": "user", "content": "ten"}
    request = FakeOpenAI.requests[0]
    assert request["model"] == "served/name" and request["temperature"] == 0.0 and request["max_tokens"] == 64
    assert request["chat_template_kwargs"] == {"enable_thinking": False}


def test_reasoning_is_kept_apart_in_thinking_mode(server, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("think about it")])
    output = tmp_path / "out.jsonl"
    Regeneration(str(source), str(output)).run(http_backend(server, enable_thinking=True))
    message = read_jsonl(output)[0]["messages"][-1]
    assert message == {"role": "assistant", "content": "reply to think about it #0", "reasoning_content": "thinking..."}


class InterruptedBackend:
    """Answers like the fake server, then raises KeyboardInterrupt (Ctrl-C) after `rows` rows."""

    def __init__(self, rows: int):
        self.rows = rows

    def run(self, rows):
        for i, (line, messages) in enumerate(rows):
            if i == self.rows:
                raise KeyboardInterrupt
            yield line, Regenerated(messages + [{"role": "assistant", "content": f"r{line}"}], ["stop"])


def test_resumes_without_duplicating_or_losing_rows(server, tmp_path, capsys):
    rows = [chat(f"question {i}") for i in range(10)]
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        Regeneration(str(source), str(output)).run(InterruptedBackend(rows=3))
    assert [r["regenerated"]["line"] for r in read_jsonl(output)] == [1, 2, 3]

    # A run limited to 2 rows, then a crash in the middle of writing a row.
    counts = Regeneration(str(source), str(output)).run(http_backend(server), limit=2)
    assert counts == {"done_before": 3, "regenerated": 2, "failed": 0}
    with open(output, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "question 5"}], "regener')

    capsys.readouterr()
    run_cli([f"--input={source}", f"--output={output}", "--backend=http", f"--server_url={server}"])
    assert capsys.readouterr().out.endswith(f"5 rows regenerated into {output} (5 done before), 0 failed\n")
    lines = [r["regenerated"]["line"] for r in read_jsonl(output)]
    assert sorted(lines) == list(range(1, 11))
    assert len(FakeOpenAI.requests) == 7  # only the rows not done before were asked for
    assert FakeOpenAI.requests[-1]["model"] == "fake-model"  # no --target: the server's first model


def test_output_that_is_not_a_regeneration_is_refused(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("q")])
    output = write_jsonl(tmp_path / "out.jsonl", [chat("someone else's file")])
    with pytest.raises(UserError, match="out.jsonl:1 is not a regenerated row; is this the right --output"):
        Regeneration(str(source), str(output))  # before any back-end starts


def test_jax_backend_writes_the_targets_greedy_responses(chat_target, tmp_path):
    rows = [
        chat("What is the capital of France?", "Paris."),
        chat("hi", "hello", "and then?", "bye"),
        chat("Tell me a joke about cats."),
    ]
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    target = load_target(chat_target, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    tokenizer = ChatTokenizer(chat_target)
    backend = JaxBackend(target, tokenizer, max_new_tokens=6, batch_size=2, sampling=GREEDY, max_prompt_len=64)
    counts = Regeneration(str(source), str(output)).run(backend)
    assert counts["regenerated"] == 3 and counts["failed"] == 0
    out = {r["regenerated"]["line"]: r["messages"] for r in read_jsonl(output)}
    # Each response is the target's greedy continuation of the conversation before it.
    for line, messages in out.items():
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.prompt_ids(messages[:turn])
            expected = TargetDecoder(
                target, max_prompt_len=64, max_new_tokens=6, stop_tokens=tokenizer.stop_tokens
            ).generate([prompt])[0]
            assert message["content"] == tokenizer.response_text(expected.tokens), (line, turn)
    assert [m["role"] for m in out[2]] == ["user", "assistant", "user", "assistant"]
    assert np.all([m["content"] != "bye" for m in out[2]])


def closed_port_url() -> str:
    """The URL of a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input={source}", "--output={source}"], "--output={source} must differ from --input"),
        (["--input={missing}", "--output={output}"], "--input={missing}: data source '{missing}' does not exist"),
        (["--input={source}", "--output={output}"], "--target is required with --backend=jax"),
        (["--input={source}", "--output={output}", "--target={missing}"], "--target={missing}: no such directory"),
        (
            ["--input={source}", "--output={output}", "--backend=http", "--server_url={closed}", "--retries=0"],
            "--server_url={closed}: {closed}/models: nothing listens there (connection refused); start the server",
        ),
    ],
)
def test_user_errors_are_one_line_before_any_row_is_read(tmp_path, args, message):
    paths = dict(
        source=write_jsonl(tmp_path / "in.jsonl", [chat("q")]),
        output=tmp_path / "out.jsonl",
        missing=tmp_path / "missing",
        closed=closed_port_url(),
    )
    with pytest.raises(UserError) as raised:
        run_cli([a.format(**paths) for a in args])
    assert str(raised.value).startswith(message.format(**paths)) and "\n" not in str(raised.value)
    assert not paths["output"].exists()


@pytest.fixture
def servers():
    """Three fake servers, as one per GPU: each with its own request log."""
    started = []
    for i in range(3):
        handler = type(f"FakeOpenAI{i}", (FakeOpenAI,), {"requests": [], "flaky_seen": False})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append((httpd, handler))
    yield [(f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler) for httpd, handler in started]
    for httpd, _ in started:
        httpd.shutdown()
        httpd.server_close()


def test_rows_are_spread_over_several_servers_and_resume(servers, tmp_path):
    rows = [chat(f"question {i}", "old", f"again {i}", "old") for i in range(30)]
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    urls = ",".join(url for url, _ in servers)
    run_cli([f"--input={source}", f"--output={output}", "--backend=http", f"--server_url={urls}", "--limit=12"])
    run_cli([f"--input={source}", f"--output={output}", "--backend=http", f"--server_url={urls}", "--concurrency=2"])
    done = read_jsonl(output)
    assert sorted(r["regenerated"]["line"] for r in done) == list(range(1, 31))  # each row once
    asked = [handler.requests for _, handler in servers]
    assert sum(map(len, asked)) == 2 * 30  # two turns a row, nothing asked twice
    assert all(len(requests) >= 6 for requests in asked), [len(r) for r in asked]  # 20 each when even
    # Every turn of a conversation goes to one server (its prefix stays in that server's cache).
    for requests in asked:
        firsts = {r["messages"][0]["content"] for r in requests}
        seconds = {r["messages"][0]["content"] for r in requests if len(r["messages"]) > 1}
        assert seconds <= firsts


def test_a_preset_is_regenerated_from_the_hub_cache(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    use_hub_cache(monkeypatch, tmp_path / "hub")
    questions = add_published_datasets(tmp_path / "hub")
    for name in ("ultrachat", "sharegpt"):
        output = tmp_path / f"{name}.jsonl"
        run_cli([f"--input={name}", f"--output={output}", "--backend=http", f"--server_url={server}"])
        rows = sorted(read_jsonl(output), key=lambda r: r["regenerated"]["line"])
        assert [r["messages"][0]["content"] for r in rows] == questions[name]
        assert all(r["messages"][-1]["content"].startswith("reply to") for r in rows)
        assert not (tmp_path / f"{name}.failures.jsonl").exists()  # no row failed: no failures file
