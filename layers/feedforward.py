"""T5 feed-forward blocks: plain (T5 v1.0, ReLU) and gated (T5 v1.1, gated-GELU).

    plain:  h[..., d_ff] = act(x · wi)
    gated:  h[..., d_ff] = act(x · wi_0) * (x · wi_1)
    y[..., d_model]      = dropout(h) · wo

``activation`` follows Hugging Face's ``feed_forward_proj``: ``"relu"``, ``"gelu"`` (exact erf
GELU), ``"gelu_new"`` (tanh approximation), ``"silu"``, each optionally ``"gated-"``; as in HF,
``"gated-gelu"`` means the tanh approximation (``gelu_new``).

Under Megatron (``d_ff`` split) both input projections and the activation are local and ``wo``
leaves one pending partial sum, reduced once; in the backward pass the two input cotangents of the
gated form are added before their single reduction. Expert FFNs reuse this block with an
``experts`` dim in ``stack`` (see :mod:`meshdsl.layers.moe`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .dense import Dense
from .dropout import dropout

__all__ = ["FeedForward", "ACTIVATIONS", "activation_fn"]

ACTIVATIONS = {
    "relu": md.relu,
    "gelu": lambda x: md.gelu(x, approximate=False),
    "gelu_new": lambda x: md.gelu(x, approximate=True),
    "silu": md.silu,
    "swish": md.silu,
}


def activation_fn(activation: str):
    """``(is_gated, fn)`` for a HF-style ``feed_forward_proj`` string."""
    gated = activation.startswith("gated-")
    name = activation[len("gated-"):] if gated else activation
    if gated and name == "gelu":
        name = "gelu_new"  # HF: feed_forward_proj == "gated-gelu" uses gelu_new
    if name not in ACTIVATIONS:
        raise md.MeshDSLError(f"unknown activation {activation!r}; use one of "
                              f"{sorted(ACTIVATIONS)}, optionally prefixed 'gated-'")
    return gated, ACTIVATIONS[name]


class FeedForward(nnx.Module):
    """``wo(dropout(act(wi(x))))`` or the gated form; kernels ``[*stack, d_model, d_ff]`` and
    ``[*stack, d_ff, d_model]`` (HF init: stddev ``d_model**-0.5`` in, ``d_ff**-0.5`` out)."""

    def __init__(self, d_model: md.Dim, d_ff: md.Dim, *, rngs: nnx.Rngs, activation: str = "gated-gelu",
                 dropout_rate: float = 0.0, stack=None, dtype=jnp.float32, param_dtype=jnp.float32):
        self.activation, self.dropout_rate = activation, dropout_rate
        self.gated, _ = activation_fn(activation)
        dense = dict(rngs=rngs, stack=stack, dtype=dtype, param_dtype=param_dtype)
        if self.gated:
            self.wi_0 = Dense(d_model, d_ff, **dense)
            self.wi_1 = Dense(d_model, d_ff, **dense)
        else:
            self.wi = Dense(d_model, d_ff, **dense)
        self.wo = Dense(d_ff, d_model, **dense)

    def __call__(self, x: md.NamedArray, key=None) -> md.NamedArray:
        """``x``: ``[..., d_model]`` -> ``[..., d_model]``; ``key``: PRNG key for dropout or None."""
        _, act = activation_fn(self.activation)
        if self.gated:
            h = act(self.wi_0(x)) * self.wi_1(x)
        else:
            h = act(self.wi(x))
        return self.wo(dropout(h, self.dropout_rate, key))
