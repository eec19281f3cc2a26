"""Embedding: a table ``[vocab, d_model]`` looked up by token ids, and its transpose for logits.

    embed(ids)[..., d_model]  = table[ids[...], d_model]
    attend(x)[..., vocab]     = sum over d_model of  x[..., d_model] * table[vocab, d_model]

With ``vocab`` split over a mesh axis (Megatron's vocab-parallel embedding) each device looks up
the rows it holds and leaves a pending partial sum, reduced once where the value is next needed;
``attend`` then gives logits split over ``vocab`` with no communication. A table stored split over
``d_model`` (ZeRO-3) is gathered at use.

A padded vocabulary (Megatron's ``--make-vocab-size-divisible-by``): the table has more rows than
the tokenizer has tokens, so that a mesh axis divides ``vocab``. :func:`mask_padding` sets the
logits of the padding rows to the dtype's most negative value: they never win an argmax, a top-k
or a sample, and add nothing to a softmax or a logsumexp (nor get a gradient).

    masked[..., vocab] = logits[..., vocab]  if position(vocab) < size  else  min(dtype)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .params import cast, normal_param

__all__ = ["Embedding", "mask_padding"]


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


def mask_padding(logits: md.NamedArray, size: int, dim: str = "vocab") -> md.NamedArray:
    """``logits`` with the entries at positions ``>= size`` along ``dim`` (the padding rows of the
    table) set to the most negative value of their dtype; unchanged when ``dim`` has ``size``
    entries. Named ops only: runs with ``dim`` split over mesh axes (each device masks its block)."""
    padded = logits.dims[dim]
    if size > padded.size:
        raise md.ShapeError(f"mask_padding: {size} true entries do not fit in [{logits.dims}]'s {dim!r} "
                            f"of size {padded.size}")
    if size == padded.size:
        return logits
    real = md.arange(padded) < size
    masked = md.where(real, logits, jnp.finfo(logits.dtype).min)
    return masked if masked.names == logits.names else md.transpose(masked, logits.names)
