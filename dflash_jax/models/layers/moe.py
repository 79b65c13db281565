"""Mixture-of-experts MLP: a router picks A of E experts per token; only those experts run.

One module for every family (transformers 5.x modeling files are the reference):

    Qwen3-MoE     softmax over all experts (fp32), top-k, renormalized if `norm_topk_prob`
    Qwen3.5-MoE,  the same, always renormalized, plus a shared expert (a SwiGLU every token
    Qwen3-Next    runs) scaled by sigmoid(shared_expert_gate(x))
    gpt-oss       router with bias: top-k of the logits, softmax over the chosen; experts with
                  biases; clamped SwiGLU (gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate))
    DeepSeek-V3,  sigmoid scores, groups of experts and top-k chosen with a load-balancing bias,
    Kimi-K2,      the unbiased scores renormalized and scaled (`grouped_sigmoid_routing`, logits in
    MiniMax-M2    fp32); DeepSeek's shared expert is added unscaled
    Gemma 4       softmax top-k renormalized; GELU-tanh experts (`geglu`)

Dispatch is exact (no capacity factor, nothing dropped): the (token, choice) pairs are sorted by
expert and each expert multiplies only its own rows (`grouped_matmul`). Routing weights are fp32;
the expert matmuls run in the compute dtype.

Parameters are stacked over experts, [in, out] like every kernel here, with these logical axes
(`PARTITION_RULES`):

    experts.gate_proj, experts.up_proj   [E, D, I]   (EXPERTS, EMBED, MLP)
    experts.down_proj                    [E, I, D]   (EXPERTS, MLP, EMBED)
    experts.{gate,up}_proj_bias          [E, I]      (EXPERTS, MLP)       gpt-oss only
    experts.down_proj_bias               [E, D]      (EXPERTS, EMBED)     gpt-oss only
    router.kernel                        [D, E]      (EMBED, None); router.bias [E] (None,)
    e_score_correction_bias              [E] fp32    (None,)              sigmoid_grouped only
    shared_expert.{gate,up,down}_proj.kernel, shared_expert_gate.kernel [D, 1]  (Qwen3.5/Next)

Where a checkpoint keeps them (one tensor per expert, fused, MXFP4) is its family's weight map
(models/families/).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from dflash_jax.models.architecture import MoeConfig
from dflash_jax.models.layers.basic import GATE_ACTIVATIONS, Linear, SwiGLU, linear, swiglu_macs
from dflash_jax.models.sharding import (
    BATCH,
    EMBED,
    EXPERTS,
    MLP,
    PartitionRules,
    activation_spec,
    active_mesh,
    constrain,
    layout_spec,
    per_device,
    spec_axes,
)

EXPERT_INPUT_AXES = (EXPERTS, EMBED, MLP)  # experts.gate_proj and up_proj
PARTITION_RULES: PartitionRules = (
    (r"experts\.(gate|up)_proj", EXPERT_INPUT_AXES),
    (r"experts\.down_proj", (EXPERTS, MLP, EMBED)),
    (r"experts\.(gate|up)_proj_bias", (EXPERTS, MLP)),
    (r"experts\.down_proj_bias", (EXPERTS, EMBED)),
    (r"(mlp|moe)\.router\.kernel", (EMBED, None)),  # a layer's `mlp`, or its `moe` beside a dense one
    (r"mlp\.router\.bias", (None,)),
    (r"shared_expert_gate\.kernel", (EMBED, None)),
    (r"mlp\.e_score_correction_bias", (None,)),
)

# ---------------------------------------------------------------------------------------------
# Grouped matmul: rows sorted by expert, group_sizes[e] rows for expert e.

# (token, choice) pairs an expert-parallel device runs at a time (`MoE._routed`): bounds its
# temporaries whatever the number of tokens routed to it.
EP_CHUNK_ROWS = 2048

# Rows per tile of the tiled grouped matmul: the fastest of 8..128 on the 2-core CPU host (busy,
# so only roughly); smaller tiles pad less, larger ones loop less.
TILE_ROWS = 32


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "auto") -> jax.Array:
    """x [R, K] sorted by group, w [E, K, N], group_sizes [E] (summing to R) -> [R, N], each row
    multiplied by its group's matrix.

    impl 'ragged_dot' is `jax.lax.ragged_dot`; 'tiled' cuts every group into tiles of
    `TILE_ROWS` rows and multiplies tile by tile; 'fused' is a Pallas (Triton) kernel doing the
    same on GPUs (`kernels/grouped_matmul.py`; interpret mode elsewhere). 'auto' is 'tiled' on
    CPU and 'fused' on GPUs, where XLA lowers ragged_dot to a dense dot over every group (E times
    the work, and on CPU an [R, E*K] operand), and 'ragged_dot' on TPUs (a Mosaic kernel).
    """
    if impl == "auto":
        return jax.lax.platform_dependent(
            x, w, group_sizes, cpu=_tiled_grouped_matmul, cuda=_fused_grouped_matmul, default=jax.lax.ragged_dot
        )
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x, w, group_sizes)
    if impl == "tiled":
        return _tiled_grouped_matmul(x, w, group_sizes)
    if impl == "fused":
        return _fused_grouped_matmul(x, w, group_sizes)
    raise ValueError(f"grouped matmul impl {impl!r} is not one of auto, ragged_dot, tiled, fused")


def _fused_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    from dflash_jax.models.kernels import grouped_matmul as kernel

    return kernel.grouped_matmul(x, w, group_sizes)


def _tiled_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Every group padded to whole tiles of m rows; a scan multiplies each tile by its group's
    matrix. Work: at most R + min(E, R)*(m-1) rows, never a row of another group."""
    rows, num_groups = x.shape[0], w.shape[0]
    m = max(1, min(TILE_ROWS, rows))
    num_tiles = (rows + min(num_groups, rows) * (m - 1)) // m  # an upper bound on Σ ceil(size/m)
    tiles_per_group = (group_sizes + m - 1) // m
    tile_end = jnp.cumsum(tiles_per_group)
    tile_start = tile_end - tiles_per_group
    row_start = jnp.cumsum(group_sizes) - group_sizes
    tile = jnp.arange(num_tiles)
    tile_group = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), num_groups - 1)
    offset = (tile - tile_start[tile_group])[:, None] * m + jnp.arange(m)  # [tiles, m] row within group
    source = jnp.where(offset < group_sizes[tile_group][:, None], row_start[tile_group][:, None] + offset, rows)
    x_tiles = jnp.take(x, source, axis=0, mode="fill", fill_value=0)  # [tiles, m, K]; padding rows are 0

    def multiply(carry, tile_and_group):
        x_tile, g = tile_and_group
        return carry, x_tile @ w[g]

    _, y_tiles = jax.lax.scan(multiply, None, (x_tiles, tile_group))  # [tiles, m, N]
    # Each row back from its slot: group g's row j sits in tile tile_start[g] + j // m, slot j % m.
    row = jnp.arange(rows)
    group = jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right")
    within = row - row_start[group]
    slot = (tile_start[group] + within // m) * m + within % m
    return y_tiles.reshape(num_tiles * m, -1)[slot]


# ---------------------------------------------------------------------------------------------


def grouped_sigmoid_routing(
    logits: jax.Array,
    correction_bias: jax.Array,
    *,
    top_k: int,
    num_groups: int = 1,
    groups_kept: int = 1,
    normalize: bool = True,
    scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's router (noaux_tc; MiniMax-M2's with one group): logits [T, E] fp32 and the
    load-balancing bias [E] -> (weights [T, A] fp32, experts [T, A] int32).

    Scores are sigmoid(logits). The bias only chooses: the experts split into `num_groups` equal
    groups, a group scores the sum of its two best biased scores, the `groups_kept` best groups
    stay, and the top-k biased scores among their experts are picked. The weights are the picked
    unbiased scores, renormalized to sum to 1 when `normalize`, then times `scale` (the routed
    scaling factor).
    """
    scores = jax.nn.sigmoid(logits)
    choice = scores + correction_bias.astype(jnp.float32)
    if num_groups > 1:
        grouped = choice.reshape(choice.shape[0], num_groups, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, groups]
        kept = jax.nn.one_hot(jax.lax.top_k(group_scores, groups_kept)[1], num_groups).sum(1) > 0
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scale, experts


class Experts(nnx.Module):
    """E SwiGLU experts, stacked: gate_proj, up_proj [E, D, I], down_proj [E, I, D] (+ biases)."""

    def __init__(self, hidden_size: int, config: MoeConfig, *, param_dtype, rngs, init_std=None):
        e, d, i = config.num_experts, hidden_size, config.expert_intermediate_size
        init = (
            nnx.initializers.normal(init_std)
            if init_std is not None
            else nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        )
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, i), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, i), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, d), param_dtype))
        if config.expert_bias:
            self.gate_proj_bias = nnx.Param(jnp.zeros((e, i), param_dtype))
            self.up_proj_bias = nnx.Param(jnp.zeros((e, i), param_dtype))
            self.down_proj_bias = nnx.Param(jnp.zeros((e, d), param_dtype))


class MoE(nnx.Module):
    """The MLP slot of a decoder block: x [..., D] -> [..., D].

    The (token, choice) pairs of a device's tokens are sorted by expert together (one sort).
    """

    def __init__(
        self,
        hidden_size: int,
        config: MoeConfig,
        *,
        param_dtype,
        compute_dtype,
        rngs,
        init_std=None,
        matmul: str = "auto",
    ):
        self.config = config
        self.compute_dtype = compute_dtype
        self.matmul = matmul  # grouped_matmul's impl
        self.router = Linear(
            hidden_size,
            config.num_experts,
            use_bias=config.router_bias,
            dtype=compute_dtype,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(init_std) if init_std is not None else nnx.initializers.lecun_normal(),
            rngs=rngs,
        )
        if config.router == "sigmoid_grouped":  # chooses experts only: kept in fp32, as the reference
            self.e_score_correction_bias = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))
        self.experts = Experts(hidden_size, config, param_dtype=param_dtype, rngs=rngs, init_std=init_std)
        if config.shared_expert_intermediate_size:
            kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, init_std=init_std)
            self.shared_expert = SwiGLU(hidden_size, config.shared_expert_intermediate_size, **kw)
            if config.shared_expert_gate:
                self.shared_expert_gate = linear(hidden_size, 1, **kw)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (weights [T, A] fp32, experts [T, A] int32)."""
        c, a = self.config, self.config.num_experts_per_token
        if c.router == "sigmoid_grouped":  # fp32 logits, as the reference
            logits = x.astype(jnp.float32) @ self.router.kernel[...].astype(jnp.float32)
            return grouped_sigmoid_routing(
                logits,
                self.e_score_correction_bias[...],
                top_k=a,
                num_groups=c.num_groups,
                groups_kept=c.groups_kept,
                normalize=c.norm_topk_prob,
                scale=c.routed_scaling_factor,
            )
        # Logits in the compute dtype, as the reference computes them (it picks the same experts).
        logits = self.router(x).astype(jnp.float32)
        if c.router == "topk_softmax":
            top, experts = jax.lax.top_k(logits, a)
            return jax.nn.softmax(top, axis=-1), experts
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), a)
        if self.config.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., D]. Under a mesh whose batch axes split the tokens, each device routes
        its own tokens (a global sort would gather every token to every device). Where the mesh
        splits the experts (fsdp, tensor: `_expert_parallel`), each device runs only its own
        experts, on the tokens gathered over the axes that split both; otherwise the expert weights
        are gathered whole for it, as fsdp gathers any weight where it is used."""
        spec = activation_spec(x.shape, (BATCH, ..., EMBED))
        if spec is None:  # outside a mesh
            return self._local(x)
        mesh = active_mesh()
        graphdef, state = nnx.split(self)
        experts_spec = layout_spec(mesh, EXPERT_INPUT_AXES, self.experts.gate_proj[...].shape)
        expert_axes = spec_axes(experts_spec[0] if len(experts_spec) else None)
        if not expert_axes or any(a is not None for a in experts_spec[1:]):  # experts whole, or split inside
            if all(axis is None for axis in spec):
                return self._local(x)
            state_specs, body = PartitionSpec(), lambda moe, x: moe._local(x)
        else:
            token_axes = tuple(a for a in spec_axes(spec[0]) if a in expert_axes)
            state_specs = _expert_state_specs(state, expert_axes)
            body = functools.partial(MoE._expert_parallel, token_axes=token_axes, expert_axes=expert_axes)

        def per_shard(state, x):
            with per_device():
                return body(nnx.merge(graphdef, state), x)

        out = jax.shard_map(per_shard, mesh=mesh, in_specs=(state_specs, spec), out_specs=spec, check_vma=False)(
            state, x
        )
        return constrain(out, (BATCH, ..., EMBED))

    def _expert_parallel(self, x: jax.Array, *, token_axes: tuple, expert_axes: tuple) -> jax.Array:
        """One device's tokens x [..., D] when it holds the experts' block of the mesh's
        `expert_axes` (`self.experts` is that block): the tokens of every device along
        `token_axes` (those splitting both) are gathered with their routing, this device's
        experts run on the pairs routed to them, and the partial outputs are summed back over the
        expert axes, each device keeping its own tokens' rows. Each token is routed, and put
        through the shared expert, on one device only (the compiled TPU step showed every device
        of a group repeating both: a quarter of Kimi-K2.5's matmul FLOPs)."""
        shape = x.shape
        mine = x.reshape(-1, shape[-1]).astype(self.compute_dtype)
        others = tuple(a for a in expert_axes if a not in token_axes)  # devices holding the same tokens
        routing = _split_rows(self.route, mine, others)
        if token_axes:
            tokens, weights, experts = (jax.lax.all_gather(a, token_axes, axis=0, tiled=True) for a in (mine, *routing))
        else:
            tokens, (weights, experts) = mine, routing
        count = self.experts.gate_proj[...].shape[0]
        out = self._routed(tokens, weights, experts, jax.lax.axis_index(expert_axes) * count, count)
        if token_axes:
            out = jax.lax.psum_scatter(out, token_axes, scatter_dimension=0, tiled=True)
        out = (jax.lax.psum(out, others) if others else out).astype(self.compute_dtype)
        if not self.config.shared_expert_intermediate_size:
            return out.reshape(shape)
        return (out + _split_rows(self._shared, mine, others)).reshape(shape)

    def _routed(self, tokens, weights, experts, first, count) -> jax.Array:
        """The weighted outputs [T, D] fp32 of experts first .. first + count - 1 (this device's,
        numbered 0 .. count - 1 in `self.experts`) for the (token, choice) pairs routed to them; the
        other pairs add nothing. The pairs sorted by expert run `EP_CHUNK_ROWS` at a time, as many
        chunks as this device's pairs need (a loop of data-dependent length: nothing dropped)."""
        a, rows = self.config.num_experts_per_token, experts.size
        local = experts.reshape(-1) - first
        key = jnp.where((local >= 0) & (local < count), local, count)  # pairs of other devices last
        order = jnp.argsort(key, stable=True)
        ends = jnp.cumsum(jnp.bincount(key, length=count + 1)[:count])
        starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
        chunk = min(rows, EP_CHUNK_ROWS)
        pair_weights = weights.reshape(-1)
        # What balanced routing expects, for the roofline (training/planning/hlo.py reads these scopes): the
        # chunks this device's pairs fill, and the experts a chunk's sorted pairs reach.
        trips = max(1, math.ceil(rows * count / self.config.num_experts / chunk))
        groups = min(count, math.ceil(chunk * self.config.num_experts / rows) + 1)

        def run_chunk(c, out):
            slots = c * chunk + jnp.arange(chunk)
            pair = order[jnp.minimum(slots, rows - 1)]
            sizes = jnp.clip(ends, c * chunk, (c + 1) * chunk) - jnp.clip(starts, c * chunk, (c + 1) * chunk)
            sizes = sizes.at[-1].add(chunk - sizes.sum())  # the chunk's tail past the last pair: weight 0
            with jax.named_scope(f"expected_groups={groups}"):
                y = self._experts(tokens[pair // a], jnp.minimum(key[pair], count - 1), sizes.astype(jnp.int32))
            w = jnp.where(slots < ends[-1], pair_weights[pair], 0.0)
            return out.at[pair // a].add(y.astype(jnp.float32) * w[:, None])

        out = jnp.zeros(tokens.shape, jnp.float32)
        with jax.named_scope(f"expected_trips={trips}"):
            return jax.lax.fori_loop(0, (ends[-1] + chunk - 1) // chunk, run_chunk, out)

    def _shared(self, tokens: jax.Array) -> jax.Array | float:
        """The shared expert's output for tokens [T, D] (gated where the family gates it), or 0."""
        if not self.config.shared_expert_intermediate_size:
            return 0.0
        shared = self.shared_expert(tokens)
        if self.config.shared_expert_gate:
            shared = jax.nn.sigmoid(self.shared_expert_gate(tokens)) * shared
        return shared

    def _local(self, x: jax.Array) -> jax.Array:
        """All tokens of x [..., D] routed together -> [..., D]."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1]).astype(self.compute_dtype)  # [T, D]
        weights, experts = self.route(tokens)
        a = self.config.num_experts_per_token

        # Sort the T*A (token, choice) pairs by expert: expert e owns rows [start_e, start_e + size_e).
        pair_expert = experts.reshape(-1)
        order = jnp.argsort(pair_expert, stable=True)  # [R] sorted row -> pair
        row_expert = pair_expert[order]
        group_sizes = jnp.bincount(pair_expert, length=self.config.num_experts).astype(jnp.int32)
        y = self._experts(tokens[order // a], row_expert, group_sizes)  # [R, D]

        # Back to pair order, then the routing-weighted sum over each token's A choices (fp32).
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        y = y[rank].reshape(-1, a, shape[-1]).astype(jnp.float32)
        out = jnp.einsum("tad,ta->td", y, weights).astype(self.compute_dtype)
        return (out + self._shared(tokens)).reshape(shape)

    def _experts(self, x: jax.Array, row_expert: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x [R, D] sorted by expert -> each row through its expert's MLP, [R, D]."""
        p, dt = self.experts, self.compute_dtype

        def project(h, name):
            out = grouped_matmul(h, getattr(p, name)[...].astype(dt), group_sizes, impl=self.matmul)
            if self.config.expert_bias:
                out = out + getattr(p, name + "_bias")[...].astype(dt)[row_expert]
            return out

        gate, up = project(x, "gate_proj"), project(x, "up_proj")
        if self.config.activation == "clamped_swiglu":
            limit, alpha = self.config.swiglu_limit, self.config.swiglu_alpha
            gate = jnp.minimum(gate, limit)
            up = jnp.clip(up, -limit, limit)
            hidden = (up + 1) * gate * jax.nn.sigmoid(alpha * gate)
        else:
            hidden = GATE_ACTIVATIONS["gelu_tanh" if self.config.activation == "geglu" else "silu"](gate) * up
        return project(hidden, "down_proj")


def moe_macs(hidden_size: int, config: MoeConfig) -> int:
    """Multiply-adds a token: the router, the experts chosen for it only, and the shared expert
    (and its gate) where there is one."""
    shared = config.shared_expert_intermediate_size
    return (
        hidden_size * config.num_experts
        + config.num_experts_per_token * swiglu_macs(hidden_size, config.expert_intermediate_size)
        + swiglu_macs(hidden_size, shared)
        + (hidden_size if shared and config.shared_expert_gate else 0)
    )


def _expert_state_specs(state, expert_axes: tuple[str, ...]):
    """shard_map in_specs of a MoE's state: the stacked experts split over `expert_axes` along
    their first axis, everything else (router, shared expert: small) whole on every device."""

    def spec(path, leaf):
        names = [str(getattr(p, "key", p)) for p in path]
        return PartitionSpec(expert_axes) if names[0] == "experts" else PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, state)


def _split_rows(fn, rows: jax.Array, axes: tuple):
    """fn(rows) where every device along `axes` holds the same rows [T, ...]: each applies fn to
    its 1/n of them and they gather the results (fn's outputs row by row; all of it on every
    device where n does not divide T)."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    if n == 1 or rows.shape[0] % n:
        return fn(rows)
    part = rows.shape[0] // n
    own = jax.lax.dynamic_slice_in_dim(rows, jax.lax.axis_index(axes) * part, part)
    return jax.tree.map(lambda y: jax.lax.all_gather(y, axes, axis=0, tiled=True), fn(own))
