"""T5 relative position bias: a learned scalar per head for each bucket of key - query distance.

    relative_position[seq, kv_seq] = kv_position - query_position          (md.arange on each dim)
    bucket = relative_position_bucket(relative_position)                    (exact near, log far)
    bias[heads, seq, kv_seq] = table[bucket, heads]

:func:`relative_position_bucket` is Hugging Face's ``T5Attention._relative_position_bucket`` in
named ops, number for number (float32 logarithm, truncation toward zero). Half the buckets hold
exact distances ``0 .. max_exact - 1``, the rest logarithmically wider ranges up to
``max_distance``; bidirectional attention gives keys after the query their own half of the buckets.

Positions are built by ``md.arange``, so each device makes its own block of the bias; the lookup
is local whatever the layout splits (``heads`` over a tensor-parallel axis, ``seq`` for sequence
parallelism). T5 gives only the first layer a table and reuses its bias in every layer: compute
it once with that layer's module and pass it to the others (see :class:`~meshdsl.layers.Attention`).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .params import normal_param

__all__ = ["relative_position_bucket", "RelativePositionBias", "bias_of_positions"]


def relative_position_bucket(relative_position: md.NamedArray, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> md.NamedArray:
    """Bucket (int32, same dims) of each ``memory_position - query_position``, as HF T5 computes it."""
    n = relative_position
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = md.where(n > 0, num_buckets, 0)
        n = md.abs(n)
    else:
        n = -md.minimum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # log(n / max_exact) / log(max_distance / max_exact) * (num_buckets - max_exact), in float32;
    # n < max_exact takes the exact branch, so clamp it out of the logarithm's way (log 0).
    far = md.maximum(n, max_exact).astype(jnp.float32) / max_exact
    scaled = md.log(far) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    if_large = md.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
    return (buckets + md.where(is_small, n, if_large)).astype(jnp.int32)


def _length(dim, default_name: str) -> md.Dim:
    return dim if isinstance(dim, md.Dim) else md.Dim(default_name, int(dim))


class RelativePositionBias(nnx.Module):
    """Table ``[*stack, buckets, heads]``; ``__call__(seq, kv_seq)`` -> bias ``[heads, seq, kv_seq]``.

    ``scale``: init stddev (HF T5 uses ``d_model ** -0.5``; :class:`Attention` passes that).
    """

    def __init__(self, heads: md.Dim, *, rngs: nnx.Rngs, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, stack=None, scale: float = 1.0, param_dtype=jnp.float32):
        self.heads = heads
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.embedding = normal_param(rngs, [md.Dim("buckets", num_buckets), heads], scale, stack=stack,
                                      dtype=param_dtype)

    def __call__(self, query_len, key_len) -> md.NamedArray:
        """Bias for queries ``query_len`` (a Dim, e.g. ``seq:16``, or an int) and keys ``key_len``
        (``kv_seq``): ``[heads, seq, kv_seq]`` in the table's dtype."""
        seq, kv_seq = _length(query_len, "seq"), _length(key_len, "kv_seq")
        fn, table = self.blockwise()
        return md.transpose(fn(table, md.arange(seq), md.arange(kv_seq)), [self.heads.name, seq.name, kv_seq.name])

    def blockwise(self):
        """``(fn, table)`` for ``md.attention(..., bias=(fn, table))``: the bias computed on every
        block from its global positions, ``fn(table, q_positions, kv_positions)`` ``[kv_seq, seq,
        heads]``, so no ``[heads, seq, kv_seq]`` bias is held (long sequences)."""
        fn = functools.partial(bias_of_positions, bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                               max_distance=self.max_distance)
        return fn, self.embedding.get_value()


def bias_of_positions(table: md.NamedArray, q_positions: md.NamedArray, kv_positions: md.NamedArray, *,
                      bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128) -> md.NamedArray:
    """T5's bias ``table[bucket(kv_position - q_position), heads]`` of the positions given:
    ``[kv_seq, seq, heads]`` (the dims of the positions and the table's heads)."""
    bucket = relative_position_bucket(kv_positions - q_positions, bidirectional, num_buckets, max_distance)
    return md.take(table, bucket, "buckets")
