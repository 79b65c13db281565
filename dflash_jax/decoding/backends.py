"""Response back-ends for `regenerate`: built-in batched JAX generation, or an OpenAI-compatible
server (vLLM / SGLang) for targets too large to run here.

Both take (row, messages) pairs and yield (row, Regenerated | Exception) as rows finish; a
failure belongs to its row and never stops the others, but a server that fails by its own errors
(dead, hung, answering garbage) stops the run (`ServerDown`). Every assistant turn is rewritten in
order, each from the conversation so far with the earlier turns already rewritten; a
conversation ending with a non-assistant turn gets one new assistant turn appended.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Generator, Iterable, Iterator

import numpy as np

from dflash_jax.decoding.generate import TargetDecoder, prompt_bucket
from dflash_jax.decoding.http_client import ChatCompletionsClient, Reply, ServerError
from dflash_jax.decoding.prompt_sets import ChatTokenizer
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class Regenerated:
    messages: list[dict]
    finish_reasons: list[str]


Rewriter = Generator[list[dict], Reply, Regenerated]


def rewrite_conversation(messages: list[dict]) -> Rewriter:
    """Yields the conversation so far whenever an assistant turn is due; `send` it the Reply."""
    out, reasons = [], []
    for message in messages:
        if message["role"] == "assistant":
            reply = yield list(out)
            out.append(reply.message)
            reasons.append(reply.finish_reason)
        else:
            out.append(message)
    if out[-1]["role"] != "assistant":
        reply = yield list(out)
        out.append(reply.message)
        reasons.append(reply.finish_reason)
    return Regenerated(out, reasons)


class JaxBackend:
    """Greedy or sampled target generation, `batch_size` conversations in lockstep."""

    def __init__(
        self,
        target: Transformer,
        chat: ChatTokenizer,
        *,
        max_new_tokens: int,
        batch_size: int,
        sampling: SamplingConfig,
        max_prompt_len: int,
        seed: int = 0,
    ):
        self.target, self.chat = target, chat
        self.max_new_tokens, self.batch_size, self.sampling = max_new_tokens, batch_size, sampling
        self.max_prompt_len, self.seed = max_prompt_len, seed

    def run(self, rows: Iterable[tuple[int, list[dict]]]) -> Iterator[tuple[int, Regenerated | Exception]]:
        rows = iter(rows)
        while chunk := list(itertools.islice(rows, self.batch_size)):
            yield from self._run_chunk(chunk)

    def _run_chunk(self, chunk):
        rewriters = {row: rewrite_conversation(messages) for row, messages in chunk}
        asks = {row: next(rewriter) for row, rewriter in rewriters.items()}
        while asks:
            prompts = {}
            for row, conversation in asks.items():
                try:
                    prompts[row] = self._prompt_ids(conversation)
                except Exception as e:  # a bad row fails alone
                    yield row, e
            if not prompts:
                break
            # A new seed per batch (greedy, the recipe's default, ignores it).
            replies = self._generate(list(prompts.values()), seed=self.seed + min(prompts))
            asks = {}
            for row, reply in zip(prompts, replies):
                try:
                    asks[row] = rewriters[row].send(reply)
                except StopIteration as done:
                    yield row, done.value

    def _prompt_ids(self, conversation: list[dict]) -> np.ndarray:
        ids = self.chat.prompt_ids(conversation)
        if len(ids) > self.max_prompt_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_prompt_len={self.max_prompt_len}")
        return ids

    def _generate(self, prompts: list[np.ndarray], seed: int) -> list[Reply]:
        # One decoder per prompt-length bucket: short batches do not pay for the longest prompt.
        decoder = TargetDecoder(
            self.target,
            max_prompt_len=min(prompt_bucket(max(map(len, prompts))), self.max_prompt_len),
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            sampling=self.sampling,
            stop_tokens=self.chat.stop_tokens,
        )
        replies = []
        for g in decoder.generate(prompts, seed=seed):
            stopped = len(g.tokens) and g.tokens[-1] in self.chat.stop_tokens
            message = {"role": "assistant", "content": self.chat.response_text(g.tokens)}
            replies.append(Reply(message, "stop" if stopped else "length"))
        return replies


DOWN_AFTER = 3  # conversations in a row a server fails by its own errors before the run stops


class ServerDown(Exception):
    """A server failed `DOWN_AFTER` conversations in a row by its own errors (`ServerError`: dead,
    hung, broken): every row would fail the same way, so the run stops; the rows in flight are
    left for the next run. A row the server refuses for its content (`RequestError`) fails alone."""

    def __init__(self, url: str, error: ServerError):
        super().__init__(f"{DOWN_AFTER} conversations in a row failed, the last: {error}")
        self.url = url


class HttpBackend:
    """One request per assistant turn, to one of several servers (one per GPU, say): each
    conversation goes, all its turns, to the server with the fewest in flight; up to
    `concurrency` conversations in flight per server. Raises `ServerDown` when a server fails."""

    def __init__(self, clients: list[ChatCompletionsClient], *, concurrency: int, **chat_kwargs):
        self.clients, self.concurrency, self.chat_kwargs = clients, concurrency, chat_kwargs

    def _rewrite(self, messages: list[dict], client: ChatCompletionsClient) -> Regenerated:
        rewriter = rewrite_conversation(messages)
        conversation = next(rewriter)
        while True:
            reply = client.chat(conversation, **self.chat_kwargs)
            try:
                conversation = rewriter.send(reply)
            except StopIteration as done:
                return done.value

    def run(self, rows: Iterable[tuple[int, list[dict]]]) -> Iterator[tuple[int, Regenerated | Exception]]:
        rows = iter(rows)
        slots = self.concurrency * len(self.clients)
        pool = concurrent.futures.ThreadPoolExecutor(slots)
        in_flight: dict[concurrent.futures.Future, tuple[int, int]] = {}  # future -> (row, server)
        load = [0] * len(self.clients)
        failing = [0] * len(self.clients)  # conversations failed in a row by each server's own errors
        try:
            while True:
                # Keep a bounded window in flight: the input can be far larger than memory.
                for row, messages in itertools.islice(rows, 2 * slots - len(in_flight)):
                    server = load.index(min(load))
                    load[server] += 1
                    in_flight[pool.submit(self._rewrite, messages, self.clients[server])] = row, server
                if not in_flight:
                    return
                finished, _ = concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
                down = None
                for future in finished:
                    row, server = in_flight.pop(future)
                    load[server] -= 1
                    error = future.exception()
                    failing[server] = failing[server] + 1 if isinstance(error, ServerError) else 0
                    if failing[server] >= DOWN_AFTER:
                        down = ServerDown(self.clients[server].base_url, error)
                    yield row, error if error is not None else future.result()
                if down:
                    raise down
        finally:
            if in_flight:  # stopped early: cut the requests in flight rather than wait them out
                for client in self.clients:
                    client.close()
            pool.shutdown(wait=True, cancel_futures=True)
