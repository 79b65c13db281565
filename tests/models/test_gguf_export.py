"""The drafter GGUF (models/formats/gguf_export.py) holds what llama.cpp b11434's loader asks for, for
every kind: the metadata `src/models/dflash.cpp` and `common/speculative.cpp` read and every
tensor it creates as required, under its name and shape (transcribed below); a drafter the engine
cannot serve is refused in one line. The engine itself loads these files in test_llama_cpp.py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, dequantize

from dflash_jax.errors import UserError
from dflash_jax.models.formats.gguf_export import llama3_rope_factors, llama_cpp_problems, write_drafter_gguf
from dflash_jax.models.formats.hf import export_drafter, load_target
from dflash_jax.models.formats.hub import resolve_model
from support.decoding_models import make_drafter, perturbed
from support.gguf_checkpoint import write_tiny_gguf

HEADS = {"dflash": {}, "dflash2": {"selector_top_k": 7, "selector_rank": 32}, "dspark": {"markov_rank": 32}}


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("target") / "target.gguf", layers=4, weight_type="F32")


@pytest.fixture(scope="module")
def target(target_gguf):
    return load_target(resolve_model(str(target_gguf)))


def _export(target, kind, path, **fields):
    drafter = perturbed(make_drafter(target, kind=kind, block_size=4, mask_id=3, **{**HEADS[kind], **fields}))
    return export_drafter(drafter, path)


def _required(kind: str, cfg) -> dict[str, tuple[int, ...]]:
    """llama.cpp's required tensors and their ne (innermost first), from load_arch_tensors."""
    h, v, f, hd = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {
        "fc.weight": (len(cfg.target_layer_ids) * h, h),
        "enc.output_norm.weight": (h,),
        "output_norm.weight": (h,),
        "blk.0.attn_norm.weight": (h,),
        "blk.0.attn_q.weight": (h, q),
        "blk.0.attn_k.weight": (h, kv),
        "blk.0.attn_v.weight": (h, kv),
        "blk.0.attn_output.weight": (q, h),
        "blk.0.attn_q_norm.weight": (hd,),
        "blk.0.attn_k_norm.weight": (hd,),
        "blk.0.ffn_norm.weight": (h,),
        "blk.0.ffn_gate.weight": (h, f),
        "blk.0.ffn_up.weight": (h, f),
        "blk.0.ffn_down.weight": (f, h),
    }
    if kind == "dflash2":
        r, k, groups = cfg.selector_rank, cfg.conv_kernel_size, h // cfg.conv_group_size
        out |= {"selector_predecessor.weight": (r, v), "selector_successor.weight": (r, v)}
        out |= {"selector_hidden.weight": (h, r)}
        for part in ("attn", "ffn"):
            out |= {f"blk.0.{part}_conv_base": (h, k, 2), f"blk.0.{part}_conv_proj.weight": (h, 2 * k * groups)}
    if kind == "dspark":
        r = cfg.markov_rank
        out |= {"markov_w1.weight": (r, v), "markov_w2.weight": (r, v), "conf_proj.weight": (h + r, 1)}
        out |= {"conf_proj.bias": (1,)}
    return out


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_the_gguf_holds_what_llama_cpp_loads(kind, target, target_gguf, tmp_path):
    export = _export(target, kind, tmp_path / "export")
    out = write_drafter_gguf(export, target_gguf, tmp_path / "drafter.gguf")
    reader, source = GGUFReader(out), GGUFReader(target_gguf)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    cfg = make_drafter(target, kind=kind, block_size=4, mask_id=3, **HEADS[kind]).cfg

    assert meta["general.architecture"] == "dflash"
    assert meta["dflash.block_count"] == 1 and meta["dflash.embedding_length"] == cfg.hidden_size
    assert meta["dflash.block_size"] == 4
    assert meta["dflash.target_layers"] == [i + 1 for i in cfg.target_layer_ids]  # layer inputs
    assert meta["tokenizer.ggml.mask_token_id"] == 3
    for name, field in source.fields.items():  # the target's vocabulary, as llama.cpp compares it
        if name.startswith("tokenizer."):
            assert meta[name] == field.contents(), name
    assert meta.get("dflash.selector_top_k") == (7 if kind == "dflash2" else None)
    assert meta.get("dflash.sample_from_anchor") == (True if kind == "dspark" else None)

    tensors = {t.name: t for t in reader.tensors}
    for name, ne in _required(kind, cfg).items():
        assert tuple(int(n) for n in tensors[name].shape) == ne, name
    assert len(tensors) == len(_required(kind, cfg))  # one layer: nothing unmapped, nothing extra


def test_the_weights_are_the_exports(target, target_gguf, tmp_path):
    from safetensors.numpy import load_file

    export = _export(target, "dspark", tmp_path / "export")
    reader = GGUFReader(write_drafter_gguf(export, target_gguf, tmp_path / "d.gguf"))
    ours = load_file(str(export / "model.safetensors"))
    theirs = {t.name: np.asarray(t.data) for t in reader.tensors}
    np.testing.assert_array_equal(theirs["markov_w2.weight"], ours["markov_head.markov_w2.weight"].astype(np.float32))
    np.testing.assert_array_equal(theirs["blk.0.attn_q.weight"], ours["layers.0.self_attn.q_proj.weight"])


def test_a_draft_vocabulary_is_its_own_head_and_d2t(target, target_gguf, tmp_path):
    """llama.cpp's reduced draft vocabulary: `d2t` [V'] (int64 target ids), `output.weight` the
    target head's rows of those tokens (tied: the embedding's), DSpark's Markov output rows cut to
    them; the Markov input and everything else over the whole vocabulary as before."""
    from safetensors.numpy import load_file

    ids = np.array([7, 3, 250, 11, 0], np.int32)
    export = _export(target, "dspark", tmp_path / "export")
    reader = GGUFReader(write_drafter_gguf(export, target_gguf, tmp_path / "d.gguf", ids))
    theirs = {t.name: t for t in reader.tensors}
    ours = load_file(str(export / "model.safetensors"))
    embedding = {t.name: t for t in GGUFReader(target_gguf).tensors}["token_embd.weight"]  # tied: the head
    head = dequantize(embedding.data, embedding.tensor_type)
    assert theirs["d2t"].tensor_type.name == "I64" and np.asarray(theirs["d2t"].data).tolist() == ids.tolist()
    np.testing.assert_array_equal(np.asarray(theirs["output.weight"].data), head[ids])
    np.testing.assert_array_equal(
        np.asarray(theirs["markov_w2.weight"].data), ours["markov_head.markov_w2.weight"].astype(np.float32)[ids]
    )
    assert tuple(int(n) for n in theirs["markov_w1.weight"].shape) == (32, target.cfg.vocab_size)
    with pytest.raises(UserError, match="vocabulary of"):
        write_drafter_gguf(export, target_gguf, tmp_path / "bad.gguf", np.array([0, target.cfg.vocab_size]))


@pytest.mark.parametrize(
    "kind, fields, reason",
    [
        ("dflash", {"target_layer_ids": (0, 3)}, "read [3]"),  # the last of 4 layers: never recorded
        ("dflash2", {"selector_top_k": 8}, "selector_top_k 8 needs a hidden size >= 72"),
    ],
)
def test_a_drafter_llama_cpp_cannot_serve_is_one_line(kind, fields, reason, target, target_gguf, tmp_path):
    import dataclasses

    cfg = make_drafter(target, kind=kind, **HEADS[kind]).cfg
    cfg = dataclasses.replace(cfg, **fields)
    assert any(reason in p for p in llama_cpp_problems(cfg.to_hf(), target.cfg.num_layers))
    if kind == "dflash":  # and the export is refused with it
        drafter = make_drafter(target, kind=kind)
        drafter.cfg = cfg
        export = export_drafter(drafter, tmp_path / "export")
        with pytest.raises(UserError, match=r"read \[3\]"):
            write_drafter_gguf(export, target_gguf, tmp_path / "d.gguf")


def test_export_refuses_the_gguf_of_a_kind_llama_cpp_does_not_serve_before_writing(target, target_gguf, tmp_path):
    """`export --format=gguf` of a Domino run: one line, and no HF export written before it."""
    import jax.numpy as jnp
    from absl import flags

    from dflash_jax import export
    from dflash_jax.training.checkpoint import RunCheckpoints
    from dflash_jax.training.mesh import make_mesh
    from dflash_jax.training.optim.optimizer import OptimizerConfig, make_optimizer
    from dflash_jax.training.step import init_train_state

    cfg = make_drafter(target, kind="domino", block_size=4, mask_id=3).cfg
    state = init_train_state(
        cfg, make_optimizer(OptimizerConfig(), 10), seed=0, compute_dtype=jnp.float32, mesh=make_mesh(-1, 1)
    )
    meta = {"drafter_config": cfg.to_hf(), "config": {"target": {"path": str(target_gguf)}}, "best_tau": None}
    checkpoints = RunCheckpoints(str(tmp_path / "run" / "checkpoints"), every_steps=1, keep=None, async_save=False)
    checkpoints.save(2, state, meta, _Iterator(), force=True)
    checkpoints.close()
    flag_values = flags.FlagValues()
    export.define_flags(flag_values)
    flag_values(["export", f"--workdir={tmp_path / 'run'}", "--format=gguf", f"--output={tmp_path / 'out'}"])
    with pytest.raises(
        UserError, match=r"^--format=gguf: llama.cpp cannot serve the drafter of .*run: .*not drafter kind 'domino'$"
    ):
        export.main([], flag_values)
    assert not (tmp_path / "out").exists()


class _Iterator:
    """A data iterator's checkpointed state."""

    def get_state(self):
        return {"epoch": 0, "step": 2}


def test_llama3_rope_factors_follow_the_published_rule():
    """Llama 3.1's scaling: high frequencies kept, low ones divided by the factor, a smooth ramp between."""
    hf = {
        "head_dim": 128,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    factors = llama3_rope_factors(hf)
    assert factors.shape == (64,) and factors[0] == 1.0 and factors[-1] == 8.0
    assert np.all(np.diff(factors) >= 0) and np.any((factors > 1) & (factors < 8))


def test_a_kind_llama_cpp_does_not_serve_is_a_problem_not_a_crash(target):
    """`train` warns with llama_cpp_problems at start-up: a Domino drafter (served by SGLang, not
    by llama.cpp b11434) is a reason, not an exception."""
    cfg = make_drafter(target, kind="domino", gru_hidden_dim=16, emb_dim=8).cfg
    (problem,) = llama_cpp_problems(cfg.to_hf(), target.cfg.num_layers)
    assert "not drafter kind 'domino'" in problem
