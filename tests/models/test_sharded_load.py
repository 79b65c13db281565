"""Loading a target straight onto a mesh: FSDP-sharded parameters, same function."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from dflash_jax.models.formats.hf import load_target

    path = sys.argv[1]
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    sharded = load_target(path, param_dtype=jnp.float32, compute_dtype=jnp.float32, mesh=mesh)
    plain = load_target(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    spec = sharded.embed_tokens.embedding[...].sharding.spec
    assert "fsdp" in tuple(spec), spec
    assert len(sharded.embed_tokens.embedding[...].addressable_shards[0].data) == 2048 // 4
    tokens = jnp.arange(16)[None] * 7
    ones = jnp.ones((1, 16), jnp.int32)
    pos = jnp.arange(16)[None]
    with jax.default_matmul_precision("highest"):
        a = jax.jit(lambda t: sharded(t, ones, pos)[0])(tokens)
        b = plain(tokens, ones, pos)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    print("OK")
    """
)


@pytest.mark.slow
def test_load_onto_mesh_shards_parameters(tmp_path, make_hf_checkpoint):
    path = make_hf_checkpoint(tmp_path / "ckpt", vocab_size=2048)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SCRIPT, path], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
