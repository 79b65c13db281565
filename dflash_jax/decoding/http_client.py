"""A minimal OpenAI-compatible chat-completions client (vLLM, SGLang), on the standard library.

Transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried with exponential
back-off; other HTTP errors fail at once with the server's message.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class RequestError(RuntimeError):
    """The server refused or failed a request for good."""


@dataclasses.dataclass(frozen=True)
class Reply:
    """An assistant message ({"role", "content"[, "reasoning_content"]}) and why it ended."""

    message: dict
    finish_reason: str


class ChatCompletionsClient:
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
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code not in RETRYABLE_STATUS or attempt == self.retries:
                    raise RequestError(f"HTTP {e.code} from {self.base_url + path}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    raise RequestError(f"{self.base_url + path} unreachable: {e}") from None
            time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        models = self._request("/models").get("data") or []
        if not models:
            raise RequestError(f"{self.base_url}/models lists no model; pass the model name")
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
        response = self._request("/chat/completions", body)
        try:
            choice = response["choices"][0]
            message = {"role": "assistant", "content": choice["message"].get("content") or ""}
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RequestError(f"malformed chat completion: {json.dumps(response)[:300]}") from None
        # Servers with a reasoning parser return the thinking separately (field name varies).
        reasoning = choice["message"].get("reasoning_content") or choice["message"].get("reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
        return Reply(message, choice.get("finish_reason") or "unknown")
