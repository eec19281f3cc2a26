"""Parameters over named dims: how every layer creates its weights.

A parameter is ``nnx.Param(md.param(NamedArray))``: its dim names alone decide where it lives (the
layout's compute rules, plus ``params=`` storage rules at rest), so layers never mention a mesh.

Values are drawn with ``md.random.normal`` - a function of the key and each element's *global*
position - so a model initialised inside ``md.lower`` under any layout, or on one device, holds
the same numbers. Creating a parameter communicates nothing.

``stack`` (a ``Dim`` such as ``Dim("layers", 24)``, or several) is prepended to a parameter's
dims: a stack of identical layers is one module whose parameters all carry the stack dim, run with
``md.scan`` (see :mod:`meshdsl.layers.stack`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import meshdsl as md

__all__ = ["dims_of", "stack_dims", "normal_param", "constant_param", "cast"]


def dims_of(spec) -> md.Shape:
    """A ``Dim``, a sequence of Dims, or ``"name:size ..."`` -> a :class:`md.Shape`."""
    return md.shape(spec)


def stack_dims(stack) -> md.Shape:
    """The leading stack dims: ``None`` -> none; a ``Dim`` or a sequence of them."""
    return md.shape(()) if stack is None else md.shape(stack)


def fan_in_scale(dims) -> float:
    """``fan_in ** -0.5`` for a kernel contracting ``dims``."""
    return math.prod(d.size for d in dims) ** -0.5


@functools.partial(jax.jit, static_argnames=("dims", "dtype"))
def _scaled_normal(key, scale, dims, dtype):
    # One compiled program per shape: drawn op by op, the counter-based generator compiles each of
    # its small steps separately (about half a second per new shape on a CPU).
    return md.param((md.random.normal(key, dims) * scale).astype(dtype))


def normal_param(rngs: nnx.Rngs, dims, scale: float, *, stack=None, dtype=jnp.float32) -> nnx.Param:
    """``scale * N(0, 1)`` over ``[*stack, *dims]``, the same global values under every layout."""
    full = md.shape([*stack_dims(stack), *dims_of(dims)])
    return nnx.Param(_scaled_normal(rngs.params(), jnp.float32(scale), full, jnp.dtype(dtype)))


def constant_param(dims, value: float, *, stack=None, dtype=jnp.float32) -> nnx.Param:
    """``value`` everywhere over ``[*stack, *dims]`` (norm scales start at one)."""
    full = md.shape([*stack_dims(stack), *dims_of(dims)])
    return nnx.Param(md.param(md.full(full, value, dtype)))


def cast(x: md.NamedArray, dtype) -> md.NamedArray:
    """``x`` in ``dtype`` (no op when it already is; ``None`` keeps it)."""
    if dtype is None or x.dtype == jnp.dtype(dtype):
        return x
    return x.astype(dtype)
