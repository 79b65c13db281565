"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 / Qwen3.6 / Qwen3-Next targets.

Per value head, a state S [H, U] maps keys to values. Token t decays it by exp(g_t), reads what
it predicts for its key, writes the correction (the delta rule) and is read by its query:

    S <- exp(g_t) S;   delta_t = beta_t (v_t - S^T k_t);   S <- S + k_t delta_t^T;   o_t = S^T q_t

The packed forward computes this over chunks of 64 tokens (as transformers'
`torch_chunk_gated_delta_rule`): inside a chunk the deltas come from one unit-lower-triangular
solve and the outputs from matmuls; only the state passes sequentially from chunk to chunk. All of
it is fp32. In a packed row no document sees another: the conv window and the state restart at
each document, by masks (pairs of tokens in different documents, the incoming state for tokens
past a document start), never by large decay constants.

Decoding keeps the state as of the last call's start plus, for each of that call's tokens, what
it wrote (key, delta, cumulative decay): the state after any prefix of those tokens is one small
sum away, so rolling back rejected drafts (a smaller `start`) is exact and costs no stored
per-token states.

Parameter names are transformers' `Qwen3_5GatedDeltaNet`'s (Linear kernels stored [in, out]; the
conv weight, `dt_bias`, `A_log` and the norm in torch layout); Qwen3-Next's fused projections
are split at load (models/families/qwen3_next.py). Shapes: B rows, S tokens of a row, T new tokens, D model
dim, K key heads, G value heads per key head, H key head dim, U value head dim, C conv channels
(2·K·H + K·G·U: q, k and v), W conv width, N chunks of L tokens, M tokens the cache can roll back.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.architecture import LinearAttentionConfig
from dflash_jax.models.layers.basic import RMSNorm, linear
from dflash_jax.models.layers.mixers import DecodeStep, PackedRows
from dflash_jax.models.sharding import EMBED, NORM, PartitionRules

# q, k and v concatenated in one projection, so its outputs do not split by head; the small
# per-head vectors stay whole.
PARTITION_RULES: PartitionRules = (
    (r"linear_attn\.in_proj_(qkv|z|b|a)\.kernel", (EMBED, None)),
    (r"linear_attn\.out_proj\.kernel", (None, EMBED)),
    (r"linear_attn\.conv1d\.weight", (None, None, None)),
    (r"linear_attn\.(dt_bias|A_log)", (NORM,)),
)

CHUNK = 64  # tokens per chunk of the packed forward, as transformers
L2_EPS = 1e-6  # q/k L2 normalization, as transformers (and the FLA kernels)

# fp32 matmuls at full precision, as torch computes the reference: the state accumulates over
# thousands of tokens, and the chunk decays are exponentials of sums (no TF32 shortcuts).
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@flax.struct.dataclass
class LinearCache:
    """One Gated DeltaNet layer's decoding cache (all arrays: it lives in jitted, donated loops).

    `base` [B] is the last call's start (later than it when that call ran more than M tokens);
    tokens base .. base+M-1 are that call's last ones. A call may start anywhere from `base` to
    `base` + the number of tokens stored (rollback); earlier or later starts are not supported.
    """

    state: jax.Array  # [B, K, G, H, U] fp32: the recurrent state as of `base`
    inputs: jax.Array  # [B, W-1+M, C] compute dtype: conv inputs of tokens base-(W-1) .. base+M-1
    keys: jax.Array  # [B, M, K, H] fp32: normalized keys of the stored tokens
    deltas: jax.Array  # [B, M, K, G, U] fp32: what each stored token wrote to the state
    decays: jax.Array  # [B, M, K, G] fp32: log decay from `base` through each stored token
    base: jax.Array  # [B] int32

    def state_after(self, r: jax.Array) -> jax.Array:
        """The state after the first r [B] stored tokens of each row: [B, K, G, H, U]."""
        total = jnp.take_along_axis(self.decays, jnp.maximum(r - 1, 0)[:, None, None, None], axis=1)[:, 0]
        total = jnp.where((r > 0)[:, None, None], total, 0.0)  # [B, K, G]
        taken = (jnp.arange(self.keys.shape[1])[None, :] < r[:, None])[:, :, None, None]  # [B, M, 1, 1]
        weights = jnp.exp(jnp.where(taken, total[:, None] - self.decays, -jnp.inf))  # [B, M, K, G]
        written = _einsum("bmkg,bmkh,bmkgu->bkghu", weights, self.keys, self.deltas)
        return jnp.exp(total)[..., None, None] * self.state + written

    def window_after(self, r: jax.Array) -> jax.Array:
        """The W-1 conv inputs before stored token r [B] of each row: [B, W-1, C]."""
        width = self.inputs.shape[1] - self.keys.shape[1]
        slots = r[:, None] + jnp.arange(width)[None, :]
        return jnp.take_along_axis(self.inputs, slots[..., None], axis=1)


class CausalConv(nnx.Module):
    """Depthwise causal conv1d without bias, followed by SiLU; `weight` [C, 1, W] as torch's."""

    def __init__(self, channels: int, kernel_size: int, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        scale = kernel_size**-0.5  # torch's default fan-in scale (one input channel per group)
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (channels, 1, kernel_size), param_dtype) * scale)
        self.compute_dtype = compute_dtype

    def __call__(self, inputs: jax.Array, runs: jax.Array | None = None) -> jax.Array:
        """inputs [B, W-1+S, C] (the W-1 inputs before the S new ones) -> [B, S, C].

        `runs` [B, W-1+S] numbers the documents (any value before the first token): a tap only
        reads inputs of its own token's document. None: all one document.
        """
        width = self.weight.shape[-1]
        s = inputs.shape[1] - (width - 1)
        weight = self.weight[...][:, 0].astype(jnp.float32)  # [C, W]
        out = jnp.zeros((inputs.shape[0], s, inputs.shape[2]), jnp.float32)
        for tap in range(width):  # tap reads the input width-1-tap tokens back
            x = inputs[:, tap : tap + s].astype(jnp.float32) * weight[:, tap]
            if runs is not None:
                x = jnp.where((runs[:, tap : tap + s] == runs[:, width - 1 :])[..., None], x, 0.0)
            out = out + x
        return jax.nn.silu(out.astype(self.compute_dtype))


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) · SiLU(gate), with the plain scale w (not 1 + w) in Qwen3.5 and Qwen3-Next alike."""

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        normed = super().__call__(x).astype(jnp.float32)
        return (normed * jax.nn.silu(gate.astype(jnp.float32))).astype(self.compute_dtype)


def _l2_normalized(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _unit_lower_inverse(system: jax.Array) -> jax.Array:
    """(1 + N)^-1 for N the strict lower triangle of `system` [..., L, L] (its diagonal and upper
    triangle are ignored): N is nilpotent, so the inverse is the product of (1 + (-N)^(2^i)) over
    i < log2(L), log2(L) batched matmuls. XLA:CPU's batched triangular solve ran 30x slower than
    this on the chunk sizes here (a verify step of the hybrid target took 50 ms a layer)."""
    size = system.shape[-1]
    power = -jnp.where(jnp.tri(size, k=-1, dtype=bool), system, 0.0)  # (-N)^(2^i), from i = 0
    inverse = jnp.eye(size, dtype=system.dtype) + power
    for _ in range(max(size - 1, 1).bit_length() - 1):
        power = _einsum("...ij,...jk->...ik", power, power)
        inverse = inverse + _einsum("...ij,...jk->...ik", inverse, power)
    return inverse


def gated_delta_rule(q, k, v, g, beta, resets, state):
    """The gated delta rule over [B, S] rows, a chunk of min(64, S) tokens at a time, in fp32.

    q, k [B, S, K, H] (normalized; q scaled), v [B, S, K, G, U], g (log decay, <= 0) and beta
    [B, S, K, G], resets [B, S] bool (a document starts: the state before it is dropped), state
    [B, K, G, H, U] entering the first token. Returns o [B, S, K, G, U], the deltas each token
    wrote [B, S, K, G, U] and the state after the last token.
    """
    b, s = resets.shape
    chunk = min(CHUNK, s)
    pad = (-s) % chunk
    n = (s + pad) // chunk

    def chunked(x, heads_first):  # [B, S, *heads, X...] -> [B, N, *heads, L, X...]
        # Zero padding is inert: beta = 0 writes nothing and g = 0 does not decay the state.
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 2, 2 + heads_first)

    q, k = (chunked(x.astype(jnp.float32), 1) for x in (q, k))  # [B, N, K, L, H]
    v = chunked(v.astype(jnp.float32), 2)  # [B, N, K, G, L, U]
    g, beta = (chunked(x.astype(jnp.float32), 2) for x in (g, beta))  # [B, N, K, G, L]
    run = jnp.cumsum(chunked(resets, 0), axis=2)  # [B, N, L]: documents begun inside the chunk
    carried = (run == 0)[:, :, None, None]  # the token continues the state entering the chunk
    same = (run[..., :, None] == run[..., None, :]) & jnp.tri(chunk, dtype=bool)  # [B, N, L, L]: j <= i, one doc
    same = same[:, :, None, None]

    # Decays from the chunk start (cum) and between tokens of one document (pair, <= 1: masked
    # before the exponential, so no cross-document difference is ever formed into a factor).
    cum = jnp.cumsum(g, axis=-1)
    pair = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [B, N, K, G, L, L]
    incoming = jnp.where(carried, jnp.exp(cum), 0.0)  # [B, N, K, G, L]: the entering state's decay

    kk = _einsum("bnkih,bnkjh->bnkij", k, k)[:, :, :, None]
    qk = _einsum("bnkih,bnkjh->bnkij", q, k)[:, :, :, None]
    # delta_i + sum_{j<i} beta_i pair_ij (k_i.k_j) delta_j = beta_i (v_i - incoming_i S^T k_i):
    # solve for the parts from v and from S at once (the solve reads the strict lower triangle).
    system = beta[..., :, None] * pair * kk
    k_g = jnp.broadcast_to(k[:, :, :, None], (*v.shape[:-1], k.shape[-1]))  # [B, N, K, G, L, H]
    rhs = jnp.concatenate([beta[..., None] * v, (beta * incoming)[..., None] * k_g], axis=-1)
    solved = _einsum("...ij,...ju->...iu", _unit_lower_inverse(system), rhs)
    values, reads = jnp.split(solved, [v.shape[-1]], axis=-1)  # deltas = values - reads @ S
    scores = pair * qk  # [B, N, K, G, L, L]
    q_in = incoming[..., None] * q[:, :, :, None]  # [B, N, K, G, L, H]
    k_out = pair[..., -1, :, None] * k_g  # what each token leaves in the chunk's final state
    state_decay = incoming[..., -1, None, None]  # [B, N, K, G, 1, 1]

    def step(state, xs):
        values, reads, q_in, scores, k_out, state_decay = xs
        deltas = values - _einsum("bkglh,bkghu->bkglu", reads, state)
        o = _einsum("bkglh,bkghu->bkglu", q_in, state) + _einsum("bkgij,bkgju->bkgiu", scores, deltas)
        state = state_decay * state + _einsum("bkglh,bkglu->bkghu", k_out, deltas)
        return state, (o, deltas)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (values, reads, q_in, scores, k_out, state_decay))
    state, outs = jax.lax.scan(step, state.astype(jnp.float32), xs)

    def unchunked(x):  # [N, B, K, G, L, U] -> [B, S, K, G, U]
        return jnp.moveaxis(x, (0, 4), (1, 2)).reshape(b, n * chunk, *x.shape[2:4], x.shape[-1])[:, :s]

    o, deltas = (unchunked(x) for x in outs)
    return o, deltas, state


class GatedDeltaNet(nnx.Module):
    """The Gated DeltaNet token mixer of a Qwen3.5 / Qwen3-Next linear-attention layer.

    x arrives already normalized by the block's input norm; the block adds the output to its
    residual stream.
    """

    def __init__(
        self,
        config: LinearAttentionConfig,
        *,
        hidden_size,
        eps,
        param_dtype,
        compute_dtype,
        rngs: nnx.Rngs,
    ):
        if config.num_v_heads % config.num_k_heads:
            raise ValueError(
                f"linear attention: {config.num_v_heads} value heads do not group over {config.num_k_heads} key heads"
            )
        self.config = config
        self.compute_dtype = compute_dtype
        num_v_heads, head_v_dim = config.num_v_heads, config.head_v_dim
        key_dim, value_dim = config.num_k_heads * config.head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * key_dim + value_dim
        kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.in_proj_qkv = linear(hidden_size, self.conv_dim, **kw)
        self.in_proj_z = linear(hidden_size, value_dim, **kw)
        self.in_proj_b = linear(hidden_size, num_v_heads, **kw)
        self.in_proj_a = linear(hidden_size, num_v_heads, **kw)
        self.conv1d = CausalConv(self.conv_dim, config.conv_kernel_size, **kw)
        self.dt_bias = nnx.Param(jnp.ones((num_v_heads,), param_dtype))
        # A in [1, 16] as transformers initializes it; checkpoints overwrite it.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (num_v_heads,), param_dtype, 1.0, 16.0)))
        self.norm = GatedRMSNorm(head_v_dim, eps=eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.out_proj = linear(value_dim, hidden_size, **kw)

    def _heads(self, x: jax.Array, mixed: jax.Array):
        """x [B, S, D] and its conv output [B, S, C] -> q, k [B, S, K, H], v, z [B, S, K, G, U],
        g, beta [B, S, K, G] (q, k normalized, q scaled; v, z in the compute dtype)."""
        b, s, _ = x.shape
        c = self.config
        k_heads, g_heads = c.num_k_heads, c.num_v_heads // c.num_k_heads
        key_dim = k_heads * c.head_k_dim
        q, k, v = jnp.split(mixed, [key_dim, 2 * key_dim], axis=-1)
        q = _l2_normalized(q.reshape(b, s, k_heads, c.head_k_dim)) * c.head_k_dim**-0.5
        k = _l2_normalized(k.reshape(b, s, k_heads, c.head_k_dim))
        grouped = (b, s, k_heads, g_heads)  # value head k·G + g serves key head k, as transformers
        v = v.reshape(*grouped, c.head_v_dim)
        z = self.in_proj_z(x).reshape(*grouped, c.head_v_dim)
        beta = jax.nn.sigmoid(self.in_proj_b(x)).astype(jnp.float32).reshape(grouped)
        a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = (-jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)).reshape(grouped)
        return q, k, v, z, g, beta

    def _output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """o, z [B, S, K, G, U] -> [B, S, D]."""
        out = self.norm(o.astype(self.compute_dtype), z)
        return self.out_proj(out.reshape(*out.shape[:2], -1))

    def __call__(self, x: jax.Array, rows: PackedRows) -> jax.Array:
        """The block skeleton's packed forward (`mixers.PackedRows`)."""
        return self.packed(x, rows.segment_ids)

    def packed(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Packed rows: x [B, S, D], segment_ids [B, S] (0 = padding, documents contiguous) -> [B, S, D].

        Padding positions give finite values of no meaning.
        """
        width = self.config.conv_kernel_size
        resets = segment_ids != jnp.pad(segment_ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
        runs = jnp.cumsum(resets, axis=1)  # [B, S]: document number within the row, from 1
        inputs = jnp.pad(self.in_proj_qkv(x), ((0, 0), (width - 1, 0), (0, 0)))
        mixed = self.conv1d(inputs, jnp.pad(runs, ((0, 0), (width - 1, 0))))
        q, k, v, z, g, beta = self._heads(x, mixed)
        state = jnp.zeros((x.shape[0], *beta.shape[2:], self.config.head_k_dim, self.config.head_v_dim), jnp.float32)
        o, _, _ = gated_delta_rule(q, k, v, g, beta, resets, state)
        return self._output(o, z)

    def new_cache(self, batch: int, max_len: int, max_step: int = 1) -> LinearCache:
        """An empty cache for rows of `batch`, rolling back over at most `max_step` tokens (the
        decoder's block); a recurrent state needs no slots per token, so `max_len` is unused."""
        return self.empty_cache(batch, max_step)

    def empty_cache(self, batch: int, max_new: int) -> LinearCache:
        """An empty cache for rows of `batch`, rolling back over at most `max_new` tokens."""
        c = self.config
        g_heads = c.num_v_heads // c.num_k_heads
        heads = (batch, max_new, c.num_k_heads, g_heads)
        return LinearCache(
            state=jnp.zeros((batch, c.num_k_heads, g_heads, c.head_k_dim, c.head_v_dim), jnp.float32),
            inputs=jnp.zeros((batch, c.conv_kernel_size - 1 + max_new, self.conv_dim), self.compute_dtype),
            keys=jnp.zeros((batch, max_new, c.num_k_heads, c.head_k_dim), jnp.float32),
            deltas=jnp.zeros((*heads, c.head_v_dim), jnp.float32),
            decays=jnp.zeros(heads, jnp.float32),
            base=jnp.zeros((batch,), jnp.int32),
        )

    def decode(self, x: jax.Array, step: DecodeStep, cache: LinearCache) -> tuple[jax.Array, LinearCache]:
        """The block skeleton's decode (`mixers.DecodeStep`): a prefill of padded rows
        (`step.num_valid`) or new tokens that a later call may roll back."""
        if step.num_valid is not None:
            return self.prefill(x, cache, step.start, step.num_valid)
        return self.extend(x, cache, step.start)

    def prefill(
        self, x: jax.Array, cache: LinearCache, start: jax.Array, num_valid: jax.Array
    ) -> tuple[jax.Array, LinearCache]:
        """x [B, T, D] of which the first num_valid [B] tokens of each row are real, the rest
        padding that never touches the state (decay 0, no write) -> ([B, T, D], a cache as of
        start + num_valid, from which later calls go on; nothing of this call can be rolled back).
        """
        t = x.shape[1]
        r = start - cache.base
        inputs = jnp.concatenate([cache.window_after(r), self.in_proj_qkv(x).astype(cache.inputs.dtype)], axis=1)
        q, k, v, z, g, beta = self._heads(x, self.conv1d(inputs))
        real = (jnp.arange(t)[None, :] < num_valid[:, None])[..., None, None]  # [B, T, 1, 1]
        g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
        resets = jnp.zeros(x.shape[:2], bool)
        o, _, state = gated_delta_rule(q, k, v, g, beta, resets, cache.state_after(r))
        width = self.config.conv_kernel_size - 1
        window = jnp.take_along_axis(inputs, (num_valid[:, None] + jnp.arange(width))[..., None], axis=1)
        cache = LinearCache(
            state=state,
            inputs=jnp.pad(window, ((0, 0), (0, cache.keys.shape[1]), (0, 0))),
            keys=jnp.zeros_like(cache.keys),
            deltas=jnp.zeros_like(cache.deltas),
            decays=jnp.zeros_like(cache.decays),
            base=start + num_valid,
        )
        return self._output(o, z), cache

    def extend(self, x: jax.Array, cache: LinearCache, start: jax.Array) -> tuple[jax.Array, LinearCache]:
        """x [B, T, D], the tokens after the first start [B] of each row -> ([B, T, D], cache).

        `start` may roll back into the previous call's tokens (rejected drafts are forgotten).
        T may exceed the cache's M (a prefill): then only the last M tokens can be rolled back.
        """
        b, t, _ = x.shape
        m = cache.keys.shape[1]
        r = start - cache.base
        state = cache.state_after(r)
        inputs = jnp.concatenate([cache.window_after(r), self.in_proj_qkv(x).astype(cache.inputs.dtype)], axis=1)
        q, k, v, z, g, beta = self._heads(x, self.conv1d(inputs))
        resets = jnp.zeros((b, t), bool)

        def rule(tokens, state):  # the delta rule over tokens (a slice of the T) from state
            return gated_delta_rule(*(a[:, tokens] for a in (q, k, v, g, beta, resets)), state)

        # The first T-M tokens pass into the stored state; the last ones are kept for rollback.
        head = max(t - m, 0)
        o_head = []
        if head:
            o, _, state = rule(slice(0, head), state)
            o_head.append(o)
        tail = slice(head, t)
        o, deltas, _ = rule(tail, state)
        o = jnp.concatenate([*o_head, o], axis=1)

        def stored(x):  # the kept tokens' entries, zero-padded to the cache's M slots
            return jnp.pad(x, [(0, 0), (0, m - (t - head))] + [(0, 0)] * (x.ndim - 2))

        cache = LinearCache(
            state=state,
            inputs=stored(inputs[:, head:]),
            keys=stored(k[:, tail]),
            deltas=stored(deltas),
            decays=stored(jnp.cumsum(g[:, tail], axis=1)),
            base=start + head,
        )
        return self._output(o, z), cache


def gated_deltanet_macs(config: LinearAttentionConfig, hidden_size: int) -> int:
    """Multiply-adds a token of the packed forward: the projections (q, k, v, z, and b and a per
    value head; out), and per value head and chunk of L tokens the scores and decay-masked k·k
    (2·L·L·H), the solve and the intra-chunk outputs (2·L·L·U), the state read, correction and
    update (3·L·H·U)."""
    key, value = config.num_k_heads * config.head_k_dim, config.num_v_heads * config.head_v_dim
    projections = hidden_size * (2 * key + 2 * value + 2 * config.num_v_heads) + value * hidden_size
    per_head = 2 * CHUNK * (config.head_k_dim + config.head_v_dim) + 3 * config.head_k_dim * config.head_v_dim
    return projections + config.num_v_heads * per_head
