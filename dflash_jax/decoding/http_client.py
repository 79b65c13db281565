"""A minimal OpenAI-compatible chat-completions client (vLLM, SGLang), on the standard library.

Every error is one line that starts with the URL asked. A `RequestError` is a request the server
refused for its content (HTTP 400, 413, 422: a prompt longer than the context, say): its row
fails alone. A `ServerError` is the server's own failure: nothing listens, the connection closed
mid-answer, no answer in time, any other HTTP error, an answer that is not JSON or not a chat
completion. Transient ones (connection errors, HTTP 408, 429 and 5xx, a body that is not JSON)
are retried with exponential back-off; a request that timed out is not (it would again).

`close()` cuts the requests in flight: their threads end at once instead of waiting out their
timeout. Connections go straight to the server (no HTTP proxy: servers are addressed directly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.client
import json
import socket
import threading
import urllib.parse

ROW_STATUSES = {400, 413, 422}  # the request's content was refused: its row fails alone
RETRYABLE_STATUSES = {408, 429, 500, 502, 503, 504}
# A live server lists its models at once and accepts a connection at once: a hang there is found
# in these seconds, not after a generation's timeout.
PROBE_TIMEOUT = 30.0
CONNECT_TIMEOUT = 30.0
EXCERPT_CHARS = 200


class RequestError(RuntimeError):
    """The server refused a request for its content."""


class ServerError(RequestError):
    """The server failed a request: unreachable, hung, broken or not an OpenAI-compatible API."""


class Unreachable(ServerError):
    """No connection to the server: nothing listens there, an unknown host, no connection in time."""


class NotAnApi(ServerError):
    """The server answers, but not as an OpenAI-compatible API: no JSON, no such path (HTTP 404)."""


class Cancelled(RequestError):
    """The client was closed while the request was in flight."""


class _NoConnection(ConnectionError):
    """Connecting timed out (a read that times out is not retried; this is)."""


UNREACHABLE = (ConnectionRefusedError, socket.gaierror, _NoConnection)  # no connection made


@dataclasses.dataclass(frozen=True)
class Reply:
    """An assistant message ({"role", "content"[, "reasoning_content"]}) and why it ended."""

    message: dict
    finish_reason: str


class ChatCompletionsClient:
    """Chat completions from the server at `base_url` (`http://host:port/v1`); without a `model`,
    the first one the server lists (asked here: a server that does not answer fails at once)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "",
        api_key: str = "",
        timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 1.0,
    ):
        self.base_url = base_url.rstrip("/")
        url = urllib.parse.urlsplit(self.base_url)
        try:
            port = url.port
        except ValueError:
            port = -1
        if url.scheme not in ("http", "https") or not url.hostname or port == -1:
            raise RequestError(f"{base_url}: not an http:// or https:// URL (e.g. http://localhost:8000/v1)")
        connection = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._connection = functools.partial(connection, url.hostname, port)
        self._path = url.path
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()  # the sockets of the requests in flight
        self._closed = threading.Event()
        self.model = model or self._first_model()

    def close(self) -> None:
        """Cuts the requests in flight (each raises `Cancelled` at once) and refuses new ones."""
        with self._lock:
            self._closed.set()
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _exchange(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        """One request on a new connection: (HTTP status, body)."""
        connection = self._connection(timeout=min(timeout, CONNECT_TIMEOUT))
        try:
            try:
                connection.connect()
            except TimeoutError:
                raise _NoConnection(f"no connection within {connection.timeout:g} s") from None
            sock = connection.sock
            sock.settimeout(timeout)
            with self._lock:
                if self._closed.is_set():
                    raise Cancelled(f"{self.base_url}{path}: cancelled")
                self._open.add(sock)
            try:
                connection.request(method, self._path + path, body, self._headers)
                response = connection.getresponse()
                return response.status, response.read()
            finally:
                with self._lock:
                    self._open.discard(sock)
        finally:
            connection.close()

    def _request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None):
        """The JSON the server answers, after retrying transient failures."""
        url, timeout = self.base_url + path, timeout or self.timeout
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                status, answer = self._exchange(method, path, data, timeout)
            except TimeoutError:
                raise ServerError(f"{url}: no answer within {timeout:g} s") from None
            except (OSError, http.client.HTTPException) as e:
                if self._closed.is_set():
                    raise Cancelled(f"{url}: cancelled") from None
                failure = Unreachable if isinstance(e, UNREACHABLE) else ServerError
                problem = _connection_problem(e)
            else:
                if 200 <= status < 300:
                    try:
                        return json.loads(answer)
                    except ValueError:
                        failure, problem = NotAnApi, f"the answer is not JSON: {_excerpt(answer)!r}"
                elif status in ROW_STATUSES:
                    raise RequestError(f"{url}: HTTP {status}: {_excerpt(answer)}")
                elif status in RETRYABLE_STATUSES:
                    failure, problem = ServerError, f"HTTP {status}: {_excerpt(answer)}"
                else:
                    raise (NotAnApi if status == 404 else ServerError)(f"{url}: HTTP {status}: {_excerpt(answer)}")
            if attempt == self.retries:
                raise failure(f"{url}: {problem}" + (f" ({attempt + 1} tries)" if attempt else ""))
            if self._closed.wait(self.backoff * 2**attempt):
                raise Cancelled(f"{url}: cancelled")
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        answer = self._request("GET", "/models", timeout=min(self.timeout, PROBE_TIMEOUT))
        models = answer.get("data") if isinstance(answer, dict) else None
        if models == []:
            raise RequestError(f"{self.base_url}/models lists no model; pass the model name")
        if not (isinstance(models, list) and isinstance(models[0], dict) and isinstance(models[0].get("id"), str)):
            raise NotAnApi(f"{self.base_url}/models: not an OpenAI model list: {_excerpt(json.dumps(answer))}")
        return models[0]["id"]

    def chat(
        self,
        messages: list[dict],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        enable_thinking: bool = False,
        seed: int | None = None,
    ) -> Reply:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            # Both vLLM and SGLang pass these to the chat template (Qwen3's thinking switch).
            "chat_template_kwargs": {"enable_thinking": enable_thinking},
        }
        if top_k:
            body["top_k"] = top_k
        if seed is not None:
            body["seed"] = seed
        response = self._request("POST", "/chat/completions", body)
        try:
            choice = response["choices"][0]
            content = choice["message"].get("content") or ""
            if not isinstance(content, str):
                raise TypeError
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ServerError(
                f"{self.base_url}/chat/completions: not a chat completion: {_excerpt(json.dumps(response))}"
            ) from None
        message = {"role": "assistant", "content": content}
        # Servers with a reasoning parser return the thinking separately (field name varies).
        reasoning = choice["message"].get("reasoning_content") or choice["message"].get("reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
        return Reply(message, choice.get("finish_reason") or "unknown")


def _connection_problem(error: Exception) -> str:
    """What went wrong with a connection, in words."""
    if isinstance(error, ConnectionRefusedError):
        return "nothing listens there (connection refused)"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    if isinstance(error, http.client.BadStatusLine):
        return f"the answer is not HTTP: {_excerpt(str(error.line))!r}"
    if isinstance(error, http.client.IncompleteRead):
        return f"the server closed the connection mid-answer ({len(error.partial)} bytes read)"
    if isinstance(error, socket.gaierror):
        return f"unknown host ({error.strerror})"
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


def _excerpt(data: bytes | str) -> str:
    """The start of a server's answer, on one line."""
    text = " ".join((data.decode("utf-8", "replace") if isinstance(data, bytes) else data).split())
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."
