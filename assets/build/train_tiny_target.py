"""Train the bundled tiny Qwen3 target LM on the stdlib demo corpus.

Builds a byte-level BPE tokenizer on the training split, then trains a small
`transformers.Qwen3ForCausalLM` from scratch on CPU and saves a standard Hugging
Face directory (config, model.safetensors, tokenizer with chat template,
generation config, README with the figures, metrics.json).

The committed target was built with (after build_corpus.py):

    python assets/build/train_tiny_target.py --data assets/data --out assets/tiny-qwen3 \
        --seed 0 --steps 1200

A seconds-long build for tests:

    python assets/build/train_tiny_target.py --data /tmp/corpus --out /tmp/tiny \
        --steps 3 --vocab-size 512 --hidden-size 64 --intermediate-size 128 \
        --num-layers 2 --eval-docs 8

The loss covers every token of the rendered conversation (prompt and answer):
the docstrings in prompts are useful text, and the DFlash drafter reads the
target's features over the prompt too. Deterministic for a given seed and
thread count: seeded init, seeded batch order, deterministic torch algorithms.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import shlex
import sys
import time

# Token ids 0..5, in this order; <|MASK|> never occurs in the data: it is the
# DFlash drafter's mask token and only needs to be an existing embedding row.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|MASK|>"]
MASK_TOKEN = "<|MASK|>"

# ChatML as in Qwen3, without the thinking block and tool calls (the data has
# neither); extra arguments such as enable_thinking are accepted and ignored.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def read_jsonl(path: pathlib.Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_tokenizer(records: list[dict], vocab_size: int):
    """Byte-level BPE over the message texts; vocab_size includes the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Role headers included so that "assistant\n" etc. become single tokens.
    texts = [f"{m['role']}\n{m['content']}" for r in records for m in r["messages"]]
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, out: pathlib.Path, model_max_length: int):
    """Writes tokenizer.json and a Qwen-style tokenizer_config.json; returns the HF tokenizer."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": MASK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return AutoTokenizer.from_pretrained(out)


def encode(hf_tok, records: list[dict], max_len: int) -> list[list[int]]:
    """Token ids of each rendered conversation; longer ones are dropped, not cut."""
    seqs = []
    for r in records:
        text = hf_tok.apply_chat_template(r["messages"], tokenize=False)
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_len:
            seqs.append(ids)
    return seqs


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Seeded length-bucketed batches: shuffle, sort within windows of 32 batches, shuffle batches.

    Sorting only inside windows keeps padding low while batch composition
    still changes every epoch.
    """
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = 32 * batch_size
    batches = []
    for i in range(0, len(order), window):
        chunk = sorted(order[i : i + window], key=lambda j: lengths[j])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(seqs: list[list[int]], idx: list[int], pad_id: int):
    import torch

    width = max(len(seqs[i]) for i in idx)
    ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(idx), width), dtype=torch.long)
    for row, i in enumerate(idx):
        ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        mask[row, : len(seqs[i])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def evaluate(model, seqs: list[list[int]], pad_id: int, batch_size: int = 16) -> float:
    """Mean next-token loss per predicted token over all sequences."""
    import torch
    import torch.nn.functional as F

    model.eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(0, len(order), batch_size):
            ids, mask, labels = collate(seqs, order[k : k + batch_size], pad_id)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            target = labels[:, 1:]
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100, reduction="sum"
            ).item()
            count += int((target != -100).sum())
    model.train()
    return total / count


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(args, vocab_size: int, ids: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    return Qwen3ForCausalLM(config)


def train(args) -> dict:
    import torch
    import transformers

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t0, cpu0 = time.time(), time.process_time()  # CPU time: robust to a busy machine

    train_recs = read_jsonl(args.data / "stdlib_train.jsonl")
    heldout_recs = read_jsonl(args.data / "stdlib_heldout.jsonl")
    if args.max_train_docs:
        train_recs = train_recs[: args.max_train_docs]
    tok = train_tokenizer(train_recs, args.vocab_size)
    hf_tok = save_tokenizer(tok, args.out, args.max_position_embeddings)
    ids = {t: hf_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    pad_id = ids["<|endoftext|>"]

    train_seqs = encode(hf_tok, train_recs, args.max_len)
    eval_seqs = encode(hf_tok, heldout_recs[: args.eval_docs or None], args.max_len)
    if ids[MASK_TOKEN] in {t for s in train_seqs + eval_seqs for t in s}:
        raise ValueError(f"{MASK_TOKEN} occurs in the data; it must stay unused")
    lengths = [len(s) for s in train_seqs]

    model = build_model(args, len(hf_tok), ids)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]  # no decay on norm gains
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, int(args.warmup_frac * args.steps))
    print(
        f"{n_params:,} params, {len(train_seqs)} train / {len(eval_seqs)} held-out seqs, {sum(lengths):,} train tokens",
        flush=True,
    )

    log, epoch, step, recent = [], 0, 0, []
    while step < args.steps:
        for idx in epoch_batches(lengths, args.batch_size, args.seed, epoch):
            if step >= args.steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, warmup)
            ids_b, mask_b, labels_b = collate(train_seqs, idx, pad_id)
            loss = model(input_ids=ids_b, attention_mask=mask_b, labels=labels_b).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            recent = (recent + [loss.item()])[-50:]
            if step % args.log_every == 0 or step == args.steps:
                entry = {
                    "step": step,
                    "epoch": epoch,
                    "loss": round(sum(recent) / len(recent), 4),
                    "lr": opt.param_groups[0]["lr"],
                    "elapsed_s": round(time.time() - t0, 1),
                    "cpu_s": round(time.process_time() - cpu0, 1),
                }
                if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                    entry["heldout_loss"] = round(evaluate(model, eval_seqs, pad_id), 4)
                log.append(entry)
                print(json.dumps(entry), flush=True)
        epoch += 1

    heldout = evaluate(model, eval_seqs, pad_id)
    metrics = {
        "train_loss_last50": round(sum(recent) / len(recent), 4),
        "heldout_loss": round(heldout, 4),
        "heldout_perplexity": round(math.exp(heldout), 3),
        "params": n_params,
        "vocab_size": len(hf_tok),
        "mask_token_id": ids[MASK_TOKEN],
        "train_sequences": len(train_seqs),
        "train_tokens_per_epoch": sum(lengths),
        "heldout_sequences": len(eval_seqs),
        "epochs_seen": round(step * args.batch_size / len(train_seqs), 2),
        "train_time_s": round(time.time() - t0, 1),
        "train_cpu_s": round(time.process_time() - cpu0, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "log": log,
    }
    save_model(model, hf_tok, ids, args.out)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    write_readme(args.out, metrics, hf_tok)
    return metrics


def save_model(model, hf_tok, ids: dict, out: pathlib.Path) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        do_sample=False,
    )
    model.save_pretrained(out)
    # Also keep the classic top-level rope_theta that Qwen3 checkpoints carry,
    # for readers that do not know transformers 5's rope_parameters.
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_readme(out: pathlib.Path, m: dict, hf_tok) -> None:
    """The model card: how it was built and what it scored, from this run's figures."""
    a = m["args"]
    example = [{"role": "user", "content": "Implement `add(a, b)`:\n\nReturn a + b."}]
    rendered = hf_tok.apply_chat_template(example, tokenize=False, add_generation_prompt=True)
    sizes = "\n".join(
        f"| `{p.name}` | {p.stat().st_size:,} |"
        for p in sorted(out.iterdir())
        if p.is_file() and p.name not in ("README.md",)
    )
    specials = ", ".join(f"`{t}` = {hf_tok.convert_tokens_to_ids(t)}" for t in SPECIAL_TOKENS)
    text = f"""# tiny-qwen3: the bundled demo target

A {m["params"]:,}-parameter `Qwen3ForCausalLM` trained from scratch on the stdlib demo corpus
(`assets/data/`), so that `python train.py` can train a DFlash drafter in minutes on a CPU.
It is a demo asset, not a useful language model: it writes Python-stdlib-style functions.

## How it was built

    python assets/build/build_corpus.py --out assets/data --seed 0
    {a["command"]}

(python {m["python"]}, torch {m["torch"]}, transformers {m["transformers"]}, {a["threads"]} CPU
threads; deterministic for a given seed and thread count.)

- Tokenizer: byte-level BPE (`tokenizers`), trained on the training split only; vocab size
  {m["vocab_size"]} including the special tokens {specials}.
- **Mask token:** `<|MASK|>` = id **{m["mask_token_id"]}** (`tokenizer.mask_token_id`). It never
  occurs in the data; it exists only as the DFlash drafter's mask token (an existing
  embedding row).
- Model: {a["num_layers"]} layers, hidden {a["hidden_size"]}, {a["num_heads"]} heads /
  {a["num_kv_heads"]} KV heads, head_dim {a["head_dim"]}, intermediate {a["intermediate_size"]},
  tied embeddings, rope_theta 1e6, max positions {a["max_position_embeddings"]}; fp32 weights.
- Training: loss on every token of the rendered conversation (prompt and answer);
  conversations over {a["max_len"]} tokens dropped; AdamW (0.9, 0.95), lr {a["lr"]} with
  {a["warmup_frac"]:.0%} warmup and cosine decay to 10%, weight decay {a["weight_decay"]}
  on matrices, grad clip 1.0, {a["batch_size"]} conversations per step (length-bucketed),
  {a["steps"]} steps = {m["epochs_seen"]} epochs over {m["train_sequences"]:,} conversations
  ({m["train_tokens_per_epoch"]:,} tokens per epoch).

## Results

| | |
|---|---|
| training loss (mean of the last 50 steps) | {m["train_loss_last50"]} |
| held-out loss ({m["heldout_sequences"]} conversations from unseen source files) | {m["heldout_loss"]} |
| held-out perplexity | {m["heldout_perplexity"]} |
| training time | {m["train_time_s"] / 60:.1f} min wall, {m["train_cpu_s"] / 60:.1f} CPU-min ({a["threads"]} threads) |

The full curve is in `metrics.json` (`log`). Wall time depends on the machine's load; on an
idle 2-core machine the default model takes 0.6-1.1 s per step (15-25 min for 1200 steps
with evaluations).

## Chat template

ChatML as in Qwen3, without the thinking block (`enable_thinking` is accepted and ignored).
A one-turn conversation with `add_generation_prompt=True` renders as:

```
{rendered}```

`generation_config.json`: greedy, stops at `<|im_end|>` or `<|endoftext|>`.

## Files

| file | bytes |
|---|---|
{sizes}

## Licence

Code (the build scripts): Apache-2.0, as the rest of dflash_jax. Training data: functions and
docstrings of the CPython standard library, under the PSF License Agreement
(`assets/data/LICENSE-PSF.txt`); these weights are derived from it.
"""
    (out / "README.md").write_text(text)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="assets/data", type=pathlib.Path)
    p.add_argument("--out", default="assets/tiny-qwen3", type=pathlib.Path)
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--steps", default=1200, type=int)
    p.add_argument("--batch-size", default=16, type=int)
    p.add_argument("--lr", default=3e-3, type=float)
    p.add_argument("--warmup-frac", default=0.05, type=float)
    p.add_argument("--weight-decay", default=0.1, type=float)
    p.add_argument("--max-len", default=512, type=int, help="longer conversations are dropped")
    p.add_argument("--vocab-size", default=4096, type=int)
    p.add_argument("--hidden-size", default=256, type=int)
    p.add_argument("--intermediate-size", default=768, type=int)
    p.add_argument("--num-layers", default=4, type=int)
    p.add_argument("--num-heads", default=4, type=int)
    p.add_argument("--num-kv-heads", default=2, type=int)
    p.add_argument("--head-dim", default=64, type=int)
    p.add_argument("--max-position-embeddings", default=1024, type=int)
    p.add_argument("--max-train-docs", default=0, type=int, help="0 = all")
    p.add_argument("--eval-docs", default=0, type=int, help="held-out docs to score; 0 = all")
    p.add_argument("--eval-every", default=250, type=int, help="0 = only at the end")
    p.add_argument("--log-every", default=25, type=int)
    p.add_argument("--threads", default=2, type=int)
    args = p.parse_args(argv)
    args.command = "python assets/build/train_tiny_target.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return train(args)


if __name__ == "__main__":
    main()
