"""T5 multi-head attention over named dims: self-attention (bidirectional or causal) and
cross-attention, with the relative position bias of :mod:`meshdsl.layers.position`.

    q[batch, seq, heads, d_kv]     = x · Wq                    (x: [batch, seq, d_model])
    k, v[batch, kv_seq, heads, d_kv] = rename(x or context, seq -> kv_seq) · Wk, Wv
    logits[batch, heads, seq, kv_seq] = float32(q · k)  + bias[heads, seq, kv_seq]
                                        + (0 where allowed, else float32 min)
    weights = dropout(softmax over kv_seq of logits)
    y[batch, seq, d_model]          = (weights · v) · Wo

computed by ``md.attention`` (blockwise, no ``[seq, kv_seq]`` weights held; context parallelism
when the layout splits ``seq``); only with dropout on the weights are they materialised.

As in T5 there are no biases and no ``1 / sqrt(d_kv)`` (it is folded into Wq's init, stddev
``(d_model * d_kv) ** -0.5``). ``allowed`` combines the causal mask (``kv_position <= position``,
from ``md.arange``) and an optional key padding mask ``[batch, kv_seq]``; a masked logit gets
float32's most negative value added, once, as in Hugging Face's T5.

Communication is the layout's: Megatron (``heads`` split) needs none until ``Wo`` leaves a pending
partial sum over the split heads, reduced once (in the backward pass the q, k and v input
cotangents are added before that one reduction); sequence-parallel layouts gather ``kv_seq``;
splitting ``kv_seq`` itself costs two small all-reduces of softmax statistics, never a gather.

T5 gives only the first layer of a stack a relative-position table; the others reuse its bias.
``__call__`` therefore takes an optional precomputed ``bias`` and returns the bias it used, so a
model computes it once (outside ``md.scan``) and passes it to every layer.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .dense import Dense
from .dropout import dropout
from .position import RelativePositionBias

__all__ = ["Attention", "MASK_VALUE", "KV_LENGTH"]

KV_LENGTH = "kv_length"   # the positions of a decoding KV cache

MASK_VALUE = float(jnp.finfo(jnp.float32).min)


class Attention(nnx.Module):
    """T5 attention: projections ``q, k, v: [d_model, heads, d_kv]``, ``o: [heads, d_kv, d_model]``.

    ``causal``: decoder self-attention. ``relative_bias``: own a :class:`RelativePositionBias`
    (``relative_attention_bias``, bidirectional unless ``causal``); T5's first layer does, the
    others and cross-attention do not. ``dropout_rate`` applies to the attention weights.
    """

    def __init__(self, d_model: md.Dim, heads: md.Dim, d_kv: md.Dim, *, rngs: nnx.Rngs, causal: bool = False,
                 relative_bias: bool = True, bidirectional: bool | None = None, num_buckets: int = 32,
                 max_distance: int = 128, dropout_rate: float = 0.0, stack=None, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.d_model, self.heads, self.d_kv = d_model, heads, d_kv
        self.causal, self.dropout_rate = causal, dropout_rate
        dense = dict(rngs=rngs, stack=stack, dtype=dtype, param_dtype=param_dtype)
        inner = [heads, d_kv]
        self.q = Dense(d_model, inner, scale=(d_model.size * d_kv.size) ** -0.5, **dense)
        self.k = Dense(d_model, inner, scale=d_model.size ** -0.5, **dense)
        self.v = Dense(d_model, inner, scale=d_model.size ** -0.5, **dense)
        self.o = Dense(inner, d_model, scale=(heads.size * d_kv.size) ** -0.5, **dense)
        self.relative_attention_bias = RelativePositionBias(
            heads, rngs=rngs, num_buckets=num_buckets, max_distance=max_distance,
            bidirectional=(not causal) if bidirectional is None else bidirectional, stack=stack,
            scale=d_model.size ** -0.5, param_dtype=param_dtype) if relative_bias else None

    def __call__(self, x: md.NamedArray, context: md.NamedArray | None = None, *,
                 bias: md.NamedArray | None = None, key_mask: md.NamedArray | None = None, key=None):
        """Attend from ``x`` ``[batch, seq, d_model]`` to itself, or to ``context`` (the encoder's
        output ``[batch, seq, d_model]``; its ``seq`` becomes ``kv_seq``).

        ``bias``: a precomputed position bias ``[heads, seq, kv_seq]``, or ``(fn, table)`` that
        computes it on every block (:meth:`RelativePositionBias.blockwise`; skips this layer's own
        table). ``key_mask``: 1/True for real keys, ``[batch, kv_seq]`` (a ``seq`` dim is read as
        ``kv_seq``). ``key``: PRNG key for dropout on the weights (None: deterministic).
        Returns ``(y [batch, seq, d_model], bias)``; ``bias`` is None without a table or a given bias.
        """
        source = x if context is None else context
        q = self.q(x)
        kv_in = _as_keys(source)
        k, v = self.k(kv_in), self.v(kv_in)

        if bias is None and self.relative_attention_bias is not None:
            bias = self.relative_attention_bias(q.dims["seq"], k.dims["kv_seq"])
        if self.dropout_rate and key is not None:   # dropout on the weights: they are materialised
            whole = _whole(bias, q.dims["seq"], k.dims["kv_seq"])
            mixed = self._weights_dropped(q, k, v, whole, self._allowed(q.dims["seq"], k.dims["kv_seq"], key_mask), key)
        else:
            mixed = md.attention(q, k, v, over="kv_seq", length="seq", features=self.d_kv.name, bias=bias,
                                 mask=_key_mask(key_mask), causal=self.causal, scale=1.0)
        return self.o(mixed), bias

    # -- decoding: one position at a time against a KV cache -----------------------------------

    def keys_values(self, context: md.NamedArray):
        """``(k, v)`` ``[batch, kv_seq, heads, d_kv]`` of ``context`` ``[batch, seq, d_model]``:
        cross-attention's keys and values, computed once per generation."""
        kv_in = _as_keys(context)
        return self.k(kv_in), self.v(kv_in)

    def decode(self, x: md.NamedArray, cache_k: md.NamedArray, cache_v: md.NamedArray, position, *,
               bias: md.NamedArray | None = None):
        """Causal self-attention of the one new position ``x`` ``[batch, seq:1, d_model]`` at
        ``position`` (a traced int) with a KV cache ``[batch, kv_length, heads, d_kv]``.

        The new keys and values are written in place (``md.dynamic_update_slice`` along
        ``kv_length``: with ``kv_length`` split only the owning device writes); keys after
        ``position`` are masked. ``bias``: ``[heads, kv_length]``, the relative position bias of
        the query at ``position``. Returns ``(y [batch, seq:1, d_model], cache_k, cache_v)``.
        """
        q = self.q(x)
        k_new, v_new = _one_position(self.k(x)), _one_position(self.v(x))   # without seq:1
        cache_k = md.dynamic_update_slice(cache_k, k_new.astype(cache_k.dtype), KV_LENGTH, position)
        cache_v = md.dynamic_update_slice(cache_v, v_new.astype(cache_v.dtype), KV_LENGTH, position)
        allowed = md.arange(cache_k.dims[KV_LENGTH]) <= position
        y = self._attend(q, cache_k, cache_v, KV_LENGTH, bias, allowed)
        return y, cache_k, cache_v

    def decode_cross(self, x: md.NamedArray, k: md.NamedArray, v: md.NamedArray, *, key_mask=None):
        """Cross-attention of ``x`` ``[batch, seq:1, d_model]`` to precomputed encoder keys and
        values ``[batch, kv_seq, heads, d_kv]`` (:meth:`keys_values`); ``key_mask`` ``[batch, kv_seq]``."""
        return self._attend(self.q(x), k, v, "kv_seq", None, _key_mask(key_mask))

    def _attend(self, q, k, v, kv_name, bias, allowed):
        return self.o(md.attention(q, k, v, over=kv_name, length="seq", features=self.d_kv.name, bias=bias,
                                   mask=allowed, scale=1.0))

    def _weights_dropped(self, q, k, v, bias, allowed, key):
        """Attention with dropout on its weights (training with ``dropout_rate``): the weights
        ``[batch, heads, seq, kv_seq]`` are materialised, as Hugging Face's T5 does."""
        batch = [n for n in q.names if n not in ("seq", self.heads.name, self.d_kv.name)]
        logits = md.einsum(q, k, out=[*batch, self.heads.name, "seq", "kv_seq"],
                           preferred_element_type=jnp.float32)
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        if allowed is not None:
            logits = logits + md.where(allowed, 0.0, MASK_VALUE)
        weights = dropout(md.softmax(logits, "kv_seq").astype(v.dtype), self.dropout_rate, key)
        return md.einsum(weights, v, out=[*batch, "seq", self.heads.name, self.d_kv.name])

    def _allowed(self, seq: md.Dim, kv_seq: md.Dim, key_mask):
        """Boolean ``[(batch,) seq, kv_seq]``: which keys each query may see (None: all)."""
        allowed = None
        if self.causal:
            allowed = md.arange(kv_seq) <= md.arange(seq)
        real = _key_mask(key_mask)
        if real is not None:
            allowed = real if allowed is None else allowed & real
        return allowed


def _whole(bias, seq: md.Dim, kv_seq: md.Dim):
    """A bias ``(fn, table)`` computed for every position (the weights are materialised anyway)."""
    if isinstance(bias, tuple):
        fn, table = bias
        return fn(table, md.arange(seq), md.arange(kv_seq))
    return bias


def _key_mask(key_mask):
    """A key padding mask ``[batch, kv_seq]`` as booleans (True: a real key), or None."""
    if key_mask is None:
        return None
    real = _as_keys(key_mask)
    return real if real.dtype == jnp.bool_ else md.not_equal(real, 0)


def _one_position(t: md.NamedArray) -> md.NamedArray:
    """``t`` without its ``seq:1`` dim: one cache entry (written by the owner of its position)."""
    return md.sum(t, "seq")     # a sum over one entry: exact, and local whatever else is split


def _as_keys(t: md.NamedArray) -> md.NamedArray:
    """Key/value positions are named ``kv_seq``: rename ``seq`` unless already done."""
    return t if "kv_seq" in t.names else md.rename(t, {"seq": "kv_seq"})

