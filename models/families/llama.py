"""A Llama-style decoder-only language model (Touvron et al. 2023), written in meshdsl's named ops.

    model(ids) -> logits [batch, length, vocab]          ids: integer [batch, <length>]

Structure (Hugging Face's ``LlamaForCausalLM``, so weights import 1:1, :mod:`meshdsl.models.hub.hf_llama`):

    x = embed[ids]                                                   [batch, length, d_model]
    cos, sin = rotary_angles(positions, d_head, rope_theta)          [(batch,) seq, d_head/2]
    L x  x = x + GQA(RMSNorm(x), cos, sin)          causal, q [batch, seq, kv_heads, groups, d_head]
         x = x + SwiGLU(RMSNorm(x))                 down(silu(gate(x)) * up(x)) over d_ff
    logits = lm_head(RMSNorm(x))                    (tied: embed.attend(RMSNorm(x)))
    logits[vocab >= config.vocab] = min             (the padding rows of the tables: never chosen)

Mixture of experts (``config.experts > 0``: Mixtral, Qwen2-MoE): every layer's SwiGLU is a
dropless top-k :class:`~meshdsl.layers.DroplessMoE` (same ``ffn_norm``), ``experts`` of
``moe_d_ff`` and optionally a gated shared expert; Qwen's attention adds q/k/v biases
(``qkv_bias``). With a ``head``, the router's metrics (load-balancing loss, z-loss, expert load)
ride in the scan's carry as one value per row ``[batch]`` and reach ``head(logits, router)`` as
their means over the layers (each layer's over its tokens; per microbatch under a pipeline).

RMSNorm is ``x * rsqrt(mean(x**2 over d_model) + eps) * weight`` with float32 statistics; the
attention scale is ``1 / sqrt(d_head)`` (``md.attention``'s default); there are no biases and no
dropout. Positions default to ``0 .. length-1`` for every row; ``positions=`` (e.g. ``[batch,
length]`` for left-padded prompts) and a ``mask`` of the keys a query may see go with them.

The layers are one stacked module (parameters ``[layers, ...]``) run by ``md.scan``, so compile
time does not grow with depth, and a layout that splits ``layers`` (``layers: pipe`` with
``microbatches``) runs the stack as a pipeline; ``forward(..., head=loss)`` computes the loss as
the stack's head (inside the pipeline under ``schedule="1f1b"``).

As in T5 (:mod:`meshdsl.models.t5`), the residual stream runs over ``[batch, length, d_model]`` and
each sub-layer (and the embedding lookup and the logits) renames ``length`` to ``seq`` on the way
in and back on the way out: free without a rule for ``length``; ``length: model`` is Megatron
sequence parallelism (one all-gather into each sub-layer, one reduce-scatter out);
``length``, ``seq`` and ``kv_seq`` on one axis ``ctx`` is context parallelism (``md.attention``
gathers or rotates the keys). The data's own token dim name (e.g. ``targets``) comes back on the
logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import meshdsl as md
from meshdsl.layers import (
    Dense, DroplessMoE, Embedding, FeedForward, GroupedQueryAttention, RMSNorm, scan_layers,
)
from meshdsl.layers.embedding import mask_padding
from meshdsl.layers.gqa import SEQ
from meshdsl.layers.rotary import rotary_angles
from meshdsl.layers.router import EXPERT_CHOICE

from .llama_configs import LlamaConfig

__all__ = ["Llama", "LlamaBlock", "count_params"]


class _Dims:
    def __init__(self, c: LlamaConfig):
        self.d_model, self.d_ff = md.Dim("d_model", c.d_model), md.Dim("d_ff", c.d_ff)
        self.kv_heads, self.groups = md.Dim("kv_heads", c.kv_heads), md.Dim("groups", c.groups)
        self.d_head, self.vocab = md.Dim("d_head", c.head_dim), md.Dim("vocab", c.padded_vocab)
        self.layers = md.Dim("layers", c.layers)
        self.experts = md.Dim("experts", max(c.experts, 1))
        self.expert_d_ff = md.Dim("d_ff", c.expert_d_ff)
        self.shared_d_ff = md.Dim("d_shared", c.shared_d_ff) if c.shared_d_ff else None


def _ffn(c: LlamaConfig, dims: _Dims, **kw):
    """SwiGLU over ``d_ff``, or (``c.experts > 0``) the dropless mixture of experts."""
    if not c.is_moe:
        return FeedForward(dims.d_model, dims.d_ff, activation=c.activation, **kw)
    return DroplessMoE(dims.d_model, dims.expert_d_ff, dims.experts, top_k=c.top_k, normalize=c.normalize_gates,
                       activation=c.activation, shared_d_ff=dims.shared_d_ff, exchange_factor=c.exchange_factor, **kw)


class LlamaBlock(nnx.Module):
    """One decoder layer (stacked: every parameter ``[layers, ...]``): pre-normed causal
    grouped-query self-attention and SwiGLU feed-forward (or a mixture of experts), each added
    to the residual stream."""

    def __init__(self, c: LlamaConfig, dims: _Dims, *, rngs, stack, dtype, param_dtype):
        kw = dict(stack=stack, param_dtype=param_dtype)
        self.sparse = c.is_moe
        self.attention_norm = RMSNorm(dims.d_model, eps=c.eps, **kw)
        self.attention = GroupedQueryAttention(dims.d_model, dims.kv_heads, dims.groups, dims.d_head, rngs=rngs,
                                               dtype=dtype, bias=c.qkv_bias, **kw)
        self.ffn_norm = RMSNorm(dims.d_model, eps=c.eps, **kw)
        self.ffn = _ffn(c, dims, rngs=rngs, dtype=dtype, **kw)

    def __call__(self, x, angles, mask=None, keys_values: bool = False):
        """``x`` ``[batch, length, d_model]`` -> the same dims (and the layer's keys and values
        ``[batch, kv_seq, kv_heads, d_head]`` with ``keys_values``)."""
        x, kv, _ = self.run(x, angles, mask, keys_values)
        return (x, kv) if keys_values else x

    def run(self, x, angles, mask=None, keys_values: bool = False):
        """``(x, keys and values or None, the MoE layer's metrics or {})``: :meth:`__call__` with
        the router's metrics."""
        h = self.attention(_enter(self.attention_norm(x)), angles, mask=mask, keys_values=keys_values)
        h, kv = h if keys_values else (h, None)
        x = x + _leave(h)
        h, metrics = self.feed_forward(_enter(self.ffn_norm(x)))
        return x + _leave(h), kv, metrics

    def feed_forward(self, x):
        """``(ffn(x), metrics)``: the MoE's router metrics, ``{}`` for SwiGLU."""
        return self.ffn(x) if self.sparse else (self.ffn(x), {})

    def decode(self, x, angles, cache_k, cache_v, slot, mask=None):
        """One new position ``x`` ``[batch, seq:1, d_model]`` in cache slot ``slot``, with this
        layer's KV cache ``[batch, kv_length, kv_heads, d_head]``: ``(x, cache_k, cache_v)``."""
        h, cache_k, cache_v = self.attention.decode(self.attention_norm(x), angles, cache_k, cache_v, slot, mask=mask)
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))[0], cache_k, cache_v


class Llama(nnx.Module):
    """Decoder-only Llama over named dims; see the module docstring."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        c = self.config = config
        dims = self.dims = _Dims(c)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        self.embed = Embedding(dims.vocab, dims.d_model, scale=c.init_std, **kw)
        self.layers = LlamaBlock(c, dims, stack=dims.layers, **kw)
        self.norm = RMSNorm(dims.d_model, eps=c.eps, param_dtype=param_dtype)
        self.lm_head = None if c.tie_embeddings else Dense(dims.d_model, dims.vocab, scale=c.init_std, **kw)

    def __call__(self, ids: md.NamedArray, **kw) -> md.NamedArray:
        """Logits ``[batch, <ids' length dim>, vocab]``; see :meth:`forward` for the options."""
        return self.forward(ids, **kw)

    def forward(self, ids, *, positions=None, mask=None, key=None, train=False, remat="none", head=None,
                schedule=None):
        """Logits ``[batch, <length>, vocab]`` of token ids ``[batch, <length>]`` (any name for the
        token dim; it comes back on the logits). ``positions``: integer ``[(batch,) length]``
        (or ``seq``; default ``0 .. length-1``); ``mask``: boolean, true where a query may attend a key
        (``[batch, kv_seq]`` or with ``seq`` too), on top of the causal mask. ``head``: a
        function of the logits (a loss summed over the rows, see ``md.scan``), run as the layer
        stack's head; then returns ``head(logits)``, for a MoE config ``head(logits, router)``
        (the router's metrics, each a mean over the layers). ``key`` and ``train``: accepted for
        the trainer (Llama has no dropout). ``remat``: the stack's remat policy."""
        del key, train
        ids, name = _as_tokens(ids)
        x = _leave(self.embed(_enter(ids)))
        if positions is not None and "length" in positions.names:
            positions = _enter(positions)
        angles = self.angles(md.Dim(SEQ, ids.dims["length"].size), positions)

        def logits(x):
            return md.rename(self.logits(_enter(x)), {SEQ: name})

        if self.config.is_moe:
            return self._sparse_forward(x, angles, mask, logits, remat, head, schedule)

        def step(layer, x, _):
            return layer(x, angles, mask), None

        top = None if head is None else (lambda x: head(logits(x)))
        x, _ = scan_layers(self.layers, x, step, remat=remat, head=top, schedule=schedule)
        return x if head is not None else logits(x)

    def _sparse_forward(self, x, angles, mask, logits, remat, head, schedule):
        """The MoE stack: each layer's router metrics added to the carry, one value per row
        (``[batch]``, ``expert_load`` ``[batch, expert_choice]``), so that a pipeline splits them
        with the rows; ``head(logits, router)`` gets their means over the layers."""
        rows, n = x.dims["batch"], self.config.layers
        sums = {name: md.zeros(md.Shape([rows, *extra])) for name, extra in self._metric_dims().items()}

        def step(layer, carry, _):
            x, sums = carry
            x, _, m = layer.run(x, angles, mask)
            m = {**m, "expert_load": md.rename(m["expert_load"], {"experts": EXPERT_CHOICE})}
            return (x, {name: v + m[name] for name, v in sums.items()}), None

        def top(carry):
            y, sums = carry
            return head(logits(y), {name: md.sum(v, "batch") / float(rows.size * n) for name, v in sums.items()})

        out, _ = scan_layers(self.layers, (x, sums), step, remat=remat, head=None if head is None else top,
                             schedule=schedule)
        return out if head is not None else logits(out[0])

    def _metric_dims(self) -> dict:
        """The dims besides ``batch`` of each router metric carried per row."""
        experts = md.Dim(EXPERT_CHOICE, self.dims.experts.size)
        return {"load_balancing_loss": [], "router_z_loss": [], "dropped_fraction": [], "expert_load": [experts]}

    def angles(self, seq: md.Dim, positions=None):
        """``(cos, sin)`` ``[(batch,) seq, d_head/2]`` of ``positions`` (default ``0 .. seq-1``)."""
        if positions is None:
            positions = md.arange(seq)
        return rotary_angles(positions, self.dims.d_head, self.config.rope_theta)

    def logits(self, x: md.NamedArray) -> md.NamedArray:
        """``[..., d_model]`` (the residual stream, before the final norm) -> ``[..., vocab]``, the
        padding rows of the vocabulary masked (:func:`~meshdsl.layers.embedding.mask_padding`)."""
        y = self.norm(x)
        return mask_padding(self.embed.attend(y) if self.lm_head is None else self.lm_head(y), self.config.vocab)


def _enter(x):
    """Into a sub-layer (and the embedding lookup and the logits): the residual stream's
    ``length`` becomes the whole sequence ``seq`` (gathered here under ``length: model``)."""
    return md.rename(x, {"length": SEQ})


def _leave(h):
    """Out of a sub-layer: back to ``length`` (a pending sum is reduce-scattered onto it)."""
    return md.rename(h, {SEQ: "length"})


def _as_tokens(ids: md.NamedArray):
    """``(ids as [batch, length], the caller's name for the token dim)``."""
    if not isinstance(ids, md.NamedArray):
        raise md.ShapeError(f"Llama: token ids must be a NamedArray [batch, length], got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise md.ShapeError(f"Llama: token ids [{ids.dims}] must be integers, got {ids.dtype}")
    if ids.ndim != 2 or "batch" not in ids.names:
        raise md.ShapeError(f"Llama expects token ids [batch, <length>], got [{ids.dims}]")
    name = next(n for n in ids.names if n != "batch")
    ids = ids if name == "length" else md.rename(ids, {name: "length"})
    return (ids if ids.names == ("batch", "length") else md.transpose(ids, "batch length")), name


def count_params(model_or_config) -> int:
    """Number of parameters (without materializing them when given a config)."""
    if isinstance(model_or_config, LlamaConfig):
        model = nnx.eval_shape(lambda: Llama(model_or_config, rngs=nnx.Rngs(0)))
    else:
        model = model_or_config
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, md.NamedArray))
    return sum(leaf.size if isinstance(leaf, md.NamedArray) else int(jnp.size(leaf)) for leaf in leaves)
