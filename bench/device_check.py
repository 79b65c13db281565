"""One-device check of an accelerator for training: prints one JSON line (progress on stderr).

    bash bench/device_check.sh            # Qwen3-8B-shaped, one H100/H200, under 8 minutes
    bash bench/device_check.sh --tiny     # tiny shapes, any machine (CPU: kernels interpreted)

What it measures, in this order:

* parity: a small Qwen3-shaped target (head_dim 128, GQA 4) and drafter with random weights on
  packed rows, against the fp32 XLA reference at the highest matmul precision on this device:
  the fused kernels in fp32 and in bf16, and the XLA path in bf16 (for scale). Target: the
  context features; drafter: its output hidden states and the gradient of a fixed projection of
  them with respect to every drafter weight. Each error is relative: max|x - ref| / max|ref|
  (features, hidden) or ‖g - g_ref‖ / ‖g_ref‖ (gradients).
* train step: the real jitted train step (frozen target, drafter forward/backward, AdamW) on a
  Qwen3-8B-shaped problem that fits one device — the 36-layer target in bf16 read up to layer
  33, the 5-layer drafter of configs/qwen3.py:8b with remat, 2 rows x 3072 tokens (one device's
  share of the 16-row global batch on 8 devices), 512 blocks of 16 per row — with the fused
  attention and again with the XLA attention. tokens/s counts real (non-padding) tokens; MFU =
  model FLOPs per step (`bench/train_step.py`: the XLA path's work, i.e. causal attention by
  tiles below the diagonal and every block against its whole row; the same numerator for both
  paths, so their MFUs compare) / step time / the device's dense bf16 peak (table below; None
  for a device not in it). A measured bf16 matmul peak is reported beside it.
  Beside each, the roofline estimate of the same compiled step (`dflash_jax/training/planning/roofline.py`:
  its kernels' matmul FLOPs and memory traffic at the device's published peak and bandwidth; on
  a CPU, measured): predicted step time and its ratio to the measured one. The fused path's
  Pallas kernels count the FLOPs they state for rows of one document (models/kernels/cost.py);
  their runs are reported.
* peak device memory (bytes in use at the high-water mark, as the runtime reports it) after the
  fused step, and again after the XLA step; beside it and the step time, what `plan --hardware`
  predicts for the same step compiled for this part by its own compiler without it
  (`compiled_peak_memory_gb`, `compiled_step_s`; --compile_for names another part, e.g. h200
  from a CPU; None where the part is not listed or its compiler not installed).
* decode: one target-alone step vs one DFlash step (draft a block of 16 + verify it) after a
  2048-token prompt, bench/dflash_step.py's measurement: DFlash speeds decoding up by about
  τ / cost_ratio.

--tiny shrinks every shape so the script runs anywhere in a few minutes (the kernels run in
Pallas interpret mode off GPU); its figures only show that the script works. --parts runs a
subset (parity, step, decode), e.g. to split the check into two calls if compiling the 8B step
twice takes longer than expected; `--parts=predict --compile_for=h200` on a CPU machine with the
gpu-compile extra gives the prediction alone, for a GPU whose environment lacks that compiler.
A part that fails is reported as its one-line error and the others still run; the exit status
is then 1.
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import json
import sys
import time

import dflash_step
import jax
import jax.numpy as jnp
import numpy as np
import train_step
from flax import nnx

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.layers import attention, block_attention
from dflash_jax.models.transformer import Transformer
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.config.schema import base_config
from dflash_jax.training.planning import compilers, hardware, roofline
from dflash_jax.training.planning import memory as planning

# Dense bf16 tensor-core peaks, TFLOP/s, of GPUs the planner does not list (first match wins); the
# listed parts' peaks are in their records (training/planning/hardware.py).
UNLISTED_PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.4),
    ("H800", 989.4),
    ("A100", 312.0),
)

QWEN3_8B = TransformerConfig(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope=RopeConfig(1_000_000.0),
)
TINY = TransformerConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope=RopeConfig(1_000_000.0),
)
# The parity model: Qwen3's head layout (head_dim 128, 4 query heads per kv head), small.
PARITY = TransformerConfig(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2048,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    rope=RopeConfig(1_000_000.0),
)


def log(message: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_bf16_tflops(kind: str) -> float | None:
    part = hardware.for_device_kind(kind)
    if part is not None:
        return part.matmul_flops / 1e12
    return next((peak for name, peak in UNLISTED_PEAK_BF16_TFLOPS if name in kind), None)


def roofline_hardware(kind: str) -> roofline.Hardware | None:
    """The figures the roofline estimate uses: published for a listed part, measured on a CPU."""
    if jax.default_backend() == "cpu":
        return roofline.hardware(hardware.CPU)
    part = hardware.for_device_kind(kind)
    return None if part is None else roofline.hardware(part.name)


def peak_memory_gb() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else round(peak / 2**30, 2)


def _significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _relative(x, ref) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


def _relative_norm(xs, refs) -> float:
    num = sum(float(np.sum((np.asarray(x, np.float32) - np.asarray(r, np.float32)) ** 2)) for x, r in zip(xs, refs))
    den = sum(float(np.sum(np.asarray(r, np.float32) ** 2)) for r in refs)
    return float(np.sqrt(num / max(den, 1e-30)))


def parity(cfg: TransformerConfig, *, rows: int, seq_len: int, num_blocks: int, block_size: int) -> dict:
    """Relative errors against the fp32 XLA reference (see the module docstring)."""
    layer_ids = (1, cfg.num_layers - 1)
    rng = np.random.default_rng(0)
    batch = packed_batch(rng, rows, seq_len, cfg.vocab_size - 1, doc_len=(seq_len // 8, seq_len // 2))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    seg = np.asarray(batch["segment_ids"])
    anchors = np.stack([np.sort(rng.choice(np.flatnonzero(s), num_blocks, replace=False)) for s in seg])
    anchors = jnp.asarray(anchors, jnp.int32)
    ctx_mask = block_attention.block_context_mask(batch["segment_ids"], anchors)
    block_positions = jnp.take_along_axis(batch["positions"], anchors, 1)[..., None] + jnp.arange(block_size)
    block_tokens = (
        jnp.full((rows, num_blocks, block_size), cfg.vocab_size - 1)
        .at[..., 0]
        .set(jnp.take_along_axis(batch["tokens"], anchors, 1))
    )
    dcfg = DrafterConfig.for_target(
        cfg, num_layers=1, mask_token_id=cfg.vocab_size - 1, block_size=block_size, target_layer_ids=layer_ids
    )
    projection = jax.random.normal(jax.random.key(2), (cfg.hidden_size,))

    def run(impl: str, dtype) -> tuple:
        # The same random weights (fp32 draws, cast) in every run; modules in `dtype`.
        target_def, target_params = _in_dtype(Transformer, cfg, dtype, impl, seed=0)
        drafter_def, drafter_params = _in_dtype(DFlashDrafter, dcfg, dtype, impl, seed=1)

        @jax.jit
        def forward(target_params, drafter_params):
            target = nnx.merge(target_def, target_params)
            features = target.features(batch["tokens"], batch["segment_ids"], batch["positions"], layer_ids)

            def loss(params):
                drafter = nnx.merge(drafter_def, params)
                ctx = drafter.context(features)
                embeds = target.embed(block_tokens)
                hidden = drafter(embeds, block_positions, ctx, batch["positions"], ctx_mask, blocks_per_chunk=8)
                return jnp.sum(hidden.astype(jnp.float32) @ projection), hidden

            (_, hidden), grads = jax.value_and_grad(loss, has_aux=True)(drafter_params)
            return features, hidden, grads

        return jax.tree.map(np.asarray, forward(target_params, drafter_params))

    real = np.asarray(batch["segment_ids"]) != 0  # features at padding positions are unspecified
    with jax.default_matmul_precision("highest"):
        ref_features, ref_hidden, ref_grads = run("xla", jnp.float32)
        results = {}
        for impl, dtype in (("fused", jnp.float32), ("fused", jnp.bfloat16), ("xla", jnp.bfloat16)):
            features, hidden, grads = run(impl, dtype)
            results[f"{impl}_{jnp.dtype(dtype).name}"] = {
                "target_features": _relative(features[real], ref_features[real]),
                "drafter_hidden": _relative(hidden, ref_hidden),
                "drafter_grads": _relative_norm(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)),
            }
            log(f"parity {impl} {jnp.dtype(dtype).name}: {results[f'{impl}_{jnp.dtype(dtype).name}']}")
    return results


def _in_dtype(module, cfg, dtype, impl: str, *, seed: int):
    """(graphdef, params) of `module(cfg)` computing in `dtype` with attention `impl`, with weights
    drawn in fp32 and cast, so every dtype sees the same weights."""
    graphdef, _ = nnx.split(
        nnx.eval_shape(lambda: module(cfg, param_dtype=dtype, compute_dtype=dtype, attention=impl, rngs=nnx.Rngs(0)))
    )
    _, params = nnx.split(module(cfg, rngs=nnx.Rngs(seed)))
    return graphdef, jax.tree.map(lambda x: x.astype(dtype), params)


def step_setup(target: TransformerConfig, *, rows, seq_len, num_anchors, block_size, drafter_layers, dtype):
    c = base_config()
    c.target.dtype = dtype
    c.train.compute_dtype = dtype
    c.drafter.num_layers = drafter_layers
    c.drafter.block_size = block_size
    c.drafter.mask_token_id = target.vocab_size - 1
    c.data.seq_len = seq_len
    c.data.global_batch_rows = rows
    c.train.num_anchors = num_anchors
    c.train.remat = True
    c.train.attention_chunk_blocks = 32
    c.train.lm_head_chunk_blocks = 32
    return resolve(c, num_devices=1, target=target, check_files=False)


def compiled_prediction(setup, acc: hardware.Accelerator | None) -> dict:
    """What `plan --hardware` says of this step on one device of `acc`, compiled by that hardware's
    own compiler without it (training/planning/compilers.py): peak memory and the roofline step time."""
    if acc is None or not compilers.installed(acc):
        return {"compiled_for": None}
    plan = planning.plan_train_step(setup, compilers.devices(acc, 1))
    step_s = roofline.estimate(plan.kernels, plan.collectives, roofline.hardware(acc.name)).step_s
    return {
        "compiled_for": acc.name,
        "compiled_peak_memory_gb": _significant(plan.peak / 2**30),
        "compiled_step_s": _significant(step_s),
    }


def predictions(setup, acc: hardware.Accelerator | None) -> dict:
    """The `predict` part: `compiled_prediction` for both attention paths, without running a step
    (run it where `acc`'s compiler is installed, e.g. `--compile_for=h200` on a CPU machine)."""
    out = {}
    for impl in ("fused", "xla"):
        log(f"predict ({impl} attention): compiling for {acc.name if acc else None}")
        out[impl] = _or_error(compiled_prediction, setup.with_run(attention=impl), acc)
        log(f"predict ({impl}): {out[impl]}")
    return out


def _or_error(measure, *args, **kwargs) -> dict:
    """`measure(*args, **kwargs)`, or the one-line error it raised: one part failing leaves the
    others measured."""
    try:
        return measure(*args, **kwargs)
    except Exception as e:  # a check script reports every failure and carries on
        log(f"failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}


def train_steps(setup, steps: int, peak_tflops: float | None, hardware: roofline.Hardware | None, acc=None) -> dict:
    return {impl: _or_error(train_step_of, setup, impl, steps, peak_tflops, hardware, acc) for impl in ("fused", "xla")}


def train_step_of(setup, impl: str, steps: int, peak_tflops, hardware, acc) -> dict:
    log(f"train step ({impl} attention): compiling and timing {steps} steps")
    chosen = setup.with_run(attention=impl)
    r = train_step.bench(chosen, steps, hardware=hardware)
    flops = r["flops_per_step"]
    predicted = r.get("predicted")
    out = {
        "tokens_per_s": round(r["tokens_per_s"], 1),
        "step_s": round(1 / r["steps_per_s"], 4),
        "compile_s": round(r["compile_s"], 1),
        "model_tflop_per_step": _significant(flops / 1e12),
        "achieved_tflops": _significant(r["flops_per_s"] / 1e12),
        "mfu": None if peak_tflops is None else round(r["flops_per_s"] / (peak_tflops * 1e12), 4),
        "peak_memory_gb": peak_memory_gb(),
        # the roofline estimate of the compiled step (training/planning/roofline.py) against the measured time
        "predicted_step_s": None if predicted is None else round(predicted.step_s, 4),
        "predicted_over_measured": None if predicted is None else round(predicted.step_s * r["steps_per_s"], 3),
        "predicted_uncounted_kernel_runs": None if predicted is None else predicted.opaque_runs,
        # the same step compiled for this part by its own compiler, without it (plan --hardware)
        **compiled_prediction(chosen, acc),
    }
    log(f"train step ({impl}): {out}")
    return out


def decode_cost(target_cfg: TransformerConfig, *, dtype, drafter_layers, block_size, context, steps) -> dict:
    dt = jnp.dtype(dtype)
    target = Transformer(target_cfg, param_dtype=dt, compute_dtype=dt, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, target_cfg.vocab_size - 1, context).astype(np.int32)
    kw = dict(max_prompt_len=context, max_new_tokens=steps * block_size + 8, batch_size=1)
    log(f"decode: target alone, context {context}")
    base = dflash_step.step_cost(TargetDecoder(target, **kw), prompt, steps).wall_ms
    dcfg = DrafterConfig.for_target(
        target_cfg, num_layers=drafter_layers, mask_token_id=target_cfg.vocab_size - 1, block_size=block_size
    )
    drafter = DFlashDrafter(dcfg, param_dtype=dt, compute_dtype=dt, rngs=nnx.Rngs(1))
    log(f"decode: DFlash block {block_size}, {drafter_layers} drafter layers")
    dflash = dflash_step.step_cost(SpeculativeDecoder(target, drafter, **kw), prompt, steps).wall_ms
    return {
        "context": context,
        "block_size": block_size,
        "target_ms": round(base, 3),
        "dflash_ms": round(dflash, 3),
        "cost_ratio": round(dflash / base, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, tests)")
    parser.add_argument("--steps", type=int, default=0, help="timed train steps per attention path (default 5, tiny 2)")
    parser.add_argument(
        "--parts",
        default="parity,step,decode",
        help="comma-separated subset to run: parity, step, decode, and predict (what --compile_for's compiler "
        "predicts for the step, without running it: for a CPU machine with that compiler)",
    )
    parser.add_argument(
        "--compile_for",
        default="",
        choices=["", *hardware.ACCELERATORS],
        help="the part whose compiler predicts the step's memory and time beside the measured ones "
        "('': this device's, when listed and its compiler is installed)",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    start = time.perf_counter()
    log(f"jax {jax.__version__} imported; initializing the backend")
    device = jax.devices()[0]
    kind = device.device_kind
    tiny = args.tiny
    steps = args.steps or (2 if tiny else 5)
    dtype = "float32" if tiny and jax.default_backend() == "cpu" else "bfloat16"
    peak = peak_bf16_tflops(kind) if dtype == "bfloat16" else None
    log(f"{kind} ({jax.default_backend()}), {'tiny' if tiny else 'Qwen3-8B'} shapes, train step in {dtype}")
    result = {
        "device": kind,
        "backend": jax.default_backend(),
        "shapes": "tiny" if tiny else "qwen3-8b",
        "attention_auto": attention.resolve_implementation("auto"),
    }
    if "parity" in parts and tiny:
        result["parity"] = _or_error(parity, TINY, rows=2, seq_len=96, num_blocks=6, block_size=8)
    elif "parity" in parts:
        result["parity"] = _or_error(parity, PARITY, rows=2, seq_len=1024, num_blocks=64, block_size=16)
    if "step" in parts:
        result["matmul_peak_tflops"] = _significant(
            train_step.matmul_peak(jnp.dtype(dtype), n=512 if tiny else 8192) / 1e12
        )
    result["peak_tflops"] = peak
    target = TINY if tiny else QWEN3_8B
    acc = hardware.ACCELERATORS[args.compile_for] if args.compile_for else hardware.for_device_kind(kind)
    setup = step_setup(
        target,
        rows=2,
        seq_len=128 if tiny else 3072,
        num_anchors=16 if tiny else 512,
        block_size=8 if tiny else 16,
        drafter_layers=1 if tiny else 5,
        dtype=dtype,
    )
    if "step" in parts:
        result["train_step"] = {
            "rows": setup.data.global_batch_rows,
            "seq_len": setup.data.seq_len,
            "anchors": setup.objective.num_anchors,
            "block_size": setup.drafter.block_size,
            "drafter_layers": setup.drafter.num_layers,
            "dtype": dtype,
            **train_steps(setup, steps, peak, roofline_hardware(kind), acc),
        }
    if "predict" in parts:
        result["predict"] = predictions(setup, acc)
    if "decode" in parts:
        result["decode"] = _or_error(
            decode_cost,
            target,
            dtype=dtype,
            drafter_layers=1 if tiny else 5,
            block_size=8 if tiny else 16,
            context=64 if tiny else 2048,
            steps=5 if tiny else 20,
        )
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result), flush=True)
    sys.exit(1 if _failed(result) else 0)


def _failed(report) -> bool:
    """Whether any part of the report is an error (`_or_error`)."""
    return isinstance(report, dict) and ("error" in report or any(_failed(v) for v in report.values()))


if __name__ == "__main__":
    main()
