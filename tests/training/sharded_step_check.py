"""Runs identical train steps on 1 device and on 8 devices in every sharding layout — data=8,
data=2 x fsdp=4, data=2 x fsdp=2 x tensor=2 (there for every drafter kind too) — and checks that
weights and metrics agree, and
that each layout placed what it promises (docs/design.md §8): the optimizer state split over
all 8 devices in every layout, the target split over fsdp (vocab for the LM head) or over tensor
(heads, MLP). Muon's Newton-Schulz runs on whole matrices (training/optim/muon.py): its step gathers
and reduces no more than AdamW's, and its all-to-alls move less than two copies of the
drafter's matrices. Needs 8 simulated devices, so test_step.py runs it in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.parameters import param_shardings
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import objective, step
from dflash_jax.training.mesh import batch_sharding, make_mesh
from dflash_jax.training.optim.optimizer import OPTIMIZERS as OPTIMIZER_NAMES
from dflash_jax.training.optim.optimizer import OptimizerConfig, make_optimizer
from dflash_jax.training.planning import hlo

# Every split divides: hidden 128 over 8 devices (ZeRO), vocab 256 over fsdp x tensor, 4 heads,
# 2 kv heads and 512 MLP over tensor=2.
TARGET = TransformerConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope=RopeConfig(10000.0),
)
# Every drafter kind (docs/design.md §12); the heads' vocabulary-sized tables split over 8 too.
KIND_FIELDS = {
    "dflash": {},
    "dflash2": dict(selector_rank=16),
    "dspark": dict(markov_rank=16),
    "xpress": dict(xpress_rank=16, xpress_mlp_hidden=32),
}
DRAFTERS = {
    kind: DrafterConfig.for_target(TARGET, num_layers=1, mask_token_id=255, block_size=8, kind=kind, **fields)
    for kind, fields in KIND_FIELDS.items()
}
OBJECTIVES = {
    kind: objective.ObjectiveConfig(
        num_anchors=12,
        loss="dflash",
        dpace_alpha=0.5,  # unread: the position decay weighs the slots
        loss_decay_gamma=4.0,
        attention_chunk_blocks=4,
        lm_head_chunk_blocks=4,
        drafter=cfg,
    )
    for kind, cfg in DRAFTERS.items()
}
STEPS, ACCUM = 2, 2
OPTIMIZERS = {
    name: make_optimizer(OptimizerConfig(optimizer=name, learning_rate=1e-3, warmup_fraction=0.0), 10)
    for name in OPTIMIZER_NAMES
}
BATCHES = [packed_batch(np.random.default_rng(i), 16, 64, 250) for i in range(STEPS)]


def run(mesh, optimizer="adamw", kind="dflash"):
    graphdef, target_params = nnx.split(nnx.eval_shape(lambda: Transformer(TARGET, rngs=nnx.Rngs(0))))
    target_params = jax.jit(
        lambda: nnx.split(Transformer(TARGET, rngs=nnx.Rngs(0)))[1],
        out_shardings=param_shardings(mesh, target_params),
    )()
    state = step.init_train_state(DRAFTERS[kind], OPTIMIZERS[optimizer], seed=0, compute_dtype=jnp.float32, mesh=mesh)
    check_placement(mesh, state, target_params)
    train_step = step.make_train_step(
        drafter_graphdef=step.drafter_graph(DRAFTERS[kind], jnp.float32),
        target_graphdef=graphdef,
        target_params=target_params,
        tx=OPTIMIZERS[optimizer],
        cfg=OBJECTIVES[kind],
        grad_accum_steps=ACCUM,
        mesh=mesh,
        state_sharding=jax.tree.map(lambda x: x.sharding, state),
    )
    batches = [jax.device_put(batch, batch_sharding(mesh)) for batch in BATCHES]
    compiled = train_step.lower(state, target_params, batches[0]).compile()
    metrics = []
    for batch in batches:
        state, m = compiled(state, target_params, batch)
        metrics.append(jax.device_get(m))
    return jax.device_get(state.params), metrics, compiled.as_text()


def bytes_by_kind(hlo_text: str) -> dict[str, int]:
    totals = {kind: 0 for kind in hlo.COLLECTIVE_KINDS}
    for c in hlo.collectives(hlo_text):
        totals[c.kind] += c.bytes * c.count
    return totals


def check_muon_collectives(label, muon_hlo, adamw_hlo, params):
    muon, adamw = bytes_by_kind(muon_hlo), bytes_by_kind(adamw_hlo)
    matrices = sum(x.nbytes for x in jax.tree.leaves(params) if x.ndim == 2)
    print(f"{label}: collective bytes per device {muon} (AdamW {adamw}); matrices {matrices}")
    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        # AdamW's gathers of the weights and reductions of the gradients, plus one scalar per
        # matrix (its Frobenius norm)
        assert muon[kind] <= adamw[kind] + 1024, (label, kind, muon[kind], adamw[kind])
    assert 0 < muon["all-to-all"] <= 2 * matrices, (label, muon["all-to-all"], matrices)


def fraction_held(x) -> float:
    """The share of an array one device holds."""
    return np.prod(x.sharding.shard_shape(x.shape)) / np.prod(x.shape)


def check_placement(mesh, state, target_params):
    n = mesh.devices.size
    for x in jax.tree.leaves((state.params, state.opt_state)):
        if x.ndim == 2:  # ZeRO: every matrix of the trained state split over every device
            assert fraction_held(x) == 1 / n, (mesh.shape, x.shape, x.sharding.spec)
    lm_head, q_proj = target_params["lm_head"]["kernel"], target_params["layers"][0]["self_attn"]["q_proj"]["kernel"]
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    assert fraction_held(lm_head) == 1 / (fsdp * tensor), lm_head.sharding.spec  # vocab over fsdp x tensor
    assert fraction_held(q_proj) == 1 / (fsdp * tensor), q_proj.sharding.spec  # embed over fsdp, heads over tensor


def main():
    assert jax.device_count() == 8, jax.devices()
    one_device = make_mesh(1, 1, devices=jax.devices()[:1])
    single = {name: run(one_device, name)[:2] for name in OPTIMIZER_NAMES}
    single.update({kind: run(one_device, kind=kind)[:2] for kind in ("dflash2", "dspark", "xpress")})
    layouts = {
        "data=8": make_mesh(8, 1),
        "data=2,fsdp=4": make_mesh(2, 4),
        "data=2,fsdp=2,tensor=2": make_mesh(2, 2, 2),
    }
    # Muon's whole-matrix Newton-Schulz: one axis moved per all-to-all (data=8), two (tensor).
    runs = [(name, "adamw", "dflash") for name in layouts]
    runs += [("data=8", "muon", "dflash"), ("data=2,fsdp=2,tensor=2", "muon", "dflash")]
    # The drafter kinds' heads in the most split layout.
    runs += [("data=2,fsdp=2,tensor=2", "adamw", kind) for kind in ("dflash2", "dspark", "xpress")]
    compiled = {}
    for name, optimizer, kind in runs:
        params, metrics, compiled[name, optimizer, kind] = run(layouts[name], optimizer, kind)
        label = f"{name} {optimizer} {kind}"
        reference = single[optimizer if kind == "dflash" else kind]
        for step_index, (got, want) in enumerate(zip(metrics, reference[1])):
            for key in want:
                np.testing.assert_allclose(
                    got[key], want[key], rtol=2e-5, atol=1e-5, err_msg=f"{label} step {step_index} {key}"
                )
        diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params, reference[0]))
        print(f"{label}: max |param difference| vs 1 device = {max(diffs):.3g}")
        # Adam turns the last-bit differences of tiny gradients into differences of a few
        # percent of the learning rate (1e-3); a wrong gradient would move weights by ~1e-3.
        jax.tree.map(
            lambda a, b, label=label: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=label),
            params,
            reference[0],
        )
        if optimizer == "muon":
            check_muon_collectives(label, compiled[name, optimizer, kind], compiled[name, "adamw", kind], params)
    print("OK")


if __name__ == "__main__":
    main()
