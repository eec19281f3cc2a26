"""Grouped-query attention (Ainslie et al. 2023) with rotary positions, as in Llama 2/3.

    q[batch, seq, kv_heads, groups, d_head] = rotate(x · Wq)             (x: [batch, seq, d_model])
    k[batch, kv_seq, kv_heads, d_head]      = rotate(rename(x, seq -> kv_seq) · Wk)
    v[batch, kv_seq, kv_heads, d_head]      = rename(x, seq -> kv_seq) · Wv
    mixed[batch, seq, kv_heads, groups, d_head] = md.attention(q, k, v, over=kv_seq, causal=True)
    y[batch, seq, d_model]                  = mixed · Wo

``groups`` query heads share each of the ``kv_heads`` key/value heads: ``groups`` is a dim of ``q``
only, so the sharing is name broadcasting inside ``md.attention`` (no copies of ``k`` and ``v``).
Query head ``h`` of Hugging Face's ``q_proj`` is ``(kv_head, group) = divmod(h, groups)``, which is
the row-major order of ``[kv_heads, groups]`` (HF's ``repeat_kv``). Multi-head attention is
``groups = 1``, multi-query attention ``kv_heads = 1``. ``md.attention`` scales the logits by
``1 / sqrt(d_head)`` and computes the softmax in float32. No biases (Llama's), or with ``bias``
biases on the query, key and value projections (Qwen's: ``q = x · Wq + bq`` before rotation).

The dims are T5's (:mod:`meshdsl.layers.attention`): queries over ``seq``, keys over ``kv_seq``,
a decoding cache over ``kv_length``. Communication is the layout's: Megatron splits ``kv_heads``
(every device holds whole groups of query heads with their key/value head; ``Wo`` leaves one
pending sum over the split heads); context parallelism splits ``seq`` and ``kv_seq`` on one axis
(``md.attention`` gathers or rotates the keys); a split cache (``kv_length``) costs the small
softmax statistics of ``md.attention``'s own rule.

Decoding (:meth:`GroupedQueryAttention.decode`) writes the new position's keys and values into a
cache ``[batch, kv_length, kv_heads, d_head]`` with ``md.dynamic_update_slice`` (with
``kv_length`` split only the owning device writes) and attends over the whole cache, the slots
after the query's masked by position.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .dense import Dense
from .params import cast, constant_param
from .rotary import apply_rotary

__all__ = ["GroupedQueryAttention", "SEQ", "KV_SEQ", "KV_LENGTH"]

SEQ = "seq"                # query positions
KV_SEQ = "kv_seq"          # key positions: the same sequence renamed
KV_LENGTH = "kv_length"    # the positions of a decoding KV cache


class GroupedQueryAttention(nnx.Module):
    """Kernels ``q: [d_model, kv_heads, groups, d_head]``, ``k, v: [d_model, kv_heads, d_head]``,
    ``o: [kv_heads, groups, d_head, d_model]`` (each ``[*stack, ...]``); init ``N(0, scale**2)``,
    ``scale`` default ``fan_in ** -0.5``. ``bias``: ``q_bias [kv_heads, groups, d_head]``,
    ``k_bias``, ``v_bias [kv_heads, d_head]`` (zeros at init)."""

    def __init__(self, d_model: md.Dim, kv_heads: md.Dim, groups: md.Dim, d_head: md.Dim, *, rngs: nnx.Rngs,
                 stack=None, scale: float | None = None, dtype=jnp.float32, param_dtype=jnp.float32,
                 bias: bool = False):
        self.d_model, self.kv_heads, self.groups, self.d_head = d_model, kv_heads, groups, d_head
        dense = dict(rngs=rngs, stack=stack, dtype=dtype, param_dtype=param_dtype, scale=scale)
        self.q = Dense(d_model, [kv_heads, groups, d_head], **dense)
        self.k = Dense(d_model, [kv_heads, d_head], **dense)
        self.v = Dense(d_model, [kv_heads, d_head], **dense)
        self.o = Dense([kv_heads, groups, d_head], d_model, **dense)
        self.dtype = dtype
        zeros = dict(stack=stack, dtype=param_dtype)
        self.q_bias = constant_param([kv_heads, groups, d_head], 0.0, **zeros) if bias else None
        self.k_bias = constant_param([kv_heads, d_head], 0.0, **zeros) if bias else None
        self.v_bias = constant_param([kv_heads, d_head], 0.0, **zeros) if bias else None

    def __call__(self, x: md.NamedArray, angles, *, mask: md.NamedArray | None = None, keys_values: bool = False):
        """Causal self-attention of ``x`` ``[batch, seq, d_model]``; ``angles``: ``(cos, sin)``
        of the positions (:func:`~meshdsl.layers.rotary.rotary_angles`, ``[(batch,) seq, d_head/2]``).
        ``mask``: boolean, true where a query may attend a key (e.g. key padding ``[batch,
        kv_seq]``), on top of the causal mask. Returns ``y [batch, seq, d_model]``, or
        ``(y, (k, v))`` with the rotated keys and the values ``[batch, kv_seq, kv_heads, d_head]``
        when ``keys_values`` (prefilling a KV cache)."""
        q, k, v = self._project(x, angles)
        k, v = _as_keys(k), _as_keys(v)
        mixed = md.attention(q, k, v, over=KV_SEQ, length=SEQ, features=self.d_head.name, mask=mask, causal=True)
        y = self.o(mixed)
        return (y, (k, v)) if keys_values else y

    def decode(self, x: md.NamedArray, angles, cache_k: md.NamedArray, cache_v: md.NamedArray, slot, *,
               mask: md.NamedArray | None = None):
        """Attention of the one new position ``x`` ``[batch, seq:1, d_model]`` in cache slot
        ``slot`` (a traced int) to a KV cache ``[batch, kv_length, kv_heads, d_head]``: its keys
        and values are written at ``slot``, the slots after it masked. ``angles``: of its position
        (``[(batch,) seq:1, d_head/2]``); ``mask``: e.g. the cache's padding ``[batch, kv_length]``.
        Returns ``(y [batch, seq:1, d_model], cache_k, cache_v)``."""
        q, k, v = self._project(x, angles)
        cache_k = md.dynamic_update_slice(cache_k, _one_position(k).astype(cache_k.dtype), KV_LENGTH, slot)
        cache_v = md.dynamic_update_slice(cache_v, _one_position(v).astype(cache_v.dtype), KV_LENGTH, slot)
        q_positions = md.arange(q.dims[SEQ]) + slot
        kv_positions = md.arange(cache_k.dims[KV_LENGTH])
        mixed = md.attention(q, cache_k, cache_v, over=KV_LENGTH, length=SEQ, features=self.d_head.name,
                             mask=mask, causal=True, q_positions=q_positions, kv_positions=kv_positions)
        return self.o(mixed), cache_k, cache_v

    def _project(self, x, angles):
        cos, sin = angles
        q = apply_rotary(self._biased(self.q(x), self.q_bias), cos, sin, self.d_head.name)
        k = apply_rotary(self._biased(self.k(x), self.k_bias), cos, sin, self.d_head.name)
        return q, k, self._biased(self.v(x), self.v_bias)

    def _biased(self, y, bias):
        """``y + bias`` (no bias: ``y`` itself)."""
        return y if bias is None else y + cast(bias.get_value(), self.dtype)


def _as_keys(t: md.NamedArray) -> md.NamedArray:
    """Keys and values are indexed by ``kv_seq``: the sequence's positions renamed."""
    return md.rename(t, {SEQ: KV_SEQ})


def _one_position(t: md.NamedArray) -> md.NamedArray:
    """``t`` without its ``seq:1`` dim: one cache entry (a sum over one entry: exact and local)."""
    return md.sum(t, SEQ)
