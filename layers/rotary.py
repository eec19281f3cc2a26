"""Rotary position embeddings (RoFormer, Su et al. 2021) over named dims, in Llama's convention.

    inv_freq[half]          = rope_theta ** -(2 * half / d_head)            half = 0 .. d_head/2 - 1
    angle[..., half]        = float32(position[...]) * inv_freq[half]
    x1, x2                  = the first and second halves of x along d_head   (md.slice)
    rotate(x)[..., d_head]  = concat(x1 * cos - x2 * sin,  x2 * cos + x1 * sin) along d_head

That is Hugging Face Llama's ``q * cos + rotate_half(q) * sin`` with ``rotate_half(x) =
concat(-x2, x1)`` and ``cos = cos(concat(angle, angle))``: each dimension ``i`` of the first half
is rotated together with dimension ``i + d_head/2`` (not the interleaved pairs of the paper), so
Hugging Face's ``q_proj`` / ``k_proj`` weights import unpermuted.

``positions`` is an integer NamedArray with any dims (``[length]`` for a batch of unpadded rows,
``[batch, length]`` for per-row positions, ``[batch, length:1]`` for one decoded token); the
angles have those dims plus ``d_head`` (of size ``d_head/2``), and broadcast by name over the
heads of ``q`` and ``k``. Nothing here has parameters or communicates: each device computes the
angles of the positions it holds (``md.arange`` blocks), and the rotation is elementwise over every
dim but ``d_head`` (a layout that split ``d_head`` would have to gather it for the halves).
"""

from __future__ import annotations

import jax.numpy as jnp

import meshdsl as md

__all__ = ["rotary_angles", "apply_rotary"]


def rotary_angles(positions: md.NamedArray, d_head: md.Dim, theta: float = 10000.0):
    """``(cos, sin)`` float32 ``[*positions.dims, d_head/2]`` (named ``d_head.name``) of the angles
    ``position * theta ** -(2i / d_head)``, as Hugging Face's ``LlamaRotaryEmbedding`` computes them."""
    if d_head.size % 2:
        raise md.ShapeError(f"rotary embeddings rotate pairs of features: {d_head} must be even")
    half = md.Dim(d_head.name, d_head.size // 2)
    exponent = (md.arange(half) * 2).astype(jnp.float32) / d_head.size
    inv_freq = 1.0 / md.power(jnp.float32(theta), exponent)
    angle = positions.astype(jnp.float32) * inv_freq
    return md.cos(angle), md.sin(angle)


def apply_rotary(x: md.NamedArray, cos: md.NamedArray, sin: md.NamedArray, dim: str = "d_head") -> md.NamedArray:
    """``x`` (any dims including ``dim``) rotated by the angles of :func:`rotary_angles`; the
    angles broadcast by name (``x``'s other dims must include theirs). Computed in ``x``'s dtype."""
    n = x.dims[dim].size
    x1, x2 = md.slice(x, dim, 0, n // 2), md.slice(x, dim, n // 2, n - n // 2)
    c, s = cos.astype(x.dtype), sin.astype(x.dtype)
    rotated = md.concat([x1 * c - x2 * s, x2 * c + x1 * s], dim)
    return md.transpose(rotated, x.names) if rotated.names != x.names else rotated

