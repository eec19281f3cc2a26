"""RMSNorm (T5LayerNorm): scale by the root mean square over ``d_model``; no mean, no bias.

    variance[...] = mean over d_model of  float32(x)[..., d_model] ** 2
    y[..., d_model] = cast(float32(x) * rsqrt(variance + eps), out dtype) * scale[d_model]

The statistics are always float32 (a float16 ``x`` of a few hundred would overflow its own square).
The output dtype is ``dtype``, by default the input's: the same as Hugging Face's T5LayerNorm
whenever the weights and activations share a dtype (it casts the normalised value to the weight's
dtype when that is half precision, then multiplies).

With ``d_model`` split over a mesh axis (2-D layouts) the mean is a local sum plus one all-reduce
of a ``[batch, seq]`` statistic; otherwise nothing moves.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .params import cast, constant_param

__all__ = ["RMSNorm"]


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x**2 over dim) + eps) * scale``; ``scale`` (``[*stack, dim]``) starts at one."""

    def __init__(self, dim: md.Dim, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None, stack=None,
                 dtype=None, param_dtype=jnp.float32):
        del rngs  # deterministic init; accepted so every layer is built the same way
        self.dim, self.eps, self.dtype = dim, eps, dtype
        self.scale = constant_param([dim], 1.0, stack=stack, dtype=param_dtype)

    def __call__(self, x: md.NamedArray) -> md.NamedArray:
        out_dtype = x.dtype if self.dtype is None else self.dtype
        x32 = cast(x, jnp.float32)
        variance = md.mean(md.square(x32), self.dim.name)
        normed = cast(x32 * md.rsqrt(variance + self.eps), out_dtype)
        return normed * cast(self.scale.get_value(), out_dtype)
