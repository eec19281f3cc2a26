"""``md.random``: layout-invariant random numbers (see :mod:`meshdsl.ops.creation`).

``md.random.normal(key, dims)``, ``md.random.uniform(key, dims, minval, maxval)`` and
``md.random.bernoulli(key, p, dims)`` take a jax PRNG key and give the same global values under
every layout and on one device.
"""

from .ops.creation import bernoulli, normal, uniform

__all__ = ["normal", "uniform", "bernoulli"]
