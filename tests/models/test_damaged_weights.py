"""Damaged and hostile weight files end in one line naming the file (issue 59): a drafter export
whose model.safetensors is truncated, garbled or claims absurd sizes, whose config.json is not JSON or
lacks a field, and GGUF files whose headers claim more than the file holds. A header claiming
terabytes is refused before anything of that size is allocated: each case runs under tracemalloc.
A drafter made for another target is refused by `evaluate` from the two config.json files, before
either model loads."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import jax.numpy as jnp
import pytest
from absl import flags
from flax import nnx

from dflash_jax import evaluate
from dflash_jax.errors import ModelError
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.families import target_config
from dflash_jax.models.formats.hf import export_drafter, load_drafter, read_config
from dflash_jax.models.formats.hub import resolve_model
from support.stderr import user_lines

TINY_TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3"
TIB = 2**40
# What reading a damaged file may allocate at most: its header, never what the header claims.
MAX_ALLOCATED = 2**20


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A one-layer drafter of the bundled tiny-qwen3, exported."""
    cfg = DrafterConfig.for_target(target_config(read_config(TINY_TARGET)), num_layers=1, mask_token_id=5, block_size=4)
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(0))
    return export_drafter(drafter, tmp_path_factory.mktemp("drafter") / "export", dtype=jnp.float32)


def damaged_copy(export: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    return copy


def one_line_error(call, *args) -> str:
    """The ModelError `call(*args)` raises, checked to be one line, quick and small in memory."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ModelError) as raised:
            call(*args)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 5
    assert peak < MAX_ALLOCATED, f"{peak:,} bytes allocated"
    message = str(raised.value)
    assert "\n" not in message
    return message


def expect(message: str, prefix: str, pattern: str) -> None:
    """`message` is `prefix` (a path, said as it is) followed by what `pattern` matches."""
    assert message.startswith(prefix), message
    assert re.match(pattern, message[len(prefix) :]), message


def header_of(file: Path) -> tuple[dict, bytes]:
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def write_header(file: Path, header, data: bytes, *, claimed_size: int | None = None) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text) if claimed_size is None else claimed_size) + text + data)


def edit_first_tensor(file: Path, **fields) -> str:
    header, data = header_of(file)
    name = next(n for n in sorted(header) if n != "__metadata__")
    header[name].update(fields)
    write_header(file, header, data)
    return name


def test_the_export_loads_as_it_is(export):
    assert load_drafter(export).cfg.num_layers == 1


def test_a_truncated_weights_file_is_one_line_naming_it(export, tmp_path):
    weights = damaged_copy(export, tmp_path) / "model.safetensors"
    whole = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: whole // 2])
    message = one_line_error(load_drafter, weights.parent)
    assert message.startswith(f"{weights}: tensor '")
    assert "the file is truncated or damaged" in message


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda f: f.write_bytes(b""), r"0 bytes: not a safetensors file \(empty or truncated\)"),
        (
            lambda f: f.write_bytes(struct.pack("<Q", TIB) + f.read_bytes()[8:]),
            r"not a safetensors file, or truncated: its header claims 1,099,511,627,776 bytes, the file holds [\d,]+",
        ),
        (
            lambda f: f.write_bytes(f.read_bytes()[:9] + b"\xff" * 16 + f.read_bytes()[25:]),
            "damaged, or not a safetensors file: its header is not JSON",
        ),
        (lambda f: write_header(f, [1, 2], b""), "damaged, or not a safetensors file: its header is not a JSON object"),
    ],
    ids=["empty", "header_claims_a_terabyte", "garbled_header", "header_a_list"],
)
def test_a_weights_file_that_is_not_safetensors_is_one_line(export, tmp_path, damage, expected):
    weights = damaged_copy(export, tmp_path) / "model.safetensors"
    damage(weights)
    expect(one_line_error(load_drafter, weights.parent), f"{weights}: ", expected)


@pytest.mark.parametrize(
    "fields, expected",
    [
        (
            {"data_offsets": [0, 4 * TIB]},
            r"ends at byte 4,398,046,511,104 of the data, which holds [\d,]+: the file is truncated or damaged",
        ),
        ({"shape": [2**62, 2**62]}, r"of shape \[4611686018427387904, 4611686018427387904\] F32 needs [\d,]+ bytes"),
        ({"shape": [-1, 4]}, r"has a bad shape \[-1, 4\] or data_offsets"),
        ({"data_offsets": [8, 4]}, r"of shape \[256, 256\] F32 needs [\d,]+ bytes, its data_offsets \[8, 4\] span -4"),
        ({"dtype": "F128"}, r"has an unknown dtype 'F128'"),
    ],
    ids=["offsets_past_the_end", "element_count_overflows_int64", "negative_dimension", "reversed_offsets", "dtype"],
)
def test_a_header_with_absurd_sizes_is_refused_before_reading(export, tmp_path, fields, expected):
    weights = damaged_copy(export, tmp_path) / "model.safetensors"
    name = edit_first_tensor(weights, **fields)
    expect(one_line_error(load_drafter, weights.parent), f"{weights}: tensor {name!r} ", expected)


def test_an_export_without_its_weights_file_is_one_line_naming_the_directory(export, tmp_path):
    copy = damaged_copy(export, tmp_path)
    (copy / "model.safetensors").unlink()
    expect(one_line_error(load_drafter, copy), f"{copy}: ", "no weights: neither")


def test_bytes_after_the_data_are_one_line_from_the_reader(export, tmp_path):
    weights = damaged_copy(export, tmp_path) / "model.safetensors"
    with open(weights, "ab") as f:
        f.write(b"\0" * 100)
    message = one_line_error(load_drafter, weights.parent)
    assert message.startswith(f"{weights}: damaged, or not a safetensors file (")


@pytest.mark.parametrize(
    "write, expected",
    [
        (lambda c, hf: c.write_text('{"hidden_size": 256,'), r"not JSON \(Expecting"),
        (lambda c, hf: c.write_bytes(b"\xff\xfe{}"), r"not JSON \('utf-8' codec can't decode"),
        (lambda c, hf: c.write_text("[1, 2]"), r"not a JSON object but a list"),
        (
            lambda c, hf: c.write_text(json.dumps({k: v for k, v in hf.items() if k != "hidden_size"})),
            r"the field 'hidden_size' is missing",
        ),
        (
            lambda c, hf: c.write_text(json.dumps({**hf, "num_hidden_layers": "one"})),
            r"invalid literal for int\(\) with base 10: 'one'",
        ),
        (lambda c, hf: c.write_text(json.dumps({**hf, "architectures": ["LlamaForCausalLM"]})), "not a DFlash drafter"),
    ],
    ids=["cut", "not_utf8", "a_list", "no_hidden_size", "bad_number", "not_a_drafter"],
)
def test_a_drafter_config_that_is_not_one_is_one_line_naming_it(export, tmp_path, write, expected):
    config = damaged_copy(export, tmp_path) / "config.json"
    write(config, json.loads(config.read_text()))
    expect(one_line_error(load_drafter, config.parent), f"{config}: ", expected)


# GGUF: crafted headers (version 3, little-endian) around one F32 tensor of 4 x 4.
def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(
    *,
    tensors=(("token_embd.weight", (4, 4), 0, 0),),
    metadata: bytes = _string("general.architecture") + struct.pack("<I", 8) + _string("llama"),
    counts: tuple[int, int] | None = None,
    magic: bytes = b"GGUF",
) -> bytes:
    num_tensors, num_entries = counts or (len(tensors), 1)
    out = magic + struct.pack("<IQQ", 3, num_tensors, num_entries) + metadata
    for name, dims, type_id, offset in tensors:
        out += _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", type_id, offset)
    out += b"\0" * (-len(out) % 32)
    return out + b"\0" * 64


@pytest.fixture(scope="module")
def warm_gguf(tmp_path_factory):
    """The modules a GGUF path imports when first resolved, imported before anything is measured."""
    bad = tmp_path_factory.mktemp("warm") / "bad.gguf"
    bad.write_bytes(gguf_bytes(tensors=(("token_embd.weight", (4, 4), 99, 0),)))
    with pytest.raises(ModelError):
        resolve_model(str(bad))


ARRAY_OF_STRINGS = _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**60)
ARRAY_OF_INTS = _string("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, 2**60)
ALIGNMENT = _string("general.alignment") + struct.pack("<II", 4, 3)


@pytest.mark.parametrize(
    "blob, expected",
    [
        (gguf_bytes(magic=b"GGML"), "no GGUF magic at its start"),
        (gguf_bytes(counts=(2**62, 1)), "its header claims 4,611,686,018,427,387,904 tensors and 1 metadata entries"),
        (gguf_bytes(counts=(1, 2**62)), "its header claims 1 tensors and 4,611,686,018,427,387,904 metadata entries"),
        (
            gguf_bytes(metadata=_string("general.architecture") + struct.pack("<IQ", 8, 2**62) + b"llama"),
            "the value of 'general.architecture' needs 4,611,686,018,427,387,904 bytes at byte 64, past the end",
        ),
        (gguf_bytes(metadata=ARRAY_OF_STRINGS), "metadata 'tokenizer.ggml.tokens' claims 1,152,921,504,606,846,976"),
        (gguf_bytes(metadata=ARRAY_OF_INTS), "the 1,152,921,504,606,846,976 values of 'tokenizer.ggml.token_type'"),
        (gguf_bytes(metadata=ALIGNMENT), "general.alignment 3 is not a power of two"),
        (
            gguf_bytes(tensors=(("token_embd.weight", (2**32, 2**32), 0, 0),)),
            r"tensor 'token_embd.weight' \(\[4294967296, 4294967296\] F32\) ends at byte 73,786,976,294,838,206,\d+",
        ),
        (
            gguf_bytes(tensors=(("token_embd.weight", (4, 4), 0, TIB),)),
            r"tensor 'token_embd.weight' \(\[4, 4\] F32\) ends at byte 1,099,511,627,\d+, past the end of the file",
        ),
        (gguf_bytes(tensors=(("token_embd.weight", (4,) * 5, 0, 0),)), "tensor 'token_embd.weight' has 5 dimensions"),
        (gguf_bytes(tensors=(("token_embd.weight", (4, 4), 99, 0),)), "tensor 'token_embd.weight' has an unknown type"),
        (
            gguf_bytes(tensors=(("token_embd.weight", (4, 5), 8, 0),)),
            "tensor 'token_embd.weight' of shape \\[4, 5\\] does not fill whole 32",
        ),
    ],
    ids=[
        "magic",
        "tensor_count",
        "metadata_count",
        "string_length",
        "string_array_length",
        "int_array_length",
        "alignment",
        "element_count_overflows",
        "offset_past_the_end",
        "dimensions",
        "tensor_type",
        "partial_block",
    ],
)
def test_a_gguf_header_with_absurd_sizes_is_refused_before_reading(blob, expected, tmp_path, gguf_cache, warm_gguf):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(blob)
    before = sorted(gguf_cache.iterdir())
    message = one_line_error(resolve_model, str(bad))
    expect(message, f"{bad}: not a readable GGUF file, truncated or corrupt (", expected)
    assert sorted(gguf_cache.iterdir()) == before  # nothing written for it


def test_the_crafted_gguf_header_reads_when_sound(tmp_path):
    from dflash_jax.models.formats.gguf import check_gguf

    sound = tmp_path / "sound.gguf"
    sound.write_bytes(gguf_bytes())
    check_gguf(sound)  # the cases above differ from it in the one field they name


# A drafter that does not fit its target: refused from the two config.json files, before any model loads.
def drafter_for(tmp_path: Path, **target_fields) -> Path:
    """An export of a drafter made for tiny-qwen3 with `target_fields` changed."""
    hf = {k: v for k, v in read_config(TINY_TARGET).items() if k != "layer_types"} | target_fields
    cfg = DrafterConfig.for_target(target_config(hf), num_layers=1, mask_token_id=5, block_size=4)
    return export_drafter(DFlashDrafter(cfg, rngs=nnx.Rngs(0)), tmp_path / "other", dtype=jnp.float32)


def run_evaluate(args: list[str], monkeypatch) -> None:
    """`evaluate` as the command runs it, failing the test if it gets as far as loading a model."""

    def loads(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evaluate, "run_evaluation", loads)
    flag_values = flags.FlagValues()
    evaluate.define_flags(flag_values)
    flag_values(["evaluate", *args])
    evaluate.main([], flag_values)


@pytest.mark.parametrize(
    "target_fields, expected",
    [
        (
            {"hidden_size": 128, "vocab_size": 2048, "num_hidden_layers": 2},
            "hidden size 128 (the target's: 256); vocabulary of 2048 (the target's: 4096); made for a 2-layer "
            "target (this one has 4)",
        ),
        (
            {"num_hidden_layers": 8},
            "made for a 8-layer target (this one has 4); reads target layers [4], which the target does not have",
        ),
    ],
    ids=["sizes", "layers"],
)
def test_a_drafter_for_another_target_is_one_line_before_any_model_loads(
    tmp_path, monkeypatch, target_fields, expected
):
    other = drafter_for(tmp_path, **target_fields)
    output = tmp_path / "eval"
    with pytest.raises(ModelError) as raised:
        run_evaluate([f"--drafter={other}", f"--target={TINY_TARGET}", f"--output={output}"], monkeypatch)
    assert str(raised.value) == f"--drafter={other} does not fit the target {TINY_TARGET}: {expected}"
    assert not output.exists()


def test_a_damaged_drafter_is_refused_before_any_model_loads(export, tmp_path, monkeypatch):
    weights = damaged_copy(export, tmp_path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelError, match="the file is truncated or damaged$") as raised:
        run_evaluate([f"--drafter={weights.parent}", f"--target={TINY_TARGET}"], monkeypatch)
    assert str(raised.value).startswith(f"{weights}: tensor ")


@pytest.mark.slow
def test_the_command_says_a_damaged_or_misfitting_drafter_in_one_line(export, tmp_path):
    damaged = damaged_copy(export, tmp_path)
    (damaged / "model.safetensors").write_bytes(b"\0" * 7)
    other = drafter_for(tmp_path, hidden_size=128)
    for drafter, expected in (
        (damaged, f"error: {damaged / 'model.safetensors'}: 7 bytes: not a safetensors file (empty or truncated)"),
        (other, f"error: --drafter={other} does not fit the target {TINY_TARGET}: hidden size 128 (the target's: 256)"),
    ):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "dflash_jax.evaluate",
                f"--drafter={drafter}",
                f"--target={TINY_TARGET}",
                f"--output={tmp_path / 'eval'}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=TINY_TARGET.parents[1],
        )
        assert result.returncode == 1
        assert user_lines(result.stderr) == [expected]
    assert not (tmp_path / "eval").exists()
