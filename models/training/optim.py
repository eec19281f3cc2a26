"""Optimizers and learning-rate schedules of the training CLI (optax), with each model family's defaults.

* ``adafactor`` (T5 / MoE-T5's default, T5's recipe): ``optax.adafactor`` with factored second
  moments, update clipping at 1.0 and parameter-scaled steps, on T5's inverse-square-root schedule
  ``lr * sqrt(warmup / max(step, warmup))`` - with ``lr=1e-2, warmup=10_000`` that is T5X's
  ``1 / sqrt(max(step, 10_000))``: constant 1e-2 for 10k steps, then decaying.
* ``adamw`` (Llama's default): global-norm clipping at 1.0, then AdamW (weight decay on matrices
  only) with linear warmup and a cosine decay to 10 % of the peak (or ``rsqrt``). Its moments and
  weight decay are the family's (:data:`ADAMW`): Llama's recipe (Touvron et al. 2023) b1 0.9,
  b2 0.95, weight decay 0.1, warmup 5 % of the run up to Llama 2's 2000 steps; T5's b2 0.98,
  weight decay 0.01, warmup 5 % of the run.

The updates run on the *global* gradient arrays that ``md.lower`` returns (laid out like the
parameters), so Adafactor's row/column means and the global norm see whole values: XLA adds the
small reductions they need over a sharded parameter, and every elementwise step is local.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import meshdsl as md

__all__ = ["OPTIMIZERS", "DEFAULT_LR", "DEFAULT_OPTIMIZER", "ADAMW", "family_of", "default_warmup", "schedule",
           "make_optimizer"]

OPTIMIZERS = ("adafactor", "adamw")
DEFAULT_LR = {"adafactor": 1e-2, "adamw": 1e-3}
#: the optimizer each model family trains with unless told otherwise (``--optimizer``)
DEFAULT_OPTIMIZER = {"encoder-decoder": "adafactor", "decoder-only": "adamw"}
#: AdamW's moments and weight decay per model family
ADAMW = {"encoder-decoder": {"b1": 0.9, "b2": 0.98, "weight_decay": 0.01},
         "decoder-only": {"b1": 0.9, "b2": 0.95, "weight_decay": 0.1}}
LLAMA_WARMUP = 2000   # Llama 2's warmup steps: the most a decoder-only run's default warmup takes


def family_of(config) -> str:
    """``"decoder-only"`` (Llama) or ``"encoder-decoder"`` (T5 / MoE-T5): the key of the defaults here."""
    return "decoder-only" if getattr(config, "decoder_only", False) else "encoder-decoder"


def default_warmup(optimizer: str, steps: int, family: str = "encoder-decoder") -> int:
    """T5's 10k constant steps for Adafactor; 5 % of the run for AdamW (a decoder-only model's at
    most Llama 2's 2000 steps)."""
    if optimizer == "adafactor":
        return 10_000
    warmup = max(1, steps // 20)
    return min(warmup, LLAMA_WARMUP) if family == "decoder-only" else warmup


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
                   decay: str = "cosine", weight_decay: float | None = None, *, family: str = "encoder-decoder"):
    """``(optax transformation, schedule)`` for ``optimizer`` (see the module docstring); AdamW's
    moments and weight decay are ``family``'s (:data:`ADAMW`) unless ``weight_decay`` is given."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if family not in ADAMW:
        raise ValueError(f"family must be one of {tuple(ADAMW)}, got {family!r}")
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    warmup = default_warmup(optimizer, steps, family) if warmup is None else warmup
    sched = schedule(optimizer, lr, warmup, steps, decay)
    if optimizer == "adafactor":
        return optax.adafactor(learning_rate=sched), sched
    hyper = {**ADAMW[family], **({} if weight_decay is None else {"weight_decay": weight_decay})}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, **hyper, mask=_matrices))
    return tx, sched
