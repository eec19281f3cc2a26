"""Attention with its logits materialised, in named ops: ``einsum``, ``softmax``, ``einsum``.

The candidate the planner weighs where a layout splits the features q and k contract: the
logits' einsum leaves a pending sum over those axes, reduced once (one all-reduce of
``[stats, over]``), where the blockwise rule would gather q and k whole first. Which moves fewer
bytes depends on the sizes (short sequences, long features: the logits); memory grows with the
square of the length here, so the planner takes it only where its bytes are fewer.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import flash
from ..names.named import NamedArray, named
from .einsum import einsum
from .elementwise import less_equal, where
from .creation import arange
from .reductions import softmax

__all__ = ["dense_attention"]


def dense_attention(ctx, spec, dims, q, k, v, bias, mask, pos) -> NamedArray:
    """``softmax(scale q . k + bias, masked) . v`` over ``spec``'s dims, the logits whole."""
    stats = [n for n in spec.stats]
    logits = einsum(q, k, out=[*stats, spec.over], preferred_element_type=jnp.float32) * spec.scale
    if isinstance(bias, tuple):   # computed from the positions: here for the whole logits
        fn, table = bias
        bias = fn(table, _positions(pos[0], dims[spec.length]), _positions(pos[1], dims[spec.over]))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    allowed = mask
    if spec.causal:
        seen = less_equal(_positions(pos[1], dims[spec.over]), _positions(pos[0], dims[spec.length]))
        allowed = seen if allowed is None else allowed & seen
    if allowed is not None:
        logits = logits + where(allowed, 0.0, flash.MASK_VALUE)
    weights = softmax(logits, spec.over).astype(v.dtype)
    return einsum(weights, v, out=list(spec.out))


def _positions(p, dim) -> NamedArray:
    if p is None:
        return arange(dim)
    if isinstance(p, np.ndarray):
        return named(jnp.asarray(p, jnp.int32), dim.name)
    return p
