"""Ops that create tensors: full/zeros/ones, arange, and counter-based random numbers.

Each device builds only its block of the layout's placement, with no communication. Random
numbers are a function of the key and each element's *global* position (threefry on the global
linear index, as ``jax.random`` does with partitionable threefry), so every layout - and one
device - draws the same values: dropout masks and initializers are layout-invariant. For tensors
under 2**32 elements the values equal ``jax.random.uniform/normal/bernoulli`` on the global shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from ..rewrite import collectives as C
from ..names.errors import ShapeError
from ..platform.jaxcompat import varying_axes
from .common import new_dims, where_
from ..names.named import NamedArray
from .registry import op

__all__ = ["full", "zeros", "ones", "arange", "normal", "uniform", "bernoulli"]


def _blocks(ctx, dims):
    """Layout placement of fresh dims, local block sizes, and the axes the block varies over."""
    axes = ctx.plan(dims, [])
    local = [d.size // ctx.axes_size(axes[d.name]) for d in dims]
    vary = tuple(a for a in (ctx.mesh.factor_axes if ctx.mesh else ()) if a in ctx.vary(axes.values()))
    return axes, local, vary


def _global_iota(ctx, dims, axes, local, k, dtype):
    """Global index along dim ``k`` of each element of the local block."""
    d = dims[k]
    iota = jax.lax.broadcasted_iota(dtype, local, k)
    start = ctx.block_start(d.name, d.size, axes[d.name], local[k])
    if jnp.ndim(start) == 1:   # the entries' own positions (a pipeline's microbatch, placed otherwise)
        return jax.lax.broadcast_in_dim(jnp.asarray(start).astype(dtype), local, (k,))
    return iota if isinstance(start, int) and start == 0 else iota + jnp.asarray(start).astype(dtype)


@op("full")
def full(ctx, dims, value, dtype=None) -> NamedArray:
    """A tensor of ``value`` with the given dims (sizes written: ``"batch:8 d_model:16"``)."""
    dims = new_dims(ctx, dims, "dims")
    axes, local, vary = _blocks(ctx, dims)
    return ctx.out(C.cast(ctx, jnp.full(local, value, dtype), vary), dims, axes)


def zeros(dims, dtype=jnp.float32):
    return full(dims, 0, dtype)


def ones(dims, dtype=jnp.float32):
    return full(dims, 1, dtype)


@op("arange")
def arange(ctx, dim, dtype=jnp.int32) -> NamedArray:
    """``0 .. size-1`` along one new dim (positions, e.g. for relative position buckets)."""
    dims = new_dims(ctx, dim, "arange dim")
    if len(dims) != 1:
        raise ShapeError(f"{where_(ctx)}: arange takes one dim, got [{dims}]")
    axes, local, vary = _blocks(ctx, dims)
    return ctx.out(C.cast(ctx, _global_iota(ctx, dims, axes, local, 0, dtype), vary), dims, axes)


def _key_words(ctx, key):
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(key)
        if "threefry" not in str(impl):
            raise ShapeError(f"{where_(ctx)}: md.random needs a threefry key, got {impl}")
        key = jax.random.key_data(key)
    key = jnp.asarray(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise ShapeError(f"{where_(ctx)}: expected a jax PRNG key (jax.random.key(0)), got {key.dtype}{key.shape}")
    return key[0], key[1]


def _bits(ctx, key, dims):
    """uint32 random bits of this device's block: threefry of the global linear index."""
    dims = new_dims(ctx, dims, "random dims")
    k1, k2 = _key_words(ctx, key)
    axes, local, vary = _blocks(ctx, dims)
    sizes = [ctx.position_extent(d.name, d.size) for d in dims]  # global sizes (a microbatch's: the batch's)
    # counter = (index over dims[:k], index over dims[k:]); k = 0 (jax's layout) unless > 2**32.
    k = 0
    while k < len(dims) and math.prod(sizes[k:]) >= 2 ** 32:
        k += 1
    hi = jnp.zeros(local, jnp.uint32)
    lo = jnp.zeros(local, jnp.uint32)
    for j in range(len(dims)):
        stride = math.prod(sizes[j + 1:k]) if j < k else math.prod(sizes[j + 1:])
        term = _global_iota(ctx, dims, axes, local, j, jnp.uint32) * np.uint32(stride)
        if j < k:
            hi = hi + term
        else:
            lo = lo + term
    # the four words vary alike (threefry's loop needs it): over the value's splits, and over
    # whatever the key or the positions vary over (a pipeline's microbatch index varies by stage)
    words = (k1, k2, hi, lo)
    every = set(vary).union(*(varying_axes(v) for v in words))
    if every:
        k1, k2, hi, lo = (C.cast(ctx, v, tuple(a for a in ctx.mesh.factor_axes if a in every - varying_axes(v)))
                          for v in words)
    b1, b2 = threefry2x32_p.bind(k1, k2, hi, lo)
    return b1 ^ b2, dims, axes


def _uniform01(bits):
    """Floats in [0, 1) from uint32 bits (jax.random's construction for float32)."""
    one = np.array(1.0, np.float32).view(np.uint32)
    return jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - 1.0


@op("uniform")
def uniform(ctx, key, dims, minval=0.0, maxval=1.0, dtype=jnp.float32) -> NamedArray:
    """Uniform in [minval, maxval), the same global values under every layout."""
    bits, dims, axes = _bits(ctx, key, dims)
    u = _uniform01(bits)
    y = jnp.maximum(minval, u * (maxval - minval) + minval)
    return ctx.out(y.astype(dtype), dims, axes)


@op("normal")
def normal(ctx, key, dims, dtype=jnp.float32) -> NamedArray:
    """Standard normal, the same global values under every layout."""
    bits, dims, axes = _bits(ctx, key, dims)
    lo = np.nextafter(np.float32(-1.0), np.float32(np.inf))
    u = jnp.maximum(lo, _uniform01(bits) * (1.0 - lo) + lo)
    y = np.float32(np.sqrt(2.0)) * jax.lax.erf_inv(u)
    return ctx.out(y.astype(dtype), dims, axes)


@op("bernoulli")
def bernoulli(ctx, key, p, dims) -> NamedArray:
    """True with probability ``p`` (a Python/0-d value), the same global mask under every layout."""
    if getattr(p, "ndim", 0) != 0:
        raise ShapeError(f"{where_(ctx)}: p must be a Python number or a 0-d array, got "
                         f"{type(p).__name__}; for per-element probabilities write "
                         "md.random.uniform(key, dims) < p")
    bits, dims, axes = _bits(ctx, key, dims)
    return ctx.out(_uniform01(bits) < p, dims, axes)
