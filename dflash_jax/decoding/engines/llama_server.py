"""llama.cpp in the loop: `llama-server` on a GGUF target, alone or with a drafter GGUF, greedy.

`LlamaServer` is an `EngineServer` (decoding/engines/server.py: the process, its bounded waits,
its one-line failures): its `complete` sends one prompt as token ids to `/completion` and reads
the engine's own counters from the reply's `timings`. `Drafting.convert` writes the drafter's GGUF.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflash_jax.decoding.engines.server import HOST, Completion, EngineServer, excerpt, free_port
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.gguf_export import served_kind, write_drafter_gguf


@dataclasses.dataclass(frozen=True)
class Drafting:
    """The drafter a server loads: its GGUF, llama.cpp's speculative type and the drafts per step."""

    gguf: Path
    spec_type: str  # the kind's `--spec-type` (`Kind.llama_cpp`)
    num_drafts: int

    @classmethod
    def convert(
        cls, export_dir: Path, target_gguf: Path, out_file: Path, draft_token_ids: np.ndarray | None = None
    ) -> Drafting:
        """The drafter exported at `export_dir`, written as GGUF to `out_file` for `target_gguf`
        (drafting among `draft_token_ids` if given)."""
        hf = json.loads((Path(export_dir) / "config.json").read_text())
        write_drafter_gguf(export_dir, target_gguf, out_file, draft_token_ids)
        return cls(Path(out_file), served_kind(hf).llama_cpp.spec_type, DrafterConfig.from_hf(hf).num_drafts)


class LlamaServer(EngineServer):
    engine = "llama.cpp's llama-server"
    times_a_forward = True  # `cache_prompt` reuses the prompt's cache: its `prompt_ms` times the rest

    def __init__(
        self,
        binary: Path,
        target: Path,
        drafting: Drafting | None = None,
        *,
        threads: int = 0,
        context: int = 4096,
        extra_args: Sequence[str] = (),
        start_timeout: float = 300.0,
        request_timeout: float = 600.0,
    ):
        port = free_port()
        cmd = [str(binary), "-m", str(target), "--host", HOST, "--port", str(port), "-c", str(context)]
        cmd += ["-np", "1", "--no-webui", "--temp", "0", "--top-k", "1"]
        if threads:
            cmd += ["-t", str(threads)]
        if drafting:
            # p-min 0: every draft proposed, as our decoder proposes them (llama.cpp may cut at a probability).
            cmd += ["--spec-type", drafting.spec_type, "--spec-draft-model", str(drafting.gguf)]
            cmd += ["--spec-draft-n-max", str(drafting.num_drafts), "--spec-draft-p-min", "0"]
        cmd += list(extra_args)
        super().__init__(cmd, port, start_timeout=start_timeout, request_timeout=request_timeout)

    def complete(self, prompt: Sequence[int], max_new_tokens: int, *, cache_prompt: bool = False) -> Completion:
        """`/completion` with the prompt as token ids (no template, no BOS added: the ids our
        decoder gets) and the reply's `timings`: tokens predicted and their milliseconds, drafted
        and accepted tokens, the prompt tokens run and theirs."""
        body = {
            "prompt": [int(t) for t in prompt],
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "stream": False,
        }
        reply = self.post("/completion", body)
        try:
            t = reply["timings"]
            predicted, accepted = int(t["predicted_n"]), int(t.get("draft_n_accepted", 0))
            return Completion(
                tokens=[int(token) for token in reply["tokens"]],
                steps=predicted - 1 - accepted,  # each adds its accepted drafts + 1 to the prefill's token
                drafted=int(t.get("draft_n", 0)),
                accepted=accepted,
                decode_tokens=predicted,
                decode_ms=float(t["predicted_ms"]),
                prompt_tokens=int(t.get("prompt_n", 0)),
                prompt_ms=float(t.get("prompt_ms", 0.0)),
            )
        except (KeyError, TypeError, ValueError):
            raise self.failed(f"/completion: not a completion with timings: {excerpt(json.dumps(reply))}") from None
