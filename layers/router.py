"""Token-choice routing for mixture-of-experts (Switch top-1, GShard top-2), in float32.

Tokens come in groups, ``x[group, group_size, d_model]``. The router scores every expert:

    logits[group, group_size, expert_choice] = float32(x) · w_router   (x jittered when training)
    probs = softmax over expert_choice of logits
    gates, index[..., choice] = top_k over expert_choice of probs       (choice: k = 1 or 2)

Each expert takes at most ``capacity`` tokens per group. A token's slot in its expert's buffer is
its rank among the group's assignments to that expert - every first choice in token order, then
every second choice (GShard) - so ``position = cumsum over group_size`` plus the totals of the
earlier choices; assignments at ``position > capacity`` are dropped (the token gets nothing from
that expert and passes through the residual). The results are two
``[group, group_size, expert_choice, capacity]`` tensors: ``dispatch`` (0/1) and ``combine``
(dispatch times the gate: Switch's router probability; GShard's gates renormalised to sum to one).

Top-1 is Hugging Face's ``SwitchTransformersTop1Router``: argmax of the probabilities (cast to the
input dtype), the inclusive cumsum of the one-hot choice over the group, ``<= capacity`` kept, the
chosen probability as the gate. Auxiliary losses, per group then averaged:

    load_balancing_loss = E * sum_e f_e * P_e   (f_e: fraction of the group whose first choice is
                                                 e, before capacity; P_e: mean probability of e)
    router_z_loss       = mean over tokens of logsumexp(logits)^2

(Hugging Face's ``load_balancing_loss_func`` counts f_e after capacity, where a dropped token
counts for expert 0; the two agree whenever no token is dropped.)

The expert dim is ``expert_choice``, a name no layout places, so routing never follows the
``experts`` rule: with ``group`` split (expert or data parallelism) it is local to each device's
groups; a split ``d_model`` (2-D layouts) costs one all-reduce of the router logits. The metrics are
means over groups: small pending sums, reduced where they are used. :mod:`meshdsl.layers.moe` then
moves the dispatched tokens to the experts with one all-to-all.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

import meshdsl as md

from .dense import Dense

__all__ = ["Router", "Routing", "route", "token_metrics", "expert_capacity", "EXPERT_CHOICE"]

EXPERT_CHOICE = "expert_choice"


def expert_capacity(group_size: int, num_experts: int, top_k: int, capacity_factor: float,
                    min_capacity: int = 4) -> int:
    """Slots per expert and group: ``ceil(group_size * capacity_factor * top_k / num_experts)``,
    at least ``min_capacity``, at most ``group_size`` (an expert never gets more from one group)."""
    wanted = math.ceil(group_size * capacity_factor * top_k / num_experts)
    return min(group_size, max(min_capacity, wanted))


@dataclasses.dataclass
class Routing:
    """Where each token goes: ``dispatch``/``combine`` ``[group, group_size, expert_choice, capacity]``,
    the first-choice ``gate`` ``[group, group_size]``, and the router's metrics."""

    dispatch: md.NamedArray
    combine: md.NamedArray
    gate: md.NamedArray
    metrics: dict


def route(logits: md.NamedArray, probs: md.NamedArray, *, top_k: int, capacity: int,
          renormalize: bool = True, per_token: bool = False) -> Routing:
    """Routing tensors and metrics from router ``logits`` (float32) and ``probs`` (any float).
    ``per_token``: the metrics per token (:func:`token_metrics`) instead of their means."""
    experts = probs.dims[EXPERT_CHOICE]
    tokens = probs.dims["group"].size * probs.dims["group_size"].size
    gates, index = md.top_k(probs, EXPERT_CHOICE, k=top_k, out="choice")           # [group group_size choice]
    if top_k > 1 and renormalize:
        gates = gates / (md.sum(gates, "choice") + 1e-9)
    chosen = md.one_hot(index, experts, dtype=jnp.int32)                           # [... choice expert_choice]

    # 1-based slot in the expert's buffer: earlier tokens' and earlier choices' assignments first.
    per_choice = md.sum(chosen, "group_size")                                      # [group choice expert_choice]
    earlier_choices = md.cumsum(per_choice, "choice") - per_choice
    position = (md.cumsum(chosen, "group_size") + earlier_choices) * chosen
    kept = chosen * (position <= capacity)
    # A token picks an expert at most once, so summing over choice keeps one entry per expert.
    slot = md.one_hot(md.sum(position * kept, "choice") - 1, md.Dim("capacity", capacity))
    dispatch = md.sum(kept, "choice").astype(jnp.float32) * slot                  # [group group_size expert_choice capacity]
    combine = md.sum(kept * gates.astype(jnp.float32), "choice") * slot

    first = md.sum(md.slice(chosen, "choice", 0, 1), "choice").astype(jnp.float32)  # first choice, before capacity
    density = md.mean(first, "group_size")                                         # f_e per group
    mean_prob = md.mean(md.softmax(logits, EXPERT_CHOICE), "group_size")           # P_e per group
    if per_token:
        return Routing(dispatch, combine, md.max(probs, EXPERT_CHOICE),
                       token_metrics(logits, density * mean_prob, chosen, kept, top_k))
    per_expert = md.sum(chosen, "group group_size choice").astype(jnp.float32)
    metrics = {
        "load_balancing_loss": md.mean(density * mean_prob) * float(experts.size ** 2),
        "router_z_loss": md.mean(md.square(md.logsumexp(logits, EXPERT_CHOICE))),
        "dropped_fraction": 1.0 - md.sum(kept).astype(jnp.float32) / float(tokens * top_k),
        "expert_load": md.rename(per_expert / float(tokens * top_k), {EXPERT_CHOICE: "experts"}),
    }
    return Routing(dispatch, combine, md.max(probs, EXPERT_CHOICE), metrics)


def token_metrics(logits, balance, chosen, kept, top_k: int) -> dict:
    """The router's metrics per token ``[group, group_size]`` (``expert_load``: ``[..., expert_choice]``),
    whose means over all tokens are :func:`route`'s metrics: a token carries its group's
    load-balancing term (``balance``: ``f_e * P_e`` per group), its own ``logsumexp^2``, the share of
    its ``top_k`` assignments dropped, and its choices. A value per token (per example) is what a
    pipeline can assemble from microbatches exactly; the mean over the batch comes after."""
    experts = logits.dims[EXPERT_CHOICE].size
    tokens = md.ones(logits.dims["group_size"])
    choices = md.sum(chosen, "choice").astype(jnp.float32) / float(top_k)        # [group group_size expert_choice]
    return {
        "load_balancing_loss": md.sum(balance, EXPERT_CHOICE) * float(experts) * tokens,
        "router_z_loss": md.square(md.logsumexp(logits, EXPERT_CHOICE)),
        "dropped_fraction": 1.0 - md.sum(kept, "choice " + EXPERT_CHOICE).astype(jnp.float32) / float(top_k),
        "expert_load": choices,   # over expert_choice: never placed with the tokens' split (no layout rule)
    }


class Router(nnx.Module):
    """Router ``classifier`` ``[*stack, d_model, expert_choice]`` (float32 compute); top-k routing.

    ``jitter_noise``: when a key is given, router inputs are multiplied by
    ``uniform(1 - jitter_noise, 1 + jitter_noise)`` (Switch). ``renormalize``: GShard's top-k gates
    divided by their sum (top-1 is never renormalised).
    """

    def __init__(self, d_model: md.Dim, experts: md.Dim, *, rngs: nnx.Rngs, top_k: int = 1,
                 jitter_noise: float = 0.0, renormalize: bool = True, stack=None, scale: float | None = None,
                 param_dtype=jnp.float32):
        if not 1 <= top_k <= experts.size:
            raise md.MeshDSLError(f"Router: top_k={top_k} must be in 1..{experts.size} (number of experts)")
        self.top_k, self.jitter_noise, self.renormalize = top_k, jitter_noise, renormalize
        self.classifier = Dense(d_model, md.Dim(EXPERT_CHOICE, experts.size), rngs=rngs, stack=stack,
                                dtype=jnp.float32, param_dtype=param_dtype, scale=scale)

    def __call__(self, x: md.NamedArray, capacity: int, *, key=None, per_token: bool = False) -> Routing:
        """Route ``x`` ``[group, group_size, d_model]``; ``key`` enables jitter noise; ``per_token``:
        metrics per token (:func:`token_metrics`)."""
        x32 = x.astype(jnp.float32)
        if key is not None and self.jitter_noise > 0:
            x32 = x32 * md.random.uniform(key, x32.dims, 1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        logits = self.classifier(x32)
        probs = md.softmax(logits, EXPERT_CHOICE).astype(x.dtype)  # HF: cast back to the input dtype
        return route(logits, probs, top_k=self.top_k, capacity=capacity, renormalize=self.renormalize,
                     per_token=per_token)
