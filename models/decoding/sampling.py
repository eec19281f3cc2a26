"""Sampling in named ops: temperature, top-k and top-p filtering, Gumbel-max draws.

All three filters are Hugging Face's logits warpers (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, applied in that order), written over a named
``vocab`` dim so they run under any layout (a split ``vocab`` costs one small all-gather of the
top-k candidates per device):

* top-k: keep the logits ``>=`` the k-th largest (``md.top_k``), the rest become ``-inf``;
* top-p: sort the probabilities (``md.top_k`` over the whole vocabulary), keep a token when the
  probability mass strictly ahead of it is ``< top_p`` (HF: remove when the ascending cumulative
  mass up to it is ``<= 1 - top_p``); the most likely token is always kept.

A sample is ``argmax(logits + g)`` with Gumbel noise ``g = -log(-log(u))`` and ``u`` from
``md.random.uniform`` over the logits' dims: the same global numbers under every layout, so a
sampled sequence does not depend on how ``vocab`` or ``batch`` are split.

A padded vocabulary's padding rows come masked by the model (the dtype's most negative value, or
``-inf`` after a temperature below 1): no filter keeps them and no draw picks them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import meshdsl as md

__all__ = ["filter_logits", "gumbel_argmax"]

_TINY = float(np.finfo(np.float32).tiny)


def filter_logits(logits: md.NamedArray, dim: str = "vocab", *, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> md.NamedArray:
    """``logits / temperature`` with the tokens outside top-k / top-p set to ``-inf`` (float32)."""
    x = logits.astype(jnp.float32)
    if temperature != 1.0:
        x = x / temperature
    if top_k is not None and top_k < x.dims[dim].size:
        values, _ = md.top_k(x, dim, top_k, out="top_k_")
        x = md.where(x < md.min(values, "top_k_"), -jnp.inf, x)
    if top_p is not None and top_p < 1.0:
        ordered, _ = md.top_k(x, dim, x.dims[dim].size, out="sorted_")
        probs = md.softmax(ordered, "sorted_")
        ahead = md.cumsum(probs, "sorted_") - probs
        kept = md.where(ahead < top_p, ordered, jnp.inf)
        x = md.where(x < md.min(kept, "sorted_"), -jnp.inf, x)
    return x


def gumbel_argmax(logits: md.NamedArray, dim: str, key) -> md.NamedArray:
    """A draw from ``softmax(logits)`` along ``dim`` (int32, without ``dim``): Gumbel-max with
    layout-invariant uniforms."""
    u = md.random.uniform(key, logits.dims, minval=_TINY, maxval=1.0)
    return md.argmax(logits - md.log(-md.log(u)), dim)
