"""`regenerate --backend=http` against hostile servers on real sockets (127.0.0.1): a server that
answers garbage, HTTP 500 or 404, hangs, cuts its answer, or dies mid-run. Each ends in bounded
time with one line naming `--server_url`, exit status 1, no thread left behind, per-row errors that
name the server, and on disk only what was done: the rows regenerated, the rows still failing."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from absl import flags

from dflash_jax import regenerate
from dflash_jax.decoding.backends import DOWN_AFTER
from dflash_jax.errors import UserError
from support.chat_data import chat, write_jsonl
from support.stderr import user_lines
from support.training_runs import REPO

# What a server does with a request: answer, or one way of failing.
BEHAVIOURS = ("ok", "garbage", "500", "404", "400", "hang", "close")
GARBAGE = b"<html>\n<body>502 Bad Gateway</body>\n</html>"  # a proxy's page: not JSON, several lines
HANG_SECONDS = 120  # longer than any test waits: a hung request must be cut, not waited out
# The flags of every run: one retry, a short timeout (a hang ends the run in seconds).
QUICK = ["--backend=http", "--retries=1", "--request_timeout=1", "--concurrency=2", "--max_new_tokens=8"]


class HostileHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        self.server.hostile.listed.set()
        self._behave(self.server.hostile.models, {"object": "list", "data": [{"id": "hostile", "object": "model"}]})

    def do_POST(self):
        hostile = self.server.hostile
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1]["content"]
        # A row's first word picks its own behaviour (`500 please`), unless forgiven.
        word = last.split()[0]
        behaviour = word if word in BEHAVIOURS and last not in hostile.forgiven else hostile.chat
        if not hostile.admit(behaviour):
            return  # dead: the connection closes unanswered, and the port closes
        message = {"role": "assistant", "content": f"reply to {last}"}
        self._behave(behaviour, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    def _behave(self, behaviour: str, answer: dict) -> None:
        if behaviour == "hang":
            self.server.hostile.release.wait(HANG_SECONDS)
            return
        if behaviour == "close":  # announces 200 bytes, sends 5, closes
            self.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n{"cho')
            return
        status, data = {
            "ok": (200, json.dumps(answer).encode()),
            "garbage": (200, GARBAGE),
            "500": (500, b"Internal Server Error"),
            "404": (404, b'{"detail": "Not Found"}'),
            "400": (400, b'{"error": "maximum context length exceeded"}'),
        }[behaviour]
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class HostileServer:
    """An OpenAI-compatible server on 127.0.0.1 that lists its models as `models` says and answers
    chats as `chat` says (a row's first word can override it); after `dies_after` answers it dies:
    the request in hand closes unanswered and the port closes."""

    def __init__(self, models: str = "ok", chat: str = "ok", dies_after: int | None = None):
        self.models, self.chat, self.dies_after = models, chat, dies_after
        self.answered = 0
        self.listed = threading.Event()  # set once a client has asked for the models
        self.forgiven: set[str] = set()  # rows answered whatever their first word says
        self.release = threading.Event()  # ends the hung requests at teardown
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), HostileHandler)
        self.httpd.daemon_threads = True
        self.httpd.hostile = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def admit(self, behaviour: str) -> bool:
        """Whether a chat is served (and counted if answered): not once the server has died."""
        with self._lock:
            if self.dies_after is not None and self.answered >= self.dies_after:
                if not self._stopped.is_set():
                    self._stopped.set()
                    threading.Thread(target=self._stop).start()
                return False
            self.answered += behaviour == "ok"
            return True

    def _stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def close(self) -> None:
        self.release.set()
        if not self._stopped.is_set():
            self._stopped.set()
            self._stop()


@pytest.fixture
def hostile():
    """`hostile(models=..., chat=..., dies_after=...)` starts a server; all are closed at teardown."""
    started = []

    def start(**behaviour) -> HostileServer:
        started.append(HostileServer(**behaviour))
        return started[-1]

    yield start
    for server in started:
        server.close()


def closed_port_url() -> str:
    """The URL of a port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def run_cli(args: list[str]) -> None:
    flag_values = flags.FlagValues()
    regenerate.define_flags(flag_values)
    flag_values(["regenerate", *args])
    regenerate.main([], flag_values)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def pool_threads() -> list[threading.Thread]:
    """The back-end's request threads still alive."""
    return [t for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor")]


def names_the_server(failure: dict, url: str) -> bool:
    """A failure record's error is `ErrorClass: URL/chat/completions: what went wrong`."""
    return failure["error"].split(": ", 1)[1].startswith(f"{url}/chat/completions: ")


def refused(args: list[str]) -> tuple[str, float]:
    """(the one-line message, seconds taken) of a run that must end in a UserError."""
    start = time.monotonic()
    with pytest.raises(UserError) as raised:
        run_cli(args)
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message, time.monotonic() - start


# What each failure at start-up says after `--server_url=URL: URL/models: `.
AT_START_UP = {
    "garbage": "the answer is not JSON: '<html> <body>502 Bad Gateway</body> </html>' (2 tries); "
    "is it an OpenAI-compatible API's base URL (http://host:port/v1)?",
    "500": "HTTP 500: Internal Server Error (2 tries)",
    "404": 'HTTP 404: {"detail": "Not Found"}; is it an OpenAI-compatible API\'s base URL (http://host:port/v1)?',
    "hang": "no answer within 1 s",
    "close": "the server closed the connection mid-answer (5 bytes read) (2 tries)",
}


@pytest.mark.parametrize("behaviour", AT_START_UP)
def test_a_server_failing_at_start_up_is_one_line_and_leaves_nothing(hostile, tmp_path, behaviour):
    server = hostile(models=behaviour)
    source, output = write_jsonl(tmp_path / "in.jsonl", [chat("q")]), tmp_path / "new" / "out.jsonl"
    message, seconds = refused([f"--input={source}", f"--output={output}", f"--server_url={server.url}", *QUICK])
    assert message == f"--server_url={server.url}: {server.url}/models: {AT_START_UP[behaviour]}"
    assert seconds < 15  # one retry a second apart, or one timeout of a second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no output, no failures file, no directory


@pytest.mark.parametrize(
    "url, problem",
    [
        (
            closed_port_url(),
            "{url}/models: nothing listens there (connection refused) (2 tries); start the server first",
        ),
        ("localhost:8000", "localhost:8000: not an http:// or https:// URL (e.g. http://localhost:8000/v1)"),
    ],
    ids=["closed_port", "not_a_url"],
)
def test_no_server_at_the_url_is_one_line(tmp_path, url, problem):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("q")])
    message, _ = refused([f"--input={source}", f"--output={tmp_path / 'out.jsonl'}", f"--server_url={url}", *QUICK])
    assert message.startswith(f"--server_url={url}: " + problem.format(url=url)), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# What the last of the failures that stop a run says after `URL/chat/completions: `.
PER_ROW = {
    "garbage": "the answer is not JSON: '<html> <body>502 Bad Gateway</body> </html>' (2 tries)",
    "500": "HTTP 500: Internal Server Error (2 tries)",
    "404": 'HTTP 404: {"detail": "Not Found"}',
    "hang": "no answer within 1 s",
    "close": "the server closed the connection mid-answer (5 bytes read) (2 tries)",
}


@pytest.mark.parametrize("behaviour", PER_ROW)
def test_a_server_failing_every_row_stops_the_run_in_one_line(hostile, tmp_path, behaviour):
    server = hostile(chat=behaviour)
    source = write_jsonl(tmp_path / "in.jsonl", [chat(f"question {i}") for i in range(12)])
    output = tmp_path / "out.jsonl"
    message, seconds = refused([f"--input={source}", f"--output={output}", f"--server_url={server.url}", *QUICK])
    prefix = f"--server_url={server.url}: stopped: {DOWN_AFTER} conversations in a row failed, the last: "
    assert message == (
        f"{prefix}{server.url}/chat/completions: {PER_ROW[behaviour]}; 0 rows regenerated into {output} in "
        "this run, rerun the same command to go on"
    )
    assert seconds < 20 and not pool_threads()
    assert not output.exists()  # nothing regenerated: no output file
    failures = read_jsonl(tmp_path / "out.failures.jsonl")
    # The rows that failed before the run stopped, each once, each naming the server; not all 12.
    lines = [f["line"] for f in failures]
    assert DOWN_AFTER <= len(lines) < 12 and len(set(lines)) == len(lines)
    assert all(names_the_server(f, server.url) for f in failures)


def test_hung_requests_in_flight_are_cut_when_the_run_stops(hostile, tmp_path):
    """Three rows fail at once while five hang with a minute's timeout: the run stops after the
    three, cutting the five instead of waiting a minute for them."""
    server = hostile()
    rows = [chat(f"500 please {i}") for i in range(3)] + [chat(f"hang please {i}") for i in range(5)]
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = [f"--input={source}", f"--output={output}", f"--server_url={server.url}", "--backend=http"]
    message, seconds = refused([*args, "--retries=0", "--request_timeout=60", "--concurrency=8"])
    assert message.startswith(f"--server_url={server.url}: stopped: {DOWN_AFTER} conversations in a row failed")
    assert seconds < 15 and not pool_threads()
    # The hung rows were cut, not failed: only the three that failed are listed.
    assert sorted(f["line"] for f in read_jsonl(tmp_path / "out.failures.jsonl")) == [1, 2, 3]


def test_a_server_dying_mid_run_stops_it_and_a_rerun_finishes(hostile, tmp_path):
    dying = hostile(dies_after=4)
    source = write_jsonl(tmp_path / "in.jsonl", [chat(f"question {i}") for i in range(12)])
    output = tmp_path / "out.jsonl"
    message, seconds = refused([f"--input={source}", f"--output={output}", f"--server_url={dying.url}", *QUICK])
    assert message.startswith(f"--server_url={dying.url}: stopped: {DOWN_AFTER} conversations in a row failed")
    assert message.endswith(f"4 rows regenerated into {output} in this run, rerun the same command to go on")
    assert seconds < 20 and not pool_threads()
    done = {r["regenerated"]["line"] for r in read_jsonl(output)}
    assert len(done) == 4  # every answer the server gave is kept
    failures = read_jsonl(tmp_path / "out.failures.jsonl")
    assert all(names_the_server(f, dying.url) for f in failures)
    assert not done & {f["line"] for f in failures}

    # The server is back (on another port): the rerun does the rest, and no row is failing.
    server = hostile()
    run_cli([f"--input={source}", f"--output={output}", f"--server_url={server.url}", *QUICK])
    assert sorted(r["regenerated"]["line"] for r in read_jsonl(output)) == list(range(1, 13))
    assert server.answered == 8  # only the rows not done before were asked for
    assert not (tmp_path / "out.failures.jsonl").exists()


def test_the_failures_file_lists_exactly_the_rows_still_failing(hostile, tmp_path):
    """Rows the server refuses for their content (HTTP 400) fail alone; the run goes on. After a
    rerun in which one of them succeeds, only the other is listed."""
    server = hostile()
    rows = [chat("400 too long"), chat("fine"), chat("400 also too long"), chat("fine again")]
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = [f"--input={source}", f"--output={output}", f"--server_url={server.url}", *QUICK]
    run_cli(args)
    failures = read_jsonl(tmp_path / "out.failures.jsonl")
    assert [f["line"] for f in failures] == [1, 3]
    assert failures[0]["error"] == (
        f'RequestError: {server.url}/chat/completions: HTTP 400: {{"error": "maximum context length exceeded"}}'
    )
    server.forgiven.add("400 too long")
    run_cli(args)
    assert [f["line"] for f in read_jsonl(tmp_path / "out.failures.jsonl")] == [3]
    assert sorted(r["regenerated"]["line"] for r in read_jsonl(output)) == [1, 2, 4]


def test_an_output_directory_that_does_not_exist_is_made_with_the_first_row(hostile, tmp_path):
    server = hostile()
    source, output = write_jsonl(tmp_path / "in.jsonl", [chat("q")]), tmp_path / "new" / "deeper" / "out.jsonl"
    run_cli([f"--input={source}", f"--output={output}", f"--server_url={server.url}", *QUICK])
    assert [r["regenerated"]["line"] for r in read_jsonl(output)] == [1]
    assert sorted(p.name for p in output.parent.iterdir()) == ["out.jsonl"]  # no failures file


@pytest.mark.parametrize(
    "data, problem",
    [
        ("q".encode("utf-16"), "the file is UTF-16 (it starts with a UTF-16 byte-order mark); convert it to UTF-8"),
        (json.dumps([chat("q")]).encode(), "the file is a JSON array, not JSON Lines: write one object per line"),
    ],
    ids=["utf16", "json_array"],
)
def test_a_refused_input_is_one_line_before_the_server_is_asked_and_leaves_no_file(hostile, tmp_path, data, problem):
    server = hostile()
    source = tmp_path / "in.jsonl"
    source.write_bytes(data)
    message, _ = refused(
        [f"--input={source}", f"--output={tmp_path / 'new' / 'out.jsonl'}", f"--server_url={server.url}", *QUICK]
    )
    assert message == f"--input={source}: {source}: {problem}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no output, failures file or directory
    assert not server.listed.is_set()


# The programs. ---------------------------------------------------------------------------------


def run_regenerate(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "dflash_jax.regenerate", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    return result, time.monotonic() - start


def error_lines(stderr: str) -> list[str]:
    """stderr without the progress bar, which tqdm draws there (each redraw after a carriage return
    or a newline)."""
    return [line for line in user_lines(stderr) if line.strip() and not line.startswith(("\r", "regenerate:"))]


@pytest.mark.slow
def test_the_command_with_a_garbage_server_is_one_line(hostile, tmp_path):
    server = hostile(models="garbage")
    source, output = write_jsonl(tmp_path / "in.jsonl", [chat("q")]), tmp_path / "out.jsonl"
    result, _ = run_regenerate(f"--input={source}", f"--output={output}", f"--server_url={server.url}", *QUICK)
    line = f"error: --server_url={server.url}: {server.url}/models: {AT_START_UP['garbage']}"
    assert (result.returncode, result.stdout, user_lines(result.stderr)) == (1, "", [line])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.slow
def test_the_command_with_a_dying_server_ends_in_one_line_leaving_no_thread(hostile, tmp_path):
    """The server dies after two answers while a row hangs with a minute's timeout: the process
    exits in seconds (a request thread left waiting would keep it alive a minute)."""
    server = hostile(dies_after=2)
    rows = [chat("hang on"), *(chat(f"question {i}") for i in range(8))]
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = [f"--input={source}", f"--output={output}", f"--server_url={server.url}", "--backend=http"]
    result, seconds = run_regenerate(*args, "--retries=1", "--request_timeout=60", "--concurrency=2")
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith(f"error: --server_url={server.url}: stopped: {DOWN_AFTER} conversations in a row failed")
    assert line.endswith(f"2 rows regenerated into {output} in this run, rerun the same command to go on")
    assert seconds < 60
    assert len(read_jsonl(output)) == 2
    assert 1 not in {f["line"] for f in read_jsonl(tmp_path / "out.failures.jsonl")}  # the hung row was cut
