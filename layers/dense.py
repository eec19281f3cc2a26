"""Dense: a kernel contracting named input dims into named output dims.

    y[..., out_dims] = sum over in_dims of  x[..., in_dims] * kernel[in_dims, out_dims]

The kernel is ``[*stack, *in_dims, *out_dims]``. Every dim of ``x`` that is not contracted is
kept, and so is every kernel dim that is neither contracted nor in ``x`` (a stacked kernel applied
outside ``md.scan`` gives one output per stack entry, by name; a dim both have, such as
``experts`` for per-expert kernels, is a batch dim of the contraction).

Communication is the einsum's (see :mod:`meshdsl.ops.einsum`): none when the layout splits only
kept dims (data parallel, Megatron's column-parallel ``d_ff``/``heads``), a pending partial sum
when it splits a contracted dim (Megatron's row-parallel output projection), and an all-gather of
the kernel when a ``params=`` rule stores it split (ZeRO-3), reduce-scattered in the backward pass.
T5 has no biases, so neither does this layer.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .params import cast, dims_of, fan_in_scale, normal_param

__all__ = ["Dense"]


class Dense(nnx.Module):
    """``y = einsum(x, kernel)`` contracting ``in_dims``, producing ``x``'s other dims + ``out_dims``.

    ``scale``: stddev of the normal init (default ``fan_in ** -0.5``). ``dtype``: compute dtype of
    the einsum (inputs and kernel are cast to it); ``param_dtype``: storage dtype of the kernel.
    """

    def __init__(self, in_dims, out_dims, *, rngs: nnx.Rngs, stack=None, dtype=jnp.float32,
                 param_dtype=jnp.float32, scale: float | None = None):
        self.in_dims = dims_of(in_dims)
        self.out_dims = dims_of(out_dims)
        if scale is None:
            scale = fan_in_scale(self.in_dims)
        self.kernel = normal_param(rngs, [*self.in_dims, *self.out_dims], scale, stack=stack, dtype=param_dtype)
        self.dtype = dtype

    def __call__(self, x: md.NamedArray) -> md.NamedArray:
        missing = [n for n in self.in_dims.names if n not in x.names]
        if missing:
            raise md.ShapeError(f"Dense [{self.in_dims}] -> [{self.out_dims}]: input [{x.dims}] lacks {missing}")
        w = self.kernel.get_value()
        contracted = set(self.in_dims.names)
        kept = [n for n in x.names if n not in contracted]
        out = kept + [n for n in w.names if n not in contracted and n not in kept]
        return md.einsum(cast(x, self.dtype), cast(w, self.dtype), out=out)
