"""Embedding: a table ``[vocab, d_model]`` looked up by token ids, and its transpose for logits.

    embed(ids)[..., d_model]  = table[ids[...], d_model]
    attend(x)[..., vocab]     = sum over d_model of  x[..., d_model] * table[vocab, d_model]

With ``vocab`` split over a mesh axis (Megatron's vocab-parallel embedding) each device looks up
the rows it holds and leaves a pending partial sum, reduced once where the value is next needed;
``attend`` then gives logits split over ``vocab`` with no communication. A table stored split over
``d_model`` (ZeRO-3) is gathered at use.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .params import cast, normal_param

__all__ = ["Embedding"]


class Embedding(nnx.Module):
    """Token embedding ``[*stack, vocab, features]``, init ``N(0, scale**2)`` (T5: stddev 1)."""

    def __init__(self, vocab: md.Dim, features: md.Dim, *, rngs: nnx.Rngs, stack=None, scale: float = 1.0,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        self.vocab, self.features = vocab, features
        self.embedding = normal_param(rngs, [vocab, features], scale, stack=stack, dtype=param_dtype)
        self.dtype = dtype

    def __call__(self, ids: md.NamedArray) -> md.NamedArray:
        """Rows of the table for integer ``ids``: dims ``[*ids.dims, features]``."""
        return md.take(cast(self.embedding.get_value(), self.dtype), ids, self.vocab.name)

    def attend(self, x: md.NamedArray) -> md.NamedArray:
        """Logits over the vocabulary: ``x``'s dims with ``features`` replaced by ``vocab``."""
        if self.features.name not in x.names:
            raise md.ShapeError(f"Embedding.attend: input [{x.dims}] lacks {self.features.name!r}")
        table = cast(self.embedding.get_value(), self.dtype)
        out = [n for n in x.names if n != self.features.name]
        out += [n for n in table.names if n != self.features.name and n not in out]
        return md.einsum(cast(x, self.dtype), table, out=out)
