"""Optimizers and learning-rate schedules of the training CLI (optax).

* ``adafactor`` (default, T5's): ``optax.adafactor`` with factored second moments, update clipping
  at 1.0 and parameter-scaled steps, on T5's inverse-square-root schedule
  ``lr * sqrt(warmup / max(step, warmup))`` - with ``lr=1e-2, warmup=10_000`` that is T5X's
  ``1 / sqrt(max(step, 10_000))``: constant 1e-2 for 10k steps, then decaying.
* ``adamw``: global-norm clipping at 1.0, then AdamW (weight decay on matrices only) with linear
  warmup and a cosine (or ``rsqrt``) decay.

The updates run on the *global* gradient arrays that ``md.lower`` returns (laid out like the
parameters), so Adafactor's row/column means and the global norm see whole values: XLA adds the
small reductions they need over a sharded parameter, and every elementwise step is local.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import meshdsl as md

__all__ = ["OPTIMIZERS", "DEFAULT_LR", "default_warmup", "schedule", "make_optimizer"]

OPTIMIZERS = ("adafactor", "adamw")
DEFAULT_LR = {"adafactor": 1e-2, "adamw": 1e-3}


def default_warmup(optimizer: str, steps: int) -> int:
    """T5's 10k constant steps for Adafactor; 5 % of the run for AdamW."""
    return 10_000 if optimizer == "adafactor" else max(1, steps // 20)


def schedule(optimizer: str, lr: float, warmup: int, steps: int, decay: str = "cosine") -> optax.Schedule:
    """The learning rate as a function of the (0-based) update count."""
    if optimizer == "adafactor" or decay == "rsqrt":
        warm = float(max(warmup, 1))

        def rsqrt(count):
            step = jnp.maximum(count.astype(jnp.float32) + 1.0, warm)
            ramp = 1.0 if optimizer == "adafactor" else jnp.minimum(1.0, (count + 1.0) / warm)
            return lr * ramp * jnp.sqrt(warm / step)
        return rsqrt
    return optax.warmup_cosine_decay_schedule(lr / max(warmup, 1), lr, max(warmup, 1), max(steps, warmup + 1),
                                              end_value=lr * 0.1)


def _matrices(params):
    """Weight-decay mask: True for parameters of two or more dims (not norm scales or biases)."""
    return jax.tree_util.tree_map(lambda x: x.ndim >= 2 if isinstance(x, md.NamedArray) else jnp.ndim(x) >= 2,
                                  params, is_leaf=lambda x: isinstance(x, md.NamedArray))


def make_optimizer(optimizer: str, lr: float | None = None, warmup: int | None = None, steps: int = 1000,
                   decay: str = "cosine", weight_decay: float = 0.01):
    """``(optax transformation, schedule)`` for ``optimizer`` (see the module docstring)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    warmup = default_warmup(optimizer, steps) if warmup is None else warmup
    sched = schedule(optimizer, lr, warmup, steps, decay)
    if optimizer == "adafactor":
        return optax.adafactor(learning_rate=sched), sched
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=weight_decay, mask=_matrices))
    return tx, sched
